"""A model's context limit: read from its config, overridable, enforced on
prompt plus max_tokens, shown by status, ps and /v1/models."""

import json
import urllib.request

from harness.http import http_port
from harness.worker import WorkerProc, terminal
from ipc.context import context_limit
from ipc.messages import Generate

# 30-odd tokens of the demo tokenizer.
PROMPT = "<|im_start|>user\n" + "Tell me about the river and the mill. " * 2 + "<|im_end|>\n<|im_start|>assistant\n"


def test_limit_from_config_with_rope_scaling():
    assert context_limit({"max_position_embeddings": 4096}) == 4096
    assert context_limit({"text_config": {"max_position_embeddings": 32768}}) == 32768
    # yarn stretches the length the model was trained on by its factor.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_limit({"max_position_embeddings": 32768, "rope_scaling": yarn}) == 131072
    assert context_limit({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "linear", "factor": 2}}) == 16384
    # llama3 states the extended length itself.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert context_limit({"max_position_embeddings": 131072, "rope_scaling": llama3}) == 131072
    assert context_limit({"model_type": "x"}) is None
    assert context_limit({"max_position_embeddings": "long", "text_config": None}) is None


def test_worker_refuses_or_clips_past_the_limit(tiny_model):
    w = WorkerProc(tiny_model, "--max-context", "64")
    try:
        assert w.wait_ready()["max_context"] == 64
        from tokenizers import Tokenizer

        n = len(Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids)
        assert 20 < n < 64
        # An explicit max_tokens past the room left: refused, naming both numbers.
        w.send(Generate(rid=1, prompt=PROMPT, max_tokens=40, temperature=0.0, id_json='"over"'))
        error = terminal(w.collect())
        assert error["ev"] == "error" and error["code"] == "bad_request" and error["id"] == "over"
        assert f"prompt ({n} tokens)" in error["msg"] and "max_tokens (40)" in error["msg"] and "64 tokens" in error["msg"]
        # One left to the default is lowered to the room left.
        w.send(Generate(rid=2, prompt=PROMPT, max_tokens=512, temperature=0.0, clip_max_tokens=True, stop=[], id_json='"clip"'))
        done = terminal(w.collect())
        assert done["ev"] == "gen_token" and done["prompt_tokens"] == n and 0 < done["gen_tokens"] <= 64 - n
        # Exactly the room left fits.
        w.send(Generate(rid=3, prompt=PROMPT, max_tokens=64 - n, temperature=0.0, id_json='"fits"'))
        assert terminal(w.collect())["ev"] == "gen_token"
        # A prompt the context cannot hold at all is refused whatever max_tokens says.
        w.send(Generate(rid=4, prompt=PROMPT * 2, max_tokens=1, clip_max_tokens=True, id_json='"long"'))
        error = terminal(w.collect())
        assert error["code"] == "bad_request" and "the model's context is 64 tokens" in error["msg"]
        # A count is answered whatever the length: it asks whether the prompt fits.
        w.send(Generate(rid=5, prompt=PROMPT * 2, max_tokens=1, count_only=True, id_json='"count"'))
        lines = w.collect()
        assert [line["ev"] for line in lines] == ["gen_token"]
        assert lines[0]["done"] and lines[0]["prompt_tokens"] > 64 and lines[0]["gen_tokens"] == 0 and lines[0]["id"] == "count"
    finally:
        assert w.close() == 0


def test_pool_shows_and_enforces_max_context(tiny_model, tmp_path, spawn_pool):
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "short"\npath = "{tiny_model}"\nmax_context = 64\n[[models]]\nname = "native"\npath = "{tiny_model}"\n')
    pool = spawn_pool("--config", str(config), "--http", "127.0.0.1:0")
    port = http_port(pool)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as response:
        listed = {m["id"]: m for m in json.loads(response.read())["data"]}
    # Known before any worker runs: from the entry, or the model's config.
    assert listed["short"]["max_context"] == 64 and listed["native"]["max_context"] == 32768
    assert not listed["short"]["loaded"]
    pool.send({"model": "short", "id": "over", "prompt": PROMPT, "max_tokens": 100})
    error = pool.terminal("over")
    assert error["ev"] == "error" and error["code"] == "bad_request" and "max_tokens (100)" in error["msg"]
    # Without max_tokens (no pool default either) the reply is clipped to fit.
    pool.send({"model": "short", "id": "clip", "prompt": PROMPT, "temperature": 0, "stop": []})
    done = pool.terminal("clip")
    assert done["ev"] == "gen_token" and done["prompt_tokens"] + done["gen_tokens"] <= 64
    # The count op: the prompt's tokens as a generation would run it, nothing
    # generated, past the context too; its lines carry the id it needs.
    pool.send({"op": "count", "model": "short", "id": "count", "prompt": PROMPT})
    counted = pool.terminal("count")
    assert counted["ev"] == "gen_token" and counted["prompt_tokens"] == done["prompt_tokens"] and counted["gen_tokens"] == 0
    pool.send({"op": "count", "model": "short", "id": "long", "prompt": PROMPT * 3})
    assert pool.terminal("long")["prompt_tokens"] > 64
    pool.send(pool.line({"op": "count", "model": "short", "prompt": PROMPT}))  # as bytes: a bad line, no request
    refused = pool.wait_ev("error")
    assert refused["code"] == "bad_request" and 'op "count" needs an "id"' in refused["msg"]
    pool.send({"op": "status"})
    rows = {r["model"]: r for r in pool.wait_ev("status")["models"]}
    assert rows["short"]["max_context"] == 64
    assert pool.close() == 0
