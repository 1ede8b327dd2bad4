"""The OpenAI-compatible HTTP surface end to end: a real `lattice-pool
serve --http` with a real worker, driven by the official `openai` client
(and raw sockets where a client misbehaves on purpose). Loopback only;
every server listens on port 0."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import psutil
import pytest

from harness.http import NEVER, drip, post, split_thinking, with_http
from harness.metrics import metrics_port, scrape
from harness.procs import ROOT, child_env, said, wait_for
from tests.conftest import shared_http_pool

HI = [{"role": "user", "content": "Tell me about the river."}]
PROMPT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """One pool for the module: the tiny model, HTTP on port 0 of the
    default host, metrics, and small HTTP bounds the tests reach."""
    config = tmp_path_factory.mktemp("http") / "pool.toml"
    config.write_text(f'http_stream_buffer = "64KiB"\nmax_http_body_bytes = "256KiB"\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\n')
    yield from shared_http_pool(config, "tiny", "--metrics-port", "0")


def client(pool, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=120, **kwargs)


def stdin_answer(pool, request: dict) -> tuple[str, dict]:
    """The text and final line of the same request sent on stdin."""
    request_id = f"stdin-{time.monotonic_ns()}"
    pool.send({**request, "id": request_id})
    done = pool.terminal(request_id)
    assert done["ev"] == "gen_token", done
    return pool.text(request_id), done


def status(pool) -> dict:
    pool.send({"op": "status"})
    return pool.wait_ev("status")


def test_completions_equal_stdin_streamed_or_not(served):
    with client(served) as c:
        whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **GREEDY)
        chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY))
    text, done = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 12, **GREEDY})
    assert whole.choices[0].text == text and text
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (done["prompt_tokens"], 12, done["prompt_tokens"] + 12)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == "tiny"
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_equals_stdin_with_reasoning_split(served):
    """The demo's chat template opens <think>: the reply is reasoning until
    </think> (forced by the reasoning budget), then the answer."""
    request = {"max_tokens": 16, "reasoning_budget": 4, **GREEDY}
    text, done = stdin_answer(served, {"messages": HI, **request})
    reasoning, answer = split_thinking(text)
    assert "</think>" in text and answer, text
    extra = {"reasoning_budget": 4}
    with client(served) as c:
        whole = c.chat.completions.create(model="tiny", messages=HI, max_tokens=16, temperature=0, extra_body=extra)
        chunks = list(c.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=16, temperature=0, extra_body=extra, stream=True))
    message = whole.choices[0].message
    assert (message.role, message.content, message.reasoning_content) == ("assistant", answer, reasoning)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == done["gen_tokens"] == 16
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" for d in deltas[1:-1]]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "reasoning deltas come first"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == answer
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_stop_string_and_seeded_sampling(served):
    text, _ = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 12, **GREEDY})
    stop = text[4:7]
    with client(served) as c:
        cut = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY)
        sampled = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, extra_body={"top_k": 20}) for _ in range(2)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    seeded, _ = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "top_k": 20})
    assert sampled[0].choices[0].text == sampled[1].choices[0].text == seeded


def test_32_concurrent_streams_and_stdin_at_once(served):
    port = metrics_port(served)
    before = scrape(port)
    first = status(served)["requests"]
    text, _ = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 6, **GREEDY})

    async def one(c: openai.AsyncOpenAI) -> tuple[str, str]:
        stream = await c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, stream=True, **GREEDY)
        pieces, reason = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(pieces), reason

    async def many() -> list:
        async with openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c) for _ in range(32)))

    ids = [f"side-{i}" for i in range(4)]
    for request_id in ids:  # stdin requests while the streams run
        served.send({"id": request_id, "prompt": PROMPT, "max_tokens": 6, **GREEDY})
    results = asyncio.run(many())
    assert results == [(text, "length")] * 32
    assert [served.terminal(i)["ev"] for i in ids] == ["gen_token"] * 4
    assert [served.text(i) for i in ids] == [text] * 4
    # No HTTP request's line reached stdout.
    assert not [e for e in served.events if str(e.get("id", "")).startswith(("cmpl-", "chatcmpl-"))]
    counts = status(served)["requests"]
    assert counts["http"]["received"] - first["http"]["received"] == 32 and counts["http"]["active"] == 0
    assert counts["stdin"]["received"] - first["stdin"]["received"] == 5
    after = scrape(port)
    key = ("lattice_requests_total", (("adapter", ""), ("model", "tiny"), ("surface", "http")))
    assert after[key] - before.get(key, 0) == 32
    stdin_key = ("lattice_requests_total", (("adapter", ""), ("model", "tiny"), ("surface", "stdin")))
    assert after[stdin_key] - before.get(stdin_key, 0) == 5


def wait_row_gone(pool, timeout: float = 60.0) -> dict:
    """Waits until the model has nothing queued or in flight and HTTP has no request."""

    def gone():
        s = status(pool)
        row = s["models"][0]
        return s if row["in_flight"] == 0 and row["queued"] == 0 and s["requests"]["http"]["active"] == 0 else None

    return wait_for(gone, timeout, interval=0.2, message="the request's row to leave")


def test_disconnect_mid_stream_cancels(served):
    with client(served) as c:
        stream = c.chat.completions.create(model="tiny", messages=HI, max_tokens=30_000, stream=True, **GREEDY)
        for _, chunk in zip(range(3), stream):
            assert chunk.choices[0].finish_reason is None
        busy = status(served)
        assert busy["models"][0]["in_flight"] == 1 and busy["requests"]["http"]["active"] == 1
        stream.close()
    wait_row_gone(served)
    # The pool goes on serving HTTP.
    with client(served) as c:
        assert c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"


def test_a_reader_too_slow_is_cut_off(served):
    """A client that never reads: past http_stream_buffer its request is
    cancelled and its connection dropped; the pool goes on."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", served.port))
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 30_000, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    sock.settimeout(60)
    assert sock.recv(12) == b"HTTP/1.1 200"
    said(served.stderr, b"http_stream_buffer", 120)
    wait_row_gone(served)
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert b"data: [DONE]" not in received


