"""The LM head's vocabulary cut over the CPU streams: the same logits, bit
for bit, and only where mlx computes on the CPU with a float head."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker.runtime import cpu_head, cpu_streams

cpu_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's route")


@cpu_only
@pytest.mark.parametrize("rows", [1, 8])
def test_the_cut_product_is_the_whole_one_bit_for_bit(rows):
    mx.random.seed(3)
    weight = mx.random.normal((1001, 64))  # a vocabulary no stream count divides
    x = mx.random.normal((rows, 1, 64))
    assert mx.array_equal(cpu_head.logits(x, weight), x @ weight.T).item()


@cpu_only
def test_a_load_cuts_a_float_head_and_the_model_computes_the_same(tiny_model, monkeypatch):
    from worker.runtime import loader
    from worker.runtime.parts import head_module

    assert not cpu_head.install(loader.load(tiny_model).model)  # a small head stays whole
    monkeypatch.setattr(cpu_head, "CUT_FROM", 0)
    cut = loader.load(tiny_model).model
    monkeypatch.setattr(cpu_head, "install", lambda model, where=None: False)
    whole = loader.load(tiny_model).model
    two_streams = len(cpu_streams.streams()) >= 2
    assert isinstance(head_module(cut), (cpu_head._CutLinear, cpu_head._CutEmbedding)) == two_streams
    assert type(head_module(whole)) in (nn.Linear, nn.Embedding)
    tokens = mx.array([[5, 17, 230, 9, 41]])
    assert mx.array_equal(cut(tokens), whole(tokens)).item()


@cpu_only
def test_only_a_float_head_on_the_cpu_is_cut(tiny_model, tiny_q4_model, monkeypatch):
    from worker.runtime import loader
    from worker.runtime.parts import head_module, text_model

    monkeypatch.setattr(cpu_head, "CUT_FROM", 0)
    two_streams = len(cpu_streams.streams()) >= 2
    text = text_model(loader.load(tiny_model).model)
    assert not cpu_head.install(text, where="cuda") and not cpu_head.install(text, where="metal")
    quantized = text_model(loader.load(tiny_q4_model).model)
    assert not isinstance(head_module(quantized), (cpu_head._CutLinear, cpu_head._CutEmbedding))
    assert not cpu_head.install(quantized, where="cpu")
    # A float head of its own (untied), and a tied float embedding.
    text.lm_head = nn.Linear(64, 1001, bias=False)
    assert cpu_head.install(text, where="cpu") == two_streams
    del text["lm_head"]
    text.model.embed_tokens = nn.Embedding(1001, 64)
    assert cpu_head.install(text, where="cpu") == two_streams
    # A head with a bias is left to mlx.
    text.lm_head = nn.Linear(64, 1001, bias=True)
    assert not cpu_head.install(text, where="cpu") and type(text.lm_head) is nn.Linear
    if two_streams:
        x = mx.random.normal((2, 1, 64))
        table = text.model.embed_tokens
        assert type(table) is cpu_head._CutEmbedding and mx.array_equal(table.as_linear(x), x @ table.weight.T).item()
