"""The worker as a real process: real MLX model, real pipes."""

import json
import re
import subprocess
import sys

import psutil
import pytest

from harness.procs import ROOT, child_env, pid_alive, said, wait_for
from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Cancel, Generate, Message, Stats
from tests.conftest import keep_alive_across_tests, release

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
THINK = CHAT + "<think>\n"


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = WorkerProc(tiny_model)
    keep_alive_across_tests(w.pid)
    w.ready = w.wait_ready()
    yield w
    release(w.pid)
    assert w.close() == 0


_rid = iter(range(1, 1_000_000))


def generate(w, **kw):
    kw.setdefault("prompt", CHAT)
    w.send(Generate(rid=next(_rid), **kw))
    return w.collect()


def test_ready_reports_format_load_time_and_weights(worker, tiny_model):
    ready = worker.ready
    assert ready["_line"].startswith(b'@@lattice {"ev":"ready",')
    assert ready["model"] == tiny_model.name
    assert ready["format"] == "bf16" and ready["lora"] is None
    assert isinstance(ready["load_ms"], int) and ready["load_ms"] > 0
    assert ready["weights_bytes"] > 1_000_000


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_final_line_fields(worker, tokenizer):
    events = generate(worker, max_tokens=8, id_json='"abc"', seed=1)
    done = terminal(events)
    assert done["ev"] == "gen_token" and done["done"] is True
    assert list(done)[:-1] == ["ev", "token", "done", "tok_s", "ttft_ms", "prompt_tokens", "gen_tokens", "total_ms", "finish_reason", "id"]
    assert done["id"] == "abc" and all(e["id"] == "abc" for e in events)
    assert done["gen_tokens"] == 8 and done["finish_reason"] == "length"
    assert done["prompt_tokens"] == len(tokenizer.encode(CHAT, add_special_tokens=False).ids)
    assert done["tok_s"] == round(8 / (done["total_ms"] / 1000), 1) if done["total_ms"] else done["tok_s"] == 0.0


def test_greedy_is_deterministic(worker):
    a = generate(worker, temperature=0.0, max_tokens=30)
    b = generate(worker, temperature=0.0, max_tokens=30)
    assert text_of(a) == text_of(b) and text_of(a)


def test_seed_reproduces_across_processes(worker, tiny_model):
    params = dict(temperature=1.0, top_k=0, top_p=1.0, max_tokens=40)
    here = text_of(generate(worker, seed=42, **params))
    other = WorkerProc(tiny_model)
    try:
        other.wait_ready()
        other.send(Generate(rid=1, prompt=CHAT, seed=42, **params))
        there = text_of(other.collect())
    finally:
        assert other.close() == 0
    assert here == there
    assert text_of(generate(worker, seed=43, **params)) != here


def test_reasoning_budget_forces_think_end(worker):
    free = generate(worker, prompt=THINK, temperature=0.0, max_tokens=20)
    assert "</think>" not in text_of(free)
    events = generate(worker, prompt=THINK, temperature=0.0, max_tokens=20, reasoning_budget=3)
    tokens = [e["token"] for e in events if not e["done"]]
    assert "</think>" in tokens
    at = tokens.index("</think>")
    assert "".join(tokens[:at]) == "".join(e["token"] for e in free[:at])
    assert terminal(events)["gen_tokens"] == 20


def test_stop_string_ends_generation_and_is_not_emitted(worker):
    full = text_of(generate(worker, temperature=0.0, max_tokens=40))
    stop = full[12:15]
    cut = full.index(stop)
    events = generate(worker, temperature=0.0, max_tokens=40, stop=[stop])
    assert text_of(events) == full[:cut]
    done = terminal(events)
    assert done["finish_reason"] == "stop" and done["gen_tokens"] < 40


