"""Embeddings end to end: the real `openai` and `ollama` clients against a
real `lattice-pool serve --http` whose demo model is configured with
kind = "embedding", checked against the same model's forward in this
process (mlx-lm's model, last-token pooling, normalised)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from harness.http import post
from tests.conftest import shared_http_pool

TEXTS = ["The river runs past the mill.", "Hi", "A longer sentence about the old stone bridge and the river under it, in spring."]
# Every embedding here is a float32 forward of the same weights; batching
# and the worker's kernels move values by about 1e-6.
TOLERANCE = 1e-4
CONTEXT = 64  # tokens an input may take (the entries' max_context)


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """`emb` (kind = "embedding") and `chat` on the same demo model: one
    worker serves both names."""
    root = tmp_path_factory.mktemp("embeddings")
    config = root / "pool.toml"
    config.write_text(
        f'[[models]]\nname = "emb"\npath = "{tiny_model}"\nkind = "embedding"\nmax_context = {CONTEXT}\npreload = true\n'
        f'[[models]]\nname = "chat"\npath = "{tiny_model}"\nmax_context = {CONTEXT}\n'
    )
    yield from shared_http_pool(config, "emb")


@pytest.fixture(scope="module")
def reference(tiny_model):
    """embed(text or ids) -> (unit vector, token count): mlx-lm's model of
    the demo dir in this process, in float32 as the worker computes on CPU;
    the input's ids with <|endoftext|> appended, the final norm's output at
    that last token."""
    import mlx.core as mx
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    model, _ = load_model(tiny_model)
    model.set_dtype(mx.float32)
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    eod = tokenizer.token_to_id("<|endoftext|>")

    def embed(given: str | list[int]) -> tuple[np.ndarray, int]:
        ids = (tokenizer.encode(given).ids if isinstance(given, str) else list(given)) + [eod]
        hidden = model.model(mx.array([ids]))[0, -1].astype(mx.float32)
        vector = np.array(hidden)
        return vector / np.linalg.norm(vector), len(ids)

    return embed


def client(pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url, api_key="unused", max_retries=0, timeout=120)


def ollama_client(pool):
    import ollama

    return ollama.Client(host=pool.url.removesuffix("/v1"), timeout=120)


def unit(values, dimensions: int | None = None) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float64)[:dimensions]
    return vector / np.linalg.norm(vector)


def test_openai_vectors_are_the_models_last_token_state(pool, reference):
    want = [reference(t) for t in TEXTS]
    with client(pool) as c:
        # The openai client asks for base64 by default and decodes it.
        got = c.embeddings.create(model="emb", input=TEXTS)
        floats = c.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == "emb"
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(n for _, n in want)
    for d, f, (vector, _) in zip(got.data, floats.data, want):
        assert len(d.embedding) == len(vector)
        assert np.abs(np.array(d.embedding) - vector).max() < TOLERANCE
        assert f.embedding == d.embedding  # the same float32 values either way
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5


def test_a_batch_equals_its_inputs_one_by_one_and_token_ids_equal_text(pool, reference, tiny_model):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(TEXTS[0]).ids
    with client(pool) as c:
        batch = [d.embedding for d in c.embeddings.create(model="emb", input=TEXTS).data]
        alone = [c.embeddings.create(model="emb", input=t).data[0].embedding for t in TEXTS]
        by_ids = c.embeddings.create(model="emb", input=[ids, ids[:3]]).data
    for b, a in zip(batch, alone):
        assert np.abs(np.array(b) - np.array(a)).max() < TOLERANCE
    assert np.abs(np.array(by_ids[0].embedding) - np.array(batch[0])).max() < TOLERANCE
    assert np.abs(np.array(by_ids[1].embedding) - reference(ids[:3])[0]).max() < TOLERANCE


def test_dimensions_keep_the_first_values_normalised_again(pool, reference):
    vector, _ = reference(TEXTS[0])
    with client(pool) as c:
        cut = c.embeddings.create(model="emb", input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(cut) == 16 and np.abs(np.array(cut) - unit(vector, 16)).max() < TOLERANCE
    status, body = post(pool, "/embeddings", json.dumps({"model": "emb", "input": "Hi", "dimensions": 100_000}).encode())
    assert status == 400 and "dimensions" in body["error"]["message"]


def test_openai_errors(pool):
    cases = [
        ({"model": "chat", "input": "Hi"}, "chat model", None),
        ({"model": "emb", "input": ""}, "empty", "input"),
        ({"model": "emb", "input": []}, "empty", "input"),
        ({"model": "emb", "input": ["Hi"] * 2049}, "2048", "input"),
        ({"model": "emb", "input": "river " * CONTEXT}, "context", None),
        ({"model": "emb", "input": "Hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ]
    for body, words, param in cases:
        status, answer = post(pool, "/embeddings", json.dumps(body).encode())
        assert status == 400 and words in answer["error"]["message"] and answer["error"]["param"] == param, (body, answer)
    with client(pool) as c:
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model="emb", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert "embedding model" in exc.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.embeddings.create(model="no-such-model", input="Hi")
        # /v1/models says which kind each name is, so a client can choose.
        kinds = {m.id: m.model_extra["kind"] for m in c.models.list() if m.id in ("emb", "chat")}
        assert kinds == {"emb": "embedding", "chat": "chat"}


def test_ollama_embed(pool, reference):
    import ollama

    want = [reference(t)[0] for t in TEXTS[:2]]
    with ollama_client(pool) as c:
        got = c.embed(model="emb", input=TEXTS[:2])
        one = c.embed(model="emb", input=TEXTS[0], dimensions=8)
        legacy = c.embeddings(model="emb", prompt=TEXTS[1])
        # Ollama cuts an input over the context unless told not to.
        cut = c.embed(model="emb", input="river " * CONTEXT)
        with pytest.raises(ollama.ResponseError) as long:
            c.embed(model="emb", input="river " * CONTEXT, truncate=False)
        with pytest.raises(ollama.ResponseError) as chat:
            c.embed(model="chat", input="Hi")
        with pytest.raises(ollama.ResponseError) as empty:
            c.embed(model="emb", input=["Hi", ""])
        with pytest.raises(ollama.ResponseError) as many:
            c.embed(model="emb", input=["Hi"] * 2049)
        assert c.show("emb").capabilities == ["embedding"]
    assert got.model == "emb" and got.prompt_eval_count == sum(reference(t)[1] for t in TEXTS[:2])
    assert 0 < got.load_duration <= got.total_duration
    for vector, w in zip(got.embeddings, want):
        assert np.abs(np.array(vector) - w).max() < TOLERANCE
    assert np.abs(np.array(one.embeddings[0]) - unit(want[0], 8)).max() < TOLERANCE
    assert np.abs(np.array(legacy.embedding) - want[1]).max() < TOLERANCE
    assert cut.prompt_eval_count == CONTEXT and abs(np.linalg.norm(cut.embeddings[0]) - 1) < 1e-5
    assert long.value.status_code == 400 and "context" in long.value.error
    assert chat.value.status_code == 400 and "chat model" in chat.value.error
    assert empty.value.status_code == 400 and "input 1 is an empty string" in empty.value.error
    assert many.value.status_code == 400 and "2048" in many.value.error
    status, body = post(SimpleNamespace(url=pool.url.removesuffix("/v1")), "/api/embed", json.dumps({"model": "emb", "input": [1, 2]}).encode())
    assert status == 400 and body == {"error": "input must be a string or a list of strings"}


def test_stdin_embed_op(pool, reference):
    """The `embed` op on stdin: one embedding line per input (base64 of
    float32), then the done line."""
    pool.send({"op": "embed", "id": "stdin-embed", "model": "emb", "input": TEXTS[:2], "dimensions": 32})
    done = pool.terminal("stdin-embed")
    lines = [e for e in pool.events if e.get("id") == "stdin-embed" and e["ev"] == "embedding"]
    assert done["ev"] == "gen_token" and done["gen_tokens"] == 0 and done["prompt_tokens"] == sum(reference(t)[1] for t in TEXTS[:2])
    assert sorted(e["index"] for e in lines) == [0, 1]
    for e in lines:
        vector = np.frombuffer(base64.b64decode(e["embedding"]), "<f4")
        assert np.abs(vector - unit(reference(TEXTS[e["index"]])[0], 32)).max() < TOLERANCE


def test_embeddings_and_generation_share_a_worker(pool, reference):
    """`chat` and `emb` are one worker: an embeddings request runs between
    a generation's steps, and neither changes the other's answer."""
    greedy = {"model": "chat", "messages": [{"role": "user", "content": "Tell me about the river."}], "max_tokens": 24, "temperature": 0}
    pool.send({**greedy, "id": "alone"})
    assert pool.terminal("alone")["ev"] == "gen_token"
    pool.send({**greedy, "id": "beside"})
    pool.send({"op": "embed", "id": "between", "model": "emb", "input": TEXTS})
    assert pool.terminal("beside")["gen_tokens"] == pool.terminal("alone")["gen_tokens"]
    assert pool.text("beside") == pool.text("alone")
    assert pool.terminal("between")["ev"] == "gen_token"
    for e in [e for e in pool.events if e.get("id") == "between" and e["ev"] == "embedding"]:
        vector = np.frombuffer(base64.b64decode(e["embedding"]), "<f4")
        assert np.abs(vector - reference(TEXTS[e["index"]])[0]).max() < TOLERANCE
