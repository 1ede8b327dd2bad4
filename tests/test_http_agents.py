"""What agents and apps need from the HTTP surface, end to end with the
real clients against a real `lattice-pool serve --http`: any local model by
name, thinking that never hides the answer, tool calls."""

from __future__ import annotations

import json

import openai
import pytest

from harness.pool import PoolProc
from tests.conftest import keep_alive_across_tests, release
from tests.test_http import http_port, post, split_thinking

HI = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def agents(tiny_model, second_model, tmp_path_factory):
    """One pool: `tiny` configured, `tiny2` (another demo model) only a
    directory in the model cache, an empty Hugging Face cache."""
    root = tmp_path_factory.mktemp("agents")
    cache = root / "models"
    cache.mkdir()
    (cache / "tiny2").symlink_to(second_model)
    (root / "hub").mkdir()
    config = root / "pool.toml"
    config.write_text(f'[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\n')
    pool = PoolProc("--config", str(config), "--http", "0", env={"LATTICE_MODEL_CACHE": str(cache), "HF_HUB_CACHE": str(root / "hub")})
    keep_alive_across_tests(pool.proc.pid)
    pool.wait_ev("ready", model="tiny")
    pool.port = http_port(pool)
    pool.url = f"http://127.0.0.1:{pool.port}/v1"
    yield pool
    release(pool.proc.pid)
    assert pool.close() == 0


def client(pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url, api_key="unused", max_retries=0, timeout=120)


def get(pool, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(pool.url + path, timeout=60) as response:
        return json.loads(response.read())


# -- any local model ---------------------------------------------------------------


def test_a_local_unconfigured_model_is_served_over_http(agents, tiny_model):
    listed = {m["id"]: m for m in get(agents, "/models")["data"]}
    assert listed["tiny"]["source"] == "configured" and listed["tiny"]["loaded"]
    assert listed["tiny2"]["source"] == "cache" and listed["tiny2"]["state"] == "unloaded"
    with client(agents) as c:
        reply = c.chat.completions.create(model="tiny2", messages=HI, max_tokens=6, temperature=0)
        assert reply.model == "tiny2" and reply.usage.completion_tokens == 6
        assert c.models.retrieve("tiny2").state in ("ready", "busy")
        # The same text stdin gives for the same model.
        request_id = "stdin-tiny2"
        agents.send({"model": "tiny2", "messages": HI, "max_tokens": 6, "temperature": 0, "id": request_id})
        assert agents.terminal(request_id)["ev"] == "gen_token"
        text = agents.text(request_id)
        message = reply.choices[0].message
        reasoning, answer = split_thinking(text)
        assert (message.reasoning_content or "") + (message.content or "") == reasoning + answer
    listed = {m["id"]: m for m in get(agents, "/models")["data"]}
    assert listed["tiny2"]["loaded"]


def test_paths_and_unknown_names_are_404(agents, tiny_model):
    for name in (str(tiny_model), "../models/tiny2", "no-such-model", "org/not-in-the-cache"):
        status, body = post(agents, "/chat/completions", json.dumps({"model": name, "messages": HI}).encode())
        assert status == 404 and body["error"]["code"] == "unknown_model" and body["error"]["param"] == "model", (name, body)


def test_http_models_configured_restricts_to_configured_names(tiny_model, tmp_path, spawn_pool):
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "tiny2").symlink_to(tiny_model)
    config = tmp_path / "pool.toml"
    config.write_text(f'http_models = "configured"\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    pool = spawn_pool("--config", str(config), "--http", "0", env={"LATTICE_MODEL_CACHE": str(cache)})
    pool.port = http_port(pool)
    pool.url = f"http://127.0.0.1:{pool.port}/v1"
    assert [m["id"] for m in get(pool, "/models")["data"]] == ["tiny"]
    status, body = post(pool, "/chat/completions", json.dumps({"model": "tiny2", "messages": HI}).encode())
    assert status == 404 and "not configured" in body["error"]["message"]
    assert pool.close() == 0


# -- thinking never hides the answer -----------------------------------------------


def test_a_reply_that_never_closes_think_is_content(agents):
    """The demo's template opens <think>; cut off before </think>, the
    reply is the answer (README's snippet prints text), not reasoning."""
    with client(agents) as c:
        for seed in range(4):
            reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, seed=seed)
            message = reply.choices[0].message
            assert message.content and getattr(message, "reasoning_content", None) is None, message
        # Closed by the budget: the split as before.
        split = c.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, extra_body={"reasoning_budget": 3})
        assert split.choices[0].message.reasoning_content is not None


def test_response_format_json_lands_in_content(agents):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
    with client(agents) as c:
        for seed in range(3):
            reply = c.chat.completions.create(
                model="tiny", messages=HI, max_tokens=80, seed=seed, temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )
            assert set(json.loads(reply.choices[0].message.content)) == {"n", "ok"}
        # Thinking first when asked for.
        thought = c.chat.completions.create(
            model="tiny", messages=HI, max_tokens=60, temperature=0, extra_body={"reasoning_budget": 4}, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        assert thought.choices[0].message.reasoning_content and json.loads(thought.choices[0].message.content)
        # reasoning_effort is a reasoning_budget: "minimal" thinks not at all.
        minimal = c.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0, reasoning_effort="minimal")
        assert minimal.choices[0].message.reasoning_content == "" and minimal.choices[0].message.content
    status, body = post(agents, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "reasoning_effort": "lots"}).encode())
    assert status == 400 and body["error"]["param"] == "reasoning_effort"