def test_utf8_deltas_match_an_in_process_run(worker, tiny_model):
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    req = dict(prompt="日本語の文章も少し", temperature=1.0, top_k=0, top_p=1.0, seed=5, max_tokens=150)
    events = generate(worker, **req)
    pieces = [e["token"] for e in events if not e["done"]]
    assert all(pieces)
    assert any(ord(c) > 0x7FF for c in "".join(pieces)), "sample should contain 3-byte characters"
    loaded = load(tiny_model)
    codec = TextCodec(tiny_model, loaded.config)
    lines = []
    scheduler = Scheduler(loaded, codec, lines.append, batch_memory=1 << 30)
    scheduler.submit(Generate(rid=0, **req), 0.0)
    ids = scheduler.drain()[0]
    local = [json.loads(line[10:]) for line in b"".join(lines).splitlines()]
    assert [e["token"] for e in local if not e["done"]] == pieces
    # Streaming added no replacement character that a one-shot decode lacks:
    # every character split across tokens was held back until complete.
    assert "".join(pieces) == codec.decode(ids)
    assert sum(1 for i in ids if "\ufffd" in codec.decode([i])) >= 3


def test_cancel_ends_only_the_cancelled_requests(worker):
    # Both run at once (batched); the cancelled ones end, the other goes on.
    for rid in (900, 901, 902):
        worker.send(Generate(rid=rid, prompt=CHAT, max_tokens=30_000 if rid < 902 else 40, id_json=str(rid)))
    first = worker.next_event()
    assert first["ev"] == "gen_token" and first["id"] in (900, 901, 902)
    worker.send(Cancel(rid=901))
    worker.send(Cancel(rid=900))
    events = worker.collect_by_id([900, 901, 902])
    events[first["id"]].insert(0, first)
    for rid in (900, 901):
        done = terminal(events[rid])
        assert done["finish_reason"] == "cancelled" and done["gen_tokens"] < 100_000
    assert terminal(events[902])["finish_reason"] == "length" and terminal(events[902])["gen_tokens"] == 40


def test_malformed_frames_get_an_error_and_the_worker_goes_on(worker):
    worker.send_raw(b"\x00\x00\x00\x02\xc1\xc1")
    error = worker.next_event()
    assert error["ev"] == "error" and error["code"] == "bad_request" and "malformed frame" in error["msg"]
    worker.send_raw(b"\x00\x00\x00\x01\x80")  # an empty map: no message type
    assert worker.next_event()["code"] == "bad_request"
    assert terminal(generate(worker, max_tokens=3))["gen_tokens"] == 3


def test_missing_prompt_is_an_error_with_the_id(worker):
    worker.send(Generate(rid=5, id_json='"np"'))
    events = worker.collect()
    assert events == [events[0]] and events[0]["ev"] == "error"
    assert events[0]["code"] == "bad_request" and events[0]["id"] == "np" and "prompt" in events[0]["msg"]


def test_the_worker_refuses_a_prompt_over_its_limit_before_tokenizing(tiny_model):
    """The supervisor checks prompt bytes first; the worker checks again, on
    the text it would tokenize (a rendered chat template included)."""
    w = WorkerProc(tiny_model, "--max-prompt-bytes", "100")
    try:
        w.wait_ready()
        w.send(Generate(rid=1, prompt="x" * 101, id_json='"long"'))
        err = terminal(w.collect())
        assert err["ev"] == "error" and err["code"] == "bad_request" and err["id"] == "long"
        assert "max_prompt_bytes (100 bytes)" in err["msg"]
        # 60 bytes of content, more than 100 once rendered as ChatML.
        w.send(Generate(rid=2, messages=[Message("user", "é" * 30)], id_json='"rendered"'))
        assert "max_prompt_bytes" in terminal(w.collect())["msg"]
        w.send(Generate(rid=3, prompt="x" * 100, max_tokens=2))
        assert terminal(w.collect())["gen_tokens"] == 2
    finally:
        assert w.close() == 0


def test_the_worker_sets_the_gil_switch_interval_it_is_given(tiny_model):
    # The token-mask thread needs the GIL before and after each batch of
    # masks (worker/runtime/defaults.py, GIL_SWITCH_MS): the worker's own interval,
    # not Python's 5 ms.
    w = WorkerProc(tiny_model, "--gil-switch-ms", "0.25", "--mask-threads", "3")
    try:
        w.wait_ready()
    finally:
        assert w.close() == 0
    assert re.search(rb"ready: .* mask_threads=3 gil_switch_ms=0.25\n", w.stderr), w.stderr.decode(errors="replace")


