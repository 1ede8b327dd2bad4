"""The worker's embeddings engine in this process (worker.engine.embed):
long inputs read in chunks, batches split by padded tokens, cancel, bad
ids; each vector against one plain forward of the same model."""

from __future__ import annotations

import base64

import mlx.core as mx
import numpy as np
import pytest

from harness.engine import events
from ipc.messages import Embed
from worker.engine import embed as embed_module
from worker.engine.embed import Embedder

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_model):
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    model = load(tiny_model)
    return model, TextCodec(tiny_model, model.config)


def embedder(loaded, **kw) -> tuple[Embedder, list[bytes]]:
    model, codec = loaded
    lines: list[bytes] = []
    kw.setdefault("max_context", None)
    return Embedder(model.model, model.config, codec, lines.append, chunk=64, **kw), lines


def drain(e: Embedder) -> None:
    steps = 0
    while e.has_work:
        e.step()
        steps += 1
        assert steps < 1000


def vectors(lines: list[bytes], rid_json: str) -> dict[int, np.ndarray]:
    return {ev["index"]: np.frombuffer(base64.b64decode(ev["embedding"]), "<f4") for ev in events(lines) if ev["ev"] == "embedding" and ev["id"] == rid_json}


def one_forward(loaded, ids: list[int]) -> np.ndarray:
    """The last token's state of the whole sequence in one forward, normalised."""
    model, _ = loaded
    hidden = np.array(model.model.model(mx.array([ids]))[0, -1].astype(mx.float32))
    return hidden / np.linalg.norm(hidden)


def test_long_inputs_in_chunks_and_split_batches_equal_one_forward(loaded, monkeypatch):
    _, codec = loaded
    # Small bounds, so that a few inputs take every path: two batches, and a
    # long input read 64 tokens at a time through a cache.
    monkeypatch.setattr(embed_module, "BATCH_TOKENS", 16)
    monkeypatch.setattr(embed_module, "LONG_TOKENS", 40)
    e, lines = embedder(loaded)
    texts = ["The river runs past the mill.", "Hi", "An old stone bridge " * 12, "spring water"]
    e.submit(Embed(rid=1, inputs=texts, id_json='"a"'), 0.0)
    drain(e)
    got = vectors(lines, "a")
    assert sorted(got) == [0, 1, 2, 3]
    eod = codec.tokenizer.token_to_id("<|endoftext|>")
    for i, text in enumerate(texts):
        ids = codec.encode(text) + [eod]
        assert np.abs(got[i] - one_forward(loaded, ids)).max() < TOLERANCE, i
    done = events(lines)[-1]
    assert done["done"] and done["prompt_tokens"] == sum(len(codec.encode(t)) + 1 for t in texts)
    assert len(codec.encode(texts[2])) > 64  # it did take more than one chunk


def test_cancel_bad_ids_and_truncation(loaded):
    e, lines = embedder(loaded, max_context=8)
    e.submit(Embed(rid=1, inputs=[[1, 2, 10**6]], id_json='"bad"'), 0.0)
    e.submit(Embed(rid=2, inputs=["word " * 20], id_json='"long"'), 0.0)
    e.submit(Embed(rid=3, inputs=["word " * 20], truncate=True, dimensions=4, id_json='"cut"'), 0.0)
    e.submit(Embed(rid=4, inputs=["Hi"], id_json='"gone"'), 0.0)
    assert e.cancel(4) and not e.cancel(4)
    drain(e)
    by_id = {ev["id"]: ev for ev in events(lines) if ev["ev"] == "error" or ev.get("done")}
    assert by_id["bad"]["code"] == "bad_request" and "outside the vocabulary" in by_id["bad"]["msg"]
    assert by_id["long"]["code"] == "bad_request" and "context is 8 tokens" in by_id["long"]["msg"]
    assert by_id["cut"]["prompt_tokens"] == 8 and by_id["gone"]["finish_reason"] == "cancelled"
    [cut] = vectors(lines, "cut").values()
    assert cut.shape == (4,) and abs(np.linalg.norm(cut) - 1) < 1e-5
