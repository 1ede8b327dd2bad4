"""`lattice-pool serve` end to end: real supervisor, real workers, two demo models."""

import json
import resource
import shutil
import signal

import pytest

from harness.pool import is_terminal
from harness.procs import pid_alive, said, wait_for

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def config_file(tmp_path, tiny_model, second_model):
    def write(extra: str = "", preload: bool = True) -> str:
        path = tmp_path / "pool.toml"
        path.write_text(
            f"""{extra}
[[models]]
name = "a"
path = "{tiny_model}"
preload = {str(preload).lower()}

[[models]]
name = "b"
path = "{second_model}"
preload = {str(preload).lower()}
"""
        )
        return str(path)

    return write


def status(pool):
    pool.send({"op": "status"})
    return {row["model"]: row for row in pool.wait_ev("status")["models"]}


def test_ids_multiplex_two_models_concurrently(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    pool.wait_ev("ready", model="b")
    pool.send({"model": "a", "id": "x", "prompt": CHAT, "max_tokens": 300, "seed": 1})
    pool.send({"model": "b", "id": 7, "prompt": CHAT, "max_tokens": 300, "seed": 1})
    x, seven = pool.terminal("x"), pool.terminal(7)
    assert x["gen_tokens"] == 300 and seven["gen_tokens"] == 300
    order = [e["id"] for e in pool.events if e["ev"] == "gen_token"]
    # Both streams ran at once: each one's lines appear inside the other's span.
    first_x, last_x = order.index("x"), len(order) - 1 - order[::-1].index("x")
    assert any(i == 7 for i in order[first_x:last_x])
    # The echoed id keeps its JSON type on every line.
    assert all(b'"id":7}' in e["_line"] for e in pool.of(7))
    assert pool.close() == 0


def test_idless_requests_never_interleave(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    pool.wait_ev("ready", model="b")
    requests = [dict(model=m, prompt=CHAT, max_tokens=60, seed=s, temperature=1.0) for m, s in (("a", 1), ("b", 2), ("a", 3))]
    for i, r in enumerate(requests):
        pool.send({**r, "id": f"ref{i}"})
    expected = [pool.text(pool.terminal(f"ref{i}")["id"]) for i in range(3)]
    start = len(pool.events)
    for r in requests:
        pool.send(r)
    for _ in requests:
        pool.wait_for(lambda e: is_terminal(e) and "id" not in e)
    assert pool.idless_texts(start) == expected
    assert pool.close() == 0


def test_cancel_queued_and_running(config_file, spawn_pool):
    """With max_batch 1 the second request waits in the pool's queue."""
    pool = spawn_pool("--config", config_file("max_batch = 1"))
    pool.send({"model": "a", "id": "long", "prompt": CHAT, "max_tokens": 30_000})
    pool.send({"model": "a", "id": "queued", "prompt": CHAT, "max_tokens": 5})
    pool.wait_for(lambda e: e.get("id") == "long" and e["ev"] == "gen_token")
    pool.send({"op": "cancel", "id": "queued"})
    queued = pool.terminal("queued")
    assert queued["finish_reason"] == "cancelled" and queued["gen_tokens"] == 0
    pool.send({"op": "cancel", "id": "long"})
    running = pool.terminal("long")
    assert running["finish_reason"] == "cancelled" and 0 < running["gen_tokens"] < 100000
    pool.send({"op": "cancel", "id": "nope"})
    err = pool.wait_ev("error")
    assert err["code"] == "bad_request" and "nope" in err["msg"] and "id" not in err
    assert pool.close() == 0


def test_unload_frees_the_process_and_load_brings_it_back(config_file, spawn_pool):
    """Every request in flight (max_batch 2: two) ends cancelled, the one
    waiting in the pool with `unloaded`."""
    pool = spawn_pool("--config", config_file("max_batch = 2"))
    pool.wait_ev("ready", model="a")
    pid = status(pool)["a"]["pid"]
    assert pid_alive(pid)
    for request_id in ("running", "also running"):
        pool.send({"model": "a", "id": request_id, "prompt": CHAT, "max_tokens": 30_000})
    pool.send({"model": "a", "id": "waiting", "prompt": CHAT, "max_tokens": 5})
    for request_id in ("running", "also running"):
        pool.wait_for(lambda e, i=request_id: e.get("id") == i and e["ev"] == "gen_token")
    pool.send({"op": "unload", "model": "a"})
    assert pool.terminal("running")["finish_reason"] == pool.terminal("also running")["finish_reason"] == "cancelled"
    waiting = pool.terminal("waiting")
    assert waiting["ev"] == "error" and waiting["code"] == "unloaded"
    pool.wait_ev("unloaded", model="a")
    wait_for(lambda: not pid_alive(pid), 10, message="unloaded worker to exit")
    assert "a" not in status(pool)
    pool.send({"op": "load", "model": "a"})
    pool.wait_ev("ready", model="a")
    new_pid = status(pool)["a"]["pid"]
    assert new_pid != pid and pid_alive(new_pid)
    pool.send({"op": "load", "model": "a"})  # already up: ready again
    pool.wait_ev("ready", model="a")
    assert pool.close() == 0


def test_lru_eviction_under_max_loaded(config_file, tiny_q4_model, spawn_pool):
    pool = spawn_pool("--config", config_file("max_loaded = 2", preload=False))
    for request_id, model in (("1", "a"), ("2", "b"), ("3", "a")):
        pool.send({"model": model, "id": request_id, "prompt": CHAT, "max_tokens": 3})
        pool.terminal(request_id)
    b_pid = status(pool)["b"]["pid"]
    # A third model needs a slot: b is the least recently used idle worker.
    pool.send({"model": str(tiny_q4_model), "id": "4", "prompt": CHAT, "max_tokens": 3})
    assert pool.terminal("4")["gen_tokens"] == 3
    evicted = pool.wait_ev("unloaded", model="b")
    assert "evicted" in evicted["reason"]
    rows = status(pool)
    assert set(rows) == {"a", str(tiny_q4_model)}
    wait_for(lambda: not pid_alive(b_pid), 10)
    assert pool.close() == 0


def test_keep_alive_unloads_idle_workers(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file('keep_alive = "1s"', preload=False))
    pool.send({"model": "a", "id": 1, "prompt": CHAT, "max_tokens": 3})
    pool.terminal(1)
    pid = status(pool)["a"]["pid"]
    unloaded = pool.wait_ev("unloaded", model="a", timeout=30)
    assert "keep_alive" in unloaded["reason"]
    wait_for(lambda: not pid_alive(pid), 10)
    assert pool.close() == 0


def test_memory_budget_refuses_what_cannot_fit(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file('memory_budget = "1MB"', preload=False))
    pool.send({"model": "a", "id": "big", "prompt": CHAT})
    err = pool.terminal("big")
    assert err["ev"] == "error" and err["code"] == "insufficient_memory"
    assert pool.close() == 0


def test_bad_requests_get_errors_and_the_pool_goes_on(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file(preload=False))
    pool.send(b'{"prompt": "x", "temperature": "hot", "id": "t1"}\n')
    pool.send(b"this is not json\n")
    pool.send(b'{"prompt": "\xff\xfe", "id": "u8"}\n')
    pool.send(b"\n   \n")
    pool.send({"model": "zzz", "id": "um", "prompt": CHAT})
    pool.send(b'{"id": "np", "model": "a"}\n')
    pool.send(b'{"op": "explode", "id": "op1"}\n')
    pool.send(b'{"prompt": "x", "top_p": 0, "id": "range"}\n')
    pool.send({"model": "a", "id": "ok", "prompt": CHAT, "max_tokens": 4})
    errors = {e.get("id"): e for e in (pool.wait_ev("error") for _ in range(7))}
    assert errors["t1"]["code"] == "bad_request" and "temperature" in errors["t1"]["msg"]
    assert errors[None]["code"] == "bad_request"
    assert errors["um"]["code"] == "unknown_model"
    # Not valid UTF-8, so no JSON; its id is still read, so its error reaches it.
    assert errors["u8"]["code"] == "bad_request" and "malformed request" in errors["u8"]["msg"]
    assert errors["np"]["msg"] == 'missing "prompt" field'
    assert "explode" in errors["op1"]["msg"] and "top_p" in errors["range"]["msg"]
    assert pool.terminal("ok")["gen_tokens"] == 4
    pool.sent_ids += ["t1", "u8", "np", "range", "op1"]  # sent as raw bytes
    pool.check_terminals()
    assert pool.close() == 0


def test_oversized_line_is_rejected_and_skipped(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file(preload=False))
    pool.send(b'{"prompt": "' + b"x" * (64 * 1024 * 1024 + 10) + b'", "id": "huge"}\n')
    err = pool.wait_ev("error")
    assert err["code"] == "bad_request" and "longer than" in err["msg"]
    pool.send({"model": "a", "id": "after", "prompt": CHAT, "max_tokens": 2})
    assert pool.terminal("after")["gen_tokens"] == 2
    assert pool.close() == 0


def test_duplicate_running_id_is_refused(config_file, spawn_pool):
    """The refusal names the id but does not carry it: a line with that id
    would read as the end of the request still running."""
    pool = spawn_pool("--config", config_file())
    pool.send({"model": "a", "id": "dup", "prompt": CHAT, "max_tokens": 30_000})
    pool.wait_for(lambda e: e.get("id") == "dup")
    pool.proc.stdin.write(json.dumps({"model": "a", "id": "dup", "prompt": CHAT}).encode() + b"\n")
    pool.proc.stdin.flush()
    err = pool.wait_for(lambda e: e["ev"] == "error")
    assert err["code"] == "bad_request" and 'duplicate id "dup"' in err["msg"] and "id" not in err
    # Neither does the error of an op that happens to carry it.
    pool.send({"op": "explode", "id": "dup"})
    err = pool.wait_for(lambda e: e["ev"] == "error")
    assert err["code"] == "bad_request" and "explode" in err["msg"] and "id" not in err
    pool.send({"op": "cancel", "id": "dup"})
    assert pool.terminal("dup")["finish_reason"] == "cancelled"
    assert pool.close() == 0  # checks that "dup" had exactly one terminal line


def test_status_reports_measured_memory(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    pool.wait_ev("ready", model="b")
    pool.send({"model": "a", "id": 1, "prompt": CHAT, "max_tokens": 5})
    pool.terminal(1)
    pool.send({"op": "status"})
    event = pool.wait_ev("status")
    rows = {r["model"]: r for r in event["models"]}
    assert event["rss_bytes"] > 0 and event["system_total_bytes"] >= event["system_available_bytes"] > 0
    for row in rows.values():
        assert row["state"] == "ready" and pid_alive(row["pid"])
        assert row["rss_bytes"] >= row["uss_bytes"] > 0 and row["weights_bytes"] > 0
        assert row["mlx_active_bytes"] >= row["weights_bytes"] and row["format"] == "bf16"
    assert rows["a"]["served"] == 1 and rows["a"]["tokens"] == 5 and rows["b"]["served"] == 0
    assert pool.close() == 0


def test_config_errors_name_key_and_file(tmp_path, tiny_model, spawn_pool):
    cases = {
        "unknown.toml": ("max_loded = 2\n", "unknown key `max_loded`"),
        "nested.toml": (f'[[models]]\nname = "a"\npath = "{tiny_model}"\npreloud = true\n', "unknown key `preloud` in [models[0]]"),
        "type.toml": ('max_loaded = "two"\n', "max_loaded"),
        "dupe.toml": ('[[models]]\nname = "a"\npath = "/x"\n[[models]]\nname = "a"\npath = "/y"\n', "repeated: a"),
        "size.toml": ('memory_budget = "lots"\n', "not a size"),
        "toml.toml": ("max_loaded = = 2\n", "invalid TOML"),
    }
    for name, (body, needle) in cases.items():
        path = tmp_path / name
        path.write_text(body)
        pool = spawn_pool("--config", str(path))
        assert pool.close() == 2
        assert str(path).encode() in pool.stderr and needle.encode() in pool.stderr, (name, pool.stderr)


def test_sigterm_cancels_running_and_fails_queued(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file("shutdown_grace = 0\nmax_batch = 2"))
    for request_id in ("run", "run too"):
        pool.send({"model": "a", "id": request_id, "prompt": CHAT, "max_tokens": 30_000})
    pool.send({"model": "a", "id": "queue", "prompt": CHAT})
    for request_id in ("run", "run too"):
        pool.wait_for(lambda e, i=request_id: e.get("id") == i and e["ev"] == "gen_token")
    pids = [r["pid"] for r in status(pool).values()]
    pool.proc.send_signal(signal.SIGTERM)
    assert pool.close() == 0
    assert pool.terminal("run")["finish_reason"] == pool.terminal("run too")["finish_reason"] == "cancelled"
    assert pool.terminal("queue")["code"] == "shutting_down"
    assert not any(pid_alive(p) for p in pids)


def test_eof_lets_received_requests_finish(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file(preload=False))
    pool.send({"model": "a", "id": "r1", "prompt": CHAT, "max_tokens": 20})
    pool.send({"model": "b", "id": "r2", "prompt": CHAT, "max_tokens": 20})
    assert pool.close() == 0
    assert pool.terminal("r1")["gen_tokens"] == 20 and pool.terminal("r2")["gen_tokens"] == 20


def test_shutdown_op(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    pool.send({"op": "shutdown"})
    assert pool.proc.wait(timeout=30) == 0
    assert pool.close() == 0


def test_broken_stdout_ends_the_pool(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    pids = [r["pid"] for r in status(pool).values()]
    pool.send({"model": "a", "id": "x", "prompt": CHAT, "max_tokens": 30_000})
    pool.wait_for(lambda e: e.get("id") == "x")
    pool.proc.stdout.close()  # the client goes away mid-stream
    assert pool.proc.wait(timeout=30) == 0
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10)
    pool.proc.stdin.close()
    pool.proc.stderr.close()


def test_default_is_the_demo_model(tmp_path, spawn_pool):
    pool = spawn_pool(env={"XDG_CACHE_HOME": str(tmp_path)})
    pool.send({"prompt": CHAT, "max_tokens": 3})
    pool.wait_for(lambda e: e.get("done") is True)
    assert pool.close() == 0
    assert b"demo model" in pool.stderr
    assert (tmp_path / "lattice-pool" / "demo-model" / "config.json").is_file()


@pytest.mark.parametrize("budget, reused", [(None, True), ("0", False)])
def test_prefix_cache_budget_reaches_the_worker(tmp_path, tiny_model, spawn_pool, budget, reused):
    config = tmp_path / "pool.toml"
    line = f'prefix_cache_bytes = "{budget}"\n' if budget is not None else ""
    # Memory only: files of other tests' prompts must not answer the first request.
    line += "prefix_cache_disk_bytes = 0\n"
    config.write_text(f'{line}[[models]]\nname = "a"\npath = "{tiny_model}"\n')
    pool = spawn_pool("--config", str(config))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the mill."}]
    pool.send({"id": 1, "messages": history, "max_tokens": 8, "temperature": 0})
    first = pool.terminal(1)
    history += [{"role": "assistant", "content": pool.text(1)}, {"role": "user", "content": "And the river?"}]
    pool.send({"id": 2, "messages": history, "max_tokens": 8, "temperature": 0})
    second = pool.terminal(2)
    assert "cached_tokens" not in first
    assert ("cached_tokens" in second and second["cached_tokens"] > 0) == reused
    assert pool.close() == 0


def test_a_prompt_over_max_prompt_bytes_is_refused_before_any_worker_sees_it(config_file, spawn_pool):
    """Prompt size was checked only after tokenizing: a 60 MB prompt drove a
    worker past 9 GB, a 10 MB one took 10 s to be refused. Now its size is
    checked in the supervisor, in bytes, before it is routed."""
    pool = spawn_pool("--config", config_file())
    pool.wait_ev("ready", model="a")
    before = status(pool)["a"]
    pool.send({"model": "a", "id": "big", "prompt": "x" * (16 << 20)})
    err = pool.terminal("big")
    assert err["code"] == "bad_request" and "max_prompt_bytes (1048576 bytes)" in err["msg"]
    # Bytes, not characters: 2-byte characters, and every message counted.
    pool.send({"model": "a", "id": "wide", "messages": [{"role": "user", "content": "é" * (1 << 19)}]})
    assert "max_prompt_bytes" in pool.terminal("wide")["msg"]
    after = status(pool)["a"]
    assert after["served"] == 0 and after["rss_bytes"] < before["rss_bytes"] + (64 << 20)
    pool.send({"model": "a", "id": "ok", "prompt": CHAT, "max_tokens": 2})
    assert pool.terminal("ok")["gen_tokens"] == 2
    assert pool.close() == 0


def test_a_config_json_nested_too_deeply_fails_at_once_with_its_cause(tmp_path, tiny_model, spawn_pool):
    """Python's json raised RecursionError, the worker exited 1, and the
    pool restarted it five times over 22 s. It is a bad model dir: exit 78,
    one line of cause, no retry."""
    nested = tmp_path / "nested"
    shutil.copytree(tiny_model, nested)
    (nested / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "n"\npath = "{nested}"\npreload = true\n')
    pool = spawn_pool("--config", str(config))
    failed = pool.wait_ev("failed", model="n")
    assert "code 78" in failed["reason"] and "config.json: it nests too deeply" in failed["reason"]
    pool.send({"model": "n", "id": "r", "prompt": CHAT})
    assert pool.terminal("r")["code"] == "model_failed"
    assert pool.close() == 0
    assert not [e for e in pool.events if e["ev"] == "restarting"]
    assert pool.stderr.count(b"worker started") == 1


def test_a_hard_file_limit_below_what_mlx_lm_sets_fails_at_once_with_its_cause(tiny_model, spawn_pool):
    """mlx-lm raises RLIMIT_NOFILE to (2048, 4096) when imported, which fails
    below a hard limit of 4096: every worker died at import, and was
    restarted five times. A resource limit is no crash: exit 78, the cause."""

    def low_hard_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    pool = spawn_pool("--model-dir", str(tiny_model), preexec_fn=low_hard_limit)
    failed = pool.wait_ev("failed")
    assert "code 78" in failed["reason"] and "RLIMIT_NOFILE" in failed["reason"] and "1024" in failed["reason"]
    assert pool.close() == 0
    assert not [e for e in pool.events if e["ev"] == "restarting"]


def test_stdout_gone_during_the_grace_period_ends_the_pool_at_once(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file("shutdown_grace = 600"))
    pool.wait_ev("ready", model="a")
    pids = [r["pid"] for r in status(pool).values()]
    pool.send({"model": "a", "id": "x", "prompt": CHAT, "max_tokens": 30_000})
    pool.wait_for(lambda e: e.get("id") == "x")
    # Ctrl-C on `lattice-pool serve | grep x`: the pool starts its grace
    # period with "x" still running, then grep's end closes the pipe.
    pool.proc.send_signal(signal.SIGINT)
    said(pool.stderr, b"shutting down (signal); grace 600s", 30)
    pool.proc.stdout.close()
    assert pool.proc.wait(timeout=2) == 0  # a deadline: the grace period is 600 s
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10)
    pool.proc.stdin.close()
    pool.proc.stderr.close()


def test_unknown_request_fields_are_warned_once_per_name(config_file, spawn_pool):
    pool = spawn_pool("--config", config_file())
    # Every field docs/protocol.md names (null is absent), on a generation line and an op.
    known = {
        "model": "a",
        "lora": None,
        "prompt": CHAT,
        "max_tokens": 2,
        "temperature": 0.7,
        "top_k": 50,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
        "seed": 1,
        "reasoning_budget": None,
        "stop": None,
        "response_format": None,
    }
    pool.send({"id": "known", **known})
    pool.send({"op": "status", "id": "st", "model": None})
    pool.wait_ev("status")
    for n in range(3):
        pool.send({"id": f"typo{n}", "model": "a", "prompt": CHAT, "max_tokns": 3, "max_tokens": 2, "x_trace": n})
    for rid in ("known", "typo0", "typo1", "typo2"):
        assert pool.terminal(rid)["gen_tokens"] == 2
    assert pool.close() == 0
    warnings = [line for line in pool.stderr.decode().splitlines() if "WARNING" in line]
    assert len(warnings) == 2, warnings
    assert "'max_tokns' is unknown and ignored; did you mean 'max_tokens'?" in warnings[0]
    assert "'x_trace' is unknown and ignored" in warnings[1]