@pytest.mark.parametrize("given", ["0", "-1", "nan", "1001"])
def test_a_gil_switch_interval_out_of_bounds_is_refused(given):
    from worker.__main__ import parse_args
    from worker.runtime.defaults import GIL_SWITCH_MS

    assert parse_args(["--model", "m"]).gil_switch_ms == GIL_SWITCH_MS
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--gil-switch-ms", given])


def test_stats_reply_has_measured_memory(worker):
    worker.send(Stats())
    stats = worker.next_event()
    assert stats["ev"] == "worker_stats"
    assert stats["rss_bytes"] > stats["weights_bytes"] > 0
    assert 0 < stats["uss_bytes"] <= stats["rss_bytes"]
    assert stats["mlx_active_bytes"] >= stats["weights_bytes"]
    # The memory of the device it computes on: on a CPU, the machine's; on a
    # GPU, the GPU's (mlx's figure, as the worker reads it).
    import mlx.core as mx

    from worker.runtime.batch_size import gpu_memory

    on_gpu = mx.default_device() == mx.gpu
    assert stats["device_memory_bytes"] == (gpu_memory(mx.device_info()) if on_gpu else psutil.virtual_memory().total)


def test_q4_model_generates(tiny_q4_model):
    w = WorkerProc(tiny_q4_model)
    try:
        assert w.wait_ready()["format"] == "q4"
        w.send(Generate(rid=1, prompt=CHAT, max_tokens=10, seed=0))
        events = w.collect()
        assert terminal(events)["gen_tokens"] == 10 and text_of(events)
    finally:
        assert w.close() == 0


def test_stdin_eof_exits_promptly(tiny_model):
    w = WorkerProc(tiny_model)
    w.wait_ready()
    w.proc.stdin.close()
    w.proc.wait(timeout=10)
    assert w.close() == 0


def test_eof_mid_generation_exits(tiny_model):
    w = WorkerProc(tiny_model)
    w.wait_ready()
    w.send(Generate(rid=1, prompt=CHAT, max_tokens=30_000))
    assert w.next_event()["ev"] == "gen_token"
    w.proc.stdin.close()
    w.proc.wait(timeout=10)
    assert w.close() == 0


@pytest.mark.parametrize("breakage", ["missing", "no_config", "bad_weights"])
def test_bad_model_dir_exits_78(tmp_path, tiny_model, breakage):
    bad = tmp_path / "bad"
    if breakage != "missing":
        bad.mkdir()
        (bad / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    if breakage == "bad_weights":
        (bad / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
        (bad / "model.safetensors").write_bytes(b"not safetensors")
    w = WorkerProc(bad)
    assert w.proc.wait(timeout=60) == 78
    w.close()
    assert said(w.stderr, b"bad model dir", 5)


def test_stray_output_goes_to_stderr():
    code = (
        "import os; from worker.shell.channel import EventChannel; c = EventChannel.take_stdout(); "
        "print('stray print'); os.system('echo from a C child'); c.write(b'@@lattice {\"ev\":\"x\"}\\n')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=child_env(), cwd=ROOT, timeout=30)
    assert out.stdout == b'@@lattice {"ev":"x"}\n'
    assert b"stray print" in out.stderr and b"from a C child" in out.stderr


def test_worker_dies_with_its_parent(tiny_model):
    """PR_SET_PDEATHSIG: a SIGKILLed parent takes the worker with it."""
    # The parent kills nothing until its worker is ready: the lifeline is
    # armed by then, and a kill during start-up would only time the load.
    code = (
        "import signal, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'worker', '--model', {str(tiny_model)!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "for line in p.stdout:\n"
        "    if b'\"ready\"' in line:\n"
        "        break\n"
        "print(p.pid, flush=True)\n"
        "signal.pause()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(), cwd=ROOT)
    pid = int(parent.stdout.readline())
    wait_for(lambda: pid_alive(pid), 10)
    parent.kill()
    parent.wait()
    parent.stdout.close()
    wait_for(lambda: not pid_alive(pid), 5, message="worker to die with its parent")