def test_errors_in_openai_shape(served):
    status_code, body = post(served, "/chat/completions", b'{"model": "tiny", "messages": [')
    assert status_code == 400 and body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status_code, body = post(served, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "temperature": "hot"}).encode())
    assert status_code == 400 and "temperature" in body["error"]["message"]
    status_code, body = post(served, "/completions", json.dumps({"model": "tiny", "prompt": "x" * 300_000}).encode())
    assert status_code == 413 and "max_http_body_bytes" in body["error"]["message"]
    status_code, body = post(served, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "response_format": {"type": "yaml"}}).encode())
    assert status_code == 400 and "response_format" in body["error"]["message"] and body["error"]["param"] == "response_format"
    # As OpenAI does, `param` names the offending field.
    for field, value in (("temperature", "hot"), ("max_tokens", 0), ("top_p", 7), ("stop", [""])):
        status_code, body = post(served, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, field: value}).encode())
        assert status_code == 400 and body["error"]["param"] == field, body
    with client(served) as c:
        with pytest.raises(openai.NotFoundError) as exc:
            c.chat.completions.create(model="no-such-model", messages=HI)
        assert exc.value.body["code"] == "unknown_model" and exc.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="tiny", messages=HI, max_tokens=0)
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="tiny", messages=HI, n=9)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="other", messages=HI, stream=True)
    with urllib.request.urlopen(served.url.removesuffix("/v1") + "/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    with client(served) as c:
        models = c.models.list().data
    # Configured first; then whatever this machine's model and hub caches hold.
    assert [(m.id, m.loaded, m.state) for m in models if m.source == "configured"] == [("tiny", True, "ready")]


def test_listens_on_loopback_by_default(served):
    listening = [c for c in psutil.Process(served.proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == served.port]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)


def test_response_format_gives_json(served):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"], "additionalProperties": False}
    with client(served) as c:
        reply = c.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
            extra_body={"reasoning_budget": 2},
            **GREEDY,
        )
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"name"}


def test_response_format_text_is_plain_text(served):
    """{"type": "text"} is OpenAI's default, which some clients send: it was
    a 400. (The legacy `functions` field is read as `tools`: test_http_agents.)"""
    plain, _ = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 6, **GREEDY})
    text, _ = stdin_answer(served, {"prompt": PROMPT, "max_tokens": 6, "response_format": {"type": "text"}, **GREEDY})
    with client(served) as c:
        reply = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, extra_body={"response_format": {"type": "text"}}, **GREEDY)
        chat = c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, response_format={"type": "text"}, **GREEDY)
    assert reply.choices[0].text == text == plain and plain
    assert chat.choices[0].finish_reason == "length"


# -- a pool with an API key and tight connection bounds (no worker needed) --------


def bare_pool(spawn_pool, tiny_model, tmp_path, settings: str):
    """A pool whose model is not preloaded: no worker, HTTP on port 0."""
    config = tmp_path / "pool.toml"
    config.write_text(settings + f'\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    return with_http(spawn_pool("--config", str(config), "--http", "127.0.0.1:0"))


def established(pool, ports: set[int]) -> int:
    return len([c for c in psutil.Process(pool.proc.pid).net_connections("inet") if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in ports])


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    answer = b""
    while chunk := sock.recv(1 << 16):
        answer += chunk
    return answer


def test_api_key_and_connection_limit(tiny_model, tmp_path, spawn_pool):
    pool = bare_pool(spawn_pool, tiny_model, tmp_path, 'api_key = "s3cret"\nmax_http_connections = 3')
    with client(pool, api_key="wrong") as c:
        with pytest.raises(openai.AuthenticationError) as exc:
            c.models.list()
        assert exc.value.body["code"] == "invalid_api_key"
    status_code, body = post(pool, "/chat/completions", json.dumps({"messages": HI}).encode())
    assert status_code == 401 and body["error"]["code"] == "missing_api_key"
    # The embeddings routes too, OpenAI's and Ollama's.
    assert post(pool, "/embeddings", json.dumps({"input": "Hi"}).encode())[0] == 401
    assert post(SimpleNamespace(url=pool.url.removesuffix("/v1")), "/api/embed", json.dumps({"input": "Hi"}).encode())[0] == 401
    with client(pool, api_key="s3cret") as c:
        assert [(m.id, m.loaded) for m in c.models.list().data] == [("tiny", False)]
    # With a key, the pool may sit behind any name (a browser cannot send the key on a page's behalf).
    assert get(pool, "/v1/models", {"host": "pool.example", "origin": "https://app.example", "authorization": "Bearer s3cret"})[0] == 200

    # Three open connections fill max_http_connections: a fourth is answered 429 and closed.
    wait_for(
        lambda: not [c for c in psutil.Process(pool.proc.pid).net_connections("inet") if c.status == psutil.CONN_ESTABLISHED],
        30,
        message="earlier connections to close",
    )
    held = [socket.create_connection(("127.0.0.1", pool.port)) for _ in range(3)]
    wait_for(lambda: established(pool, {s.getsockname()[1] for s in held}) == 3, 30, message="three connections")
    with socket.create_connection(("127.0.0.1", pool.port)) as extra:
        extra.settimeout(30)
        answer = read_to_end(extra)
    assert answer.startswith(b"HTTP/1.1 429") and b"max_http_connections" in answer
    for sock in held:
        sock.close()
    wait_for(lambda: established(pool, set(range(65536))) == 0, 30, message="the connections to close")
    with client(pool, api_key="s3cret") as c:
        assert c.models.list().data[0].id == "tiny"
    assert pool.close() == 0


HEAD = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n"
# Longer than any deadline below lets through at one byte per drip.
PAD = b"x-pad: " + b"a" * 400 + b"\r\n"


def trickle(port: int, first: bytes, data: bytes, replied: bytes, answers: list) -> None:
    """A slow client: sends `first` at once, waits for `replied` (b"": none;
    a keep-alive connection's first answer), then drips `data`. Appends
    what drip returns, with the answer to `first` in front."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(first)
        sock.settimeout(NEVER)
        while replied not in answer:
            answer += sock.recv(65536)
        more, closed_after = drip(sock, data)
    answers.append((answer + more, closed_after))


def test_idle_and_trickling_clients_are_cut_off_while_others_are_served(tiny_model, tmp_path, spawn_pool):
    """uvicorn timed out only a keep-alive connection that sent nothing,
    and the body's time limit was per chunk: a request trickled a byte at a
    time held its connection for ever (128 such filled the pool's
    connections). Now each request, the first or a later one on its
    connection, must arrive whole, head and body, within
    http_request_timeout."""
    pool = bare_pool(spawn_pool, tiny_model, tmp_path, 'http_idle_timeout = "1s"\nhttp_request_timeout = "2s"')
    post_head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    slow = {
        "head": (b"", HEAD + PAD, b""),
        "body": (post_head, b"{" + b" " * 999, b""),
        "second request": (HEAD + b"\r\n", HEAD + PAD, b'{"status":"ok"}'),
    }
    answers = {name: [] for name in slow}
    threads = [threading.Thread(target=trickle, args=(pool.port, *args, answers[name])) for name, args in slow.items()]
    for thread in threads:
        thread.start()
    with socket.create_connection(("127.0.0.1", pool.port)) as idle:
        # Meanwhile the pool serves others, and a keep-alive connection that
        # sends nothing after its answer is closed.
        for _ in range(3):
            with urllib.request.urlopen(pool.url.removesuffix("/v1") + "/health", timeout=30) as response:
                assert response.status == 200
        idle.sendall(HEAD + b"\r\n")
        idle.settimeout(NEVER)
        assert read_to_end(idle).startswith(b"HTTP/1.1 200")
    for thread in threads:
        thread.join(NEVER + 30)
    for name, ((answer, closed_after),) in answers.items():
        assert closed_after is not None, f"the {name} trickle was never cut off"
        assert closed_after < 15, f"the {name} trickle was cut off after {closed_after:.1f}s; the deadline is 2s"
        late = answer[answer.rfind(b"HTTP/1.1 ") :]
        assert late.startswith(b"HTTP/1.1 408") and b"http_request_timeout" in late, (name, answer)
    assert answers["second request"][0][0].startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", pool.port)) as sock:  # not HTTP at all: answered in OpenAI's shape too
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        sock.settimeout(30)
        answer = read_to_end(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "bad_request"
    assert pool.close() == 0


def get(pool, path: str, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(pool.url.removesuffix("/v1") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_pool_without_a_key_refuses_what_a_web_page_could_send(tiny_model, tmp_path, spawn_pool):
    """Any web page could make a browser POST text/plain to the pool, and
    through DNS rebinding (a name of the attacker's that resolves to
    127.0.0.1) read the answers. Without an API key a foreign Host, a
    foreign Origin and a body not typed application/json are refused."""
    pool = bare_pool(spawn_pool, tiny_model, tmp_path, 'http_allowed_origins = ["http://localhost:3000"]')
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1}).encode()
    refusals = [
        post(pool, "/chat/completions", body, {"origin": "https://evil.example"}),
        post(pool, "/chat/completions", body, {"host": f"evil.example:{pool.port}"}),
        get(pool, "/v1/models", {"host": "rebound.evil.example"}),
        get(pool, "/health", {"origin": "null"}),
        post(pool, "/chat/completions", body, {"content-type": "text/plain"}),
        post(pool, "/completions", body, {"content-type": "application/x-www-form-urlencoded"}),
    ]
    codes = [answer["error"]["code"] for _, answer in refusals]
    assert [status for status, _ in refusals] == [403] * 6
    assert codes == ["forbidden_origin", "forbidden_host", "forbidden_host", "forbidden_origin", "forbidden_content_type", "forbidden_content_type"]
    assert all(answer["error"]["type"] == "permission_error" and answer["error"]["message"] for _, answer in refusals)
    assert "http_allowed_origins" in refusals[0][1]["error"]["message"]
    # A body with no content-type at all (a page's fetch of a Blob sends none).
    with socket.create_connection(("127.0.0.1", pool.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        sock.settimeout(30)
        assert read_to_end(sock).startswith(b"HTTP/1.1 403")
    # Names of this machine, an allowed origin, and a JSON body with a charset pass.
    for host in (f"localhost:{pool.port}", f"127.0.0.1:{pool.port}", "LOCALHOST.", "[::1]:1", "127.0.0.2"):
        assert get(pool, "/health", {"host": host})[0] == 200, host
    assert get(pool, "/v1/models", {"origin": "http://localhost:3000"})[0] == 200
    status_code, answer = post(pool, "/chat/completions", b"[", {"content-type": "Application/JSON; charset=utf-8"})
    assert status_code == 400 and "not valid JSON" in answer["error"]["message"]
    assert pool.close() == 0


def test_a_blank_api_key_is_refused(tiny_model):
    """A key of spaces let a pool listen beyond loopback guarded by nothing."""
    env = {k: v for k, v in child_env().items() if k != "LATTICE_API_KEY"}
    runs = [
        (["--api-key", "   "], env),
        ([], {**env, "LATTICE_API_KEY": " \t "}),
    ]
    for flags, run_env in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "supervisor", "serve", "--model-dir", str(tiny_model), "--http", "0.0.0.0:0", "--no-control-socket", *flags],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=run_env,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert b"blank" in proc.stderr.strip().splitlines()[-1] and b"Traceback" not in proc.stderr


def test_refuses_a_host_beyond_loopback_without_a_key(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--model-dir", str(tiny_model), "--http", "0.0.0.0:0", "--no-control-socket"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env={k: v for k, v in child_env().items() if k != "LATTICE_API_KEY"},
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.decode().strip().splitlines()
    assert lines[-1].startswith("lattice-pool: error: http 0.0.0.0:0: 0.0.0.0 is not a loopback address") and "API key" in lines[-1]


@pytest.mark.parametrize(
    "inside, pieces, reasoning, answer",
    [
        (True, ["Let me see", "</think>", "\n\n", "Hi."], "Let me see", "Hi."),
        (True, ["a</th", "ink>\n", "\nb"], "a", "b"),
        (False, ["\n", "<thi", "nk>", "plan</think>\n", "done"], "plan", "done"),
        (False, ["Hello ", "<think>", " is just text"], None, "Hello <think> is just text"),
        (True, ["never closed <"], "never closed <", ""),
    ],
)
def test_think_splitter(inside, pieces, reasoning, answer):
    from supervisor.httpapi.reasoning import ThinkSplitter

    splitter = ThinkSplitter(inside)
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    assert "".join(t for r, t in out if r) == (reasoning or "") and splitter.thought == (reasoning is not None)
    assert "".join(t for r, t in out if not r) == answer


def test_a_fault_rendering_one_answer_ends_that_request_alone():
    """The slot writes a worker's lines into each request's exchange: an
    exception there must not reach the slot (it would kill the worker and
    every other row with it). The exchange ends its own request with a 500
    and asks for its row to be cancelled."""
    from ipc.events import encode_token
    from supervisor.httpapi.exchange import Exchange
    from supervisor.httpapi.shapes import Reply

    def broken() -> bool:
        raise RuntimeError("a bug in the reasoning split")

    faults = []
    exchange = Exchange(Reply(True, "chatcmpl-x", 0, "tiny", False), True, 1 << 16, broken, lambda: None, lambda: faults.append(1))
    exchange.write(encode_token("Hel", '"chatcmpl-x"'))
    assert exchange.ended and exchange.error.status == 500 and faults == [1]
    exchange.write(encode_token("lo", '"chatcmpl-x"'))  # later lines are dropped, nothing raises
    assert faults == [1]
