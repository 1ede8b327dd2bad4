"""Monitoring end to end: measured status and stats figures, load progress,
the Prometheus page, the control socket and `lattice-pool ps`."""

import hashlib
import io
import json
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cli import cli, ps_table
from harness.metrics import metrics_port, scrape, series
from harness.procs import ROOT, child_env, pid_alive, said, wait_for
from supervisor.screen import Screen
from supervisor.terminal import LoadProgress
from tests.lora_files import lora_pairs, targets_of, write_mlx

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


_FLOATS = {"BF16": 2, "F16": 2, "F32": 4}


def tensor_bytes(model_dir: Path) -> int:
    """Bytes the worker holds for a model dir's tensors, from the safetensors
    header: as stored, except that a CPU worker computes in float32."""
    import mlx.core as mx

    with open(model_dir / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    on_cpu = mx.default_device() == mx.cpu
    total = 0
    for t in header.values():
        stored = t["data_offsets"][1] - t["data_offsets"][0]
        total += stored // _FLOATS[t["dtype"]] * 4 if on_cpu and t["dtype"] in _FLOATS else stored
    return total


def write_config(tmp_path: Path, models: dict, extra: str = "", lazy: tuple = ()) -> str:
    text = extra + "\n"
    for name, (path, lora) in models.items():
        text += f'[[models]]\nname = "{name}"\npath = "{path}"\npreload = {str(name not in lazy).lower()}\n'
        if lora:
            text += f'lora = "{lora}"\n'
    path = tmp_path / "pool.toml"
    path.write_text(text)
    return str(path)


def status(pool) -> dict:
    pool.send({"op": "status"})
    return {row["model"]: row for row in pool.wait_ev("status")["models"]}


def near(measured: int, reference: int) -> bool:
    # Two readings of one live process a moment apart, not two processes.
    return abs(measured - reference) <= 0.2 * reference


def test_status_and_stats_figures_are_measured(tiny_model, small_model, tmp_path, spawn_pool):
    dirs = {"tiny": tiny_model, "small": small_model}
    # A cache dir of its own: prefix files that earlier tests left for the
    # tiny model would be read back into its memory before `ready`, and the
    # two models' memory compared below would not be the models' alone.
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    pool = spawn_pool("--config", write_config(tmp_path, {n: (d, None) for n, d in dirs.items()}), "--stats-interval", "0.3s", env=env)
    ready = {n: pool.wait_ev("ready", model=n) for n in dirs}

    # Load progress: the worker's loading events climb to the weights it loaded.
    for name, d in dirs.items():
        steps = [e for e in pool.events if e["ev"] == "loading" and e["model"] == name and "bytes_total" in e]
        loaded = [e["bytes_loaded"] for e in steps]
        assert len(steps) >= 2 and loaded == sorted(loaded)
        assert steps[-1]["bytes_loaded"] == steps[-1]["bytes_total"] == ready[name]["weights_bytes"] == tensor_bytes(d)

    pool.send({"op": "status"})
    event = pool.wait_ev("status")
    rows = {r["model"]: r for r in event["models"]}
    children = {c.pid for c in psutil.Process(pool.proc.pid).children()}
    for name, d in dirs.items():
        row = rows[name]
        assert row["state"] == "ready" and row["format"] == "bf16" and row["pid"] in children
        assert row["weights_bytes"] == tensor_bytes(d) and row["adapter_bytes"] == 0
        assert row["mlx_peak_bytes"] >= row["mlx_active_bytes"] >= row["weights_bytes"]
        assert row["rss_bytes"] >= row["uss_bytes"] > row["weights_bytes"]
        assert near(row["rss_bytes"], psutil.Process(row["pid"]).memory_info().rss)
        assert row["uptime_s"] > 0 and row["queued"] == row["in_flight"] == row["served"] == row["restarts"] == 0
        assert row["device_memory_bytes"] > row["mlx_active_bytes"]
        if row["processor"] == "cpu":
            assert row["device_memory_bytes"] == psutil.virtual_memory().total
    for field in ("rss_bytes", "uss_bytes", "mlx_active_bytes", "weights_bytes"):
        assert rows["small"][field] > rows["tiny"][field], field
    assert near(event["rss_bytes"], psutil.Process(pool.proc.pid).memory_info().rss)
    assert event["system_total_bytes"] == psutil.virtual_memory().total > event["system_available_bytes"] > 0

    # Periodic stats events carry the same measured figures as status rows.
    for name, d in dirs.items():
        stats = pool.wait_ev("stats", model=name, state="ready")
        assert set(stats) - {"ev", "_line", "_at"} == set(rows[name])
        assert stats["pid"] == rows[name]["pid"] and stats["weights_bytes"] == tensor_bytes(d) and stats["rss_bytes"] > 0

    # Unloading removes the row, the process and the stats events.
    pool.send({"op": "unload", "model": "small"})
    pool.wait_ev("unloaded", model="small")
    after = len(pool.events)
    wait_for(lambda: not pid_alive(rows["small"]["pid"]), 10, message="unloaded worker to exit")
    assert set(status(pool)) == {"tiny"}
    pool.wait_for(lambda e: e["ev"] == "stats" and any(e is x for x in pool.events[after:]))
    assert not [e for e in pool.events[after:] if e["ev"] == "stats" and e["model"] == "small"]
    assert pool.close() == 0


def test_metrics_page(tiny_model, second_model, tmp_path, spawn_pool):
    lora = write_mlx(tmp_path / "style.safetensors", lora_pairs(targets_of(tiny_model), rank=4, seed=3), alpha=8.0)
    models = {"a": (tiny_model, None), "a-styled": (tiny_model, lora), "b": (second_model, None)}
    pool = spawn_pool("--config", write_config(tmp_path, models), "--metrics-port", "0", "--http", "0")
    for m in models:
        pool.wait_ev("ready", model=m)
    port = metrics_port(pool)
    listening = [c for c in psutil.Process(pool.proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)

    pool.send({"model": "a", "id": 1, "prompt": CHAT, "max_tokens": 7, "seed": 1})
    done = pool.terminal(1)
    pool.send({"model": "no-such-model", "id": 2, "prompt": CHAT})
    assert pool.terminal(2)["code"] == "unknown_model"
    # HTTP requests refused before they reach the pool count too.
    http = int(wait_for(lambda: re.search(rb"http on http://127\.0\.0\.1:(\d+)/v1", pool.stderr), 60, message="the http line").group(1))
    for body in (b"{not json", json.dumps({"model": "a"}).encode()):
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        refused.value.close()
        assert refused.value.code == 400
    os.kill(status(pool)["a"]["pid"], signal.SIGKILL)
    pool.wait_ev("restarting", model="a")
    for m in ("a", "a-styled"):
        pool.wait_ev("ready", model=m)

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        page = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    samples = scrape(port)
    assert len(samples) == sum(len(f.samples) for f in families.values())  # no series twice
    rows = status(pool)
    # A worker's figures once per worker (model: its name without adapter, pid);
    # a name's own figures per name.
    workers = {s.labels["model"]: s.labels["pid"] for s in families["lattice_worker_rss_bytes"].samples}
    assert workers == {"a": str(rows["a"]["pid"]), "b": str(rows["b"]["pid"])} and rows["a"]["pid"] == rows["a-styled"]["pid"]
    for m in ("a", "b"):
        key = ("lattice_worker_weights_bytes", (("model", m), ("pid", workers[m])))
        assert samples[key] == rows[m]["weights_bytes"] > 0
        assert samples[("lattice_worker_rss_bytes", key[1])] > samples[key]
        assert samples[("lattice_worker_device_memory_bytes", key[1])] == rows[m]["device_memory_bytes"] > samples[key]
    for m in models:
        adapter = m if m == "a-styled" else ""  # a configured adapter's label is its name, never its path
        assert samples[series("lattice_model_state", m, adapter=adapter, state="ready")] == 1
        assert samples[series("lattice_model_state", m, adapter=adapter, state="busy")] == 0
        assert samples[series("lattice_model_queued_requests", m, adapter=adapter)] == 0
        info = {"model": m, "adapter": adapter, "format": "bf16", "worker": "b" if m == "b" else "a", "pid": workers["b" if m == "b" else "a"]}
        assert samples[("lattice_model_info", tuple(sorted(info.items())))] == 1
    assert samples[series("lattice_model_adapter_bytes", "a-styled", adapter="a-styled")] > 0
    # Throughput as counters; the histograms carry the surface.
    assert samples[series("lattice_requests_total", "a", surface="stdin")] == 1
    assert samples[series("lattice_generated_tokens_total", "a", surface="stdin")] == done["gen_tokens"] == 7
    assert samples[series("lattice_decode_seconds_total", "a", surface="stdin")] == pytest.approx((done["total_ms"] - done["ttft_ms"]) / 1000)
    assert samples[series("lattice_ttft_seconds_count", "a", surface="stdin")] == 1
    assert samples[series("lattice_ttft_seconds_sum", "a", surface="stdin")] == pytest.approx(done["ttft_ms"] / 1000)
    assert not [name for name in families if "per_second" in name]
    assert series("lattice_requests_total", "b", surface="stdin") not in samples
    assert samples[series("lattice_errors_total", "", code="unknown_model", surface="stdin")] == 1
    assert samples[series("lattice_errors_total", "", code="bad_request", surface="http")] == 2
    # One restart of one worker, under its base name.
    assert [(s.labels, s.value) for s in families["lattice_worker_restarts"].samples] == [({"model": "a"}, 1.0)]
    assert samples[("lattice_supervisor_rss_bytes", ())] > 0
    # The supervisor's own process series, and what is running.
    assert samples[("process_resident_memory_bytes", ())] > 0 and samples[("process_cpu_seconds_total", ())] > 0
    assert samples[("process_open_fds", ())] > 0 and samples[("process_start_time_seconds", ())] > 0
    (build,) = families["lattice_build_info"].samples
    assert build.name == "lattice_build_info" and build.value == 1 and build.labels["version"]
    for path in ("/nope", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30)
        missing.value.close()
        assert missing.value.code == 404

    pool.send({"op": "unload", "model": "b"})
    pool.wait_ev("unloaded", model="b")
    samples = scrape(port)
    assert not [k for k in samples if k[0].startswith(("lattice_model_", "lattice_worker_")) and ("model", "b") in k[1] and "total" not in k[0]]
    assert samples[("lattice_worker_rss_bytes", (("model", "a"), ("pid", workers["a"])))] > 0
    assert samples[series("lattice_requests_total", "a", surface="stdin")] == 1
    assert pool.close() == 0


class ControlClient:
    """A connection to a pool's control socket, read line by line."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(path))
        self.buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()

    def send(self, request: dict) -> None:
        self.sock.sendall(json.dumps(request).encode() + b"\n")

    def wait_ev(self, ev: str, **fields) -> dict:
        while True:
            while b"\n" not in self.buf:
                chunk = self.sock.recv(65536)
                assert chunk, "the pool closed the control connection"
                self.buf += chunk
            line, self.buf = self.buf.split(b"\n", 1)
            assert line.startswith(b"@@lattice {"), line
            event = json.loads(line[10:])
            if event["ev"] == ev and all(event.get(k) == v for k, v in fields.items()):
                return event


def processor_shown() -> str:
    """What `ps` says computes here, from MLX in this process."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "CPU"
    return "Metal" if mx.metal.is_available() else "GPU"


def test_control_socket_and_ps(tiny_model, second_model, tmp_path, spawn_pool):
    path = tmp_path / "ctl.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # what a killed pool leaves behind
    stale.close()
    pairs = lora_pairs(targets_of(second_model), rank=4, seed=3)
    lora = write_mlx(tmp_path / "style.safetensors", pairs, alpha=8.0)
    config = write_config(tmp_path, {"a": (tiny_model, None), "b": (second_model, lora)}, f'control_socket = "{path}"')
    pool = spawn_pool("--config", config)
    pool.wait_ev("ready", model="a")
    pool.wait_ev("ready", model="b")

    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    with ControlClient(path) as client:
        client.send({"model": "a", "id": "gen", "prompt": CHAT, "max_tokens": 3})
        refused = client.wait_ev("error")
        assert refused["code"] == "bad_request" and refused["id"] == "gen" and "stdin" in refused["msg"]
        client.send({"op": "status"})
        rows = {r["model"]: r for r in client.wait_ev("status")["models"]}
        assert rows["a"]["served"] == 0 and rows["a"]["in_flight"] == 0
        client.send({"op": "load", "model": "no-such-model"})
        assert client.wait_ev("error")["code"] == "unknown_model"
        client.send({"op": "reload", "model": "b"})
        swapped = client.wait_ev("adapter_loaded", model="b")
        assert swapped["sha256"] == hashlib.sha256(lora.read_bytes()).hexdigest()

        table = cli("ps", "--control-socket", str(path))
        assert table.returncode == 0, table.stderr
        assert table.stdout.split(b"\n", 1)[0].split() == [
            b"NAME",
            b"ADAPTER",
            b"FORMAT",
            b"STATE",
            b"MEMORY",
            b"PROCESSOR",
            b"CONTEXT",
            b"PID",
            b"UPTIME",
            b"UNTIL",
            b"REQUESTS",
        ]
        shown = ps_table(table.stdout)
        assert set(shown) == {"a", "b"}
        assert shown["a"]["ADAPTER"] == "-" and shown["b"]["ADAPTER"] == str(lora)
        for m in ("a", "b"):
            assert shown[m]["FORMAT"] == "bf16" and shown[m]["STATE"] == "ready" and shown[m]["REQUESTS"] == "0"
            assert shown[m]["PROCESSOR"] == processor_shown() and shown[m]["UNTIL"] == "Forever"
            assert shown[m]["CONTEXT"] == str(rows[m]["max_context"]) == "32768"
            assert shown[m]["PID"] == str(rows[m]["pid"]) and re.fullmatch(r"[\d.]+ MB", shown[m]["MEMORY"])

        as_json = cli("ps", "--json", "--control-socket", str(path))
        assert as_json.returncode == 0, as_json.stderr
        listed = {r["model"]: r for r in json.loads(as_json.stdout)["models"]}
        assert {m: r["pid"] for m, r in listed.items()} == {m: r["pid"] for m, r in rows.items()}
        assert listed["a"]["adapter_bytes"] == 0 and listed["b"]["lora"] == str(lora)
        # The adapter's factors take the layers' dtype: float32 on a CPU worker, else bf16.
        import mlx.core as mx

        width = 4 if mx.default_device() == mx.cpu else 2
        assert listed["b"]["adapter_bytes"] == sum(width * (a.size + b.size) for a, b in pairs.values())
        assert all(r["rss_bytes"] > r["weights_bytes"] > 0 for r in listed.values())

        client.send({"op": "unload", "model": "a"})
        client.wait_ev("unloaded", model="a")
        wait_for(lambda: not pid_alive(rows["a"]["pid"]), 10, message="unloaded worker to exit")
        after = json.loads(cli("ps", "--json", "--control-socket", str(path)).stdout)
        assert [r["model"] for r in after["models"]] == ["b"]

    # An explicitly configured socket that a live pool holds is never taken.
    second = cli("serve", "--control-socket", str(path), "--model-dir", str(tiny_model), input=b"")
    assert second.returncode == 2 and b"in use" in second.stderr and str(path).encode() in second.stderr

    assert pool.close() == 0
    # Socket replies went to the socket only: stdout stays Studio's.
    assert not [e for e in pool.events if e["ev"] == "status" or (e["ev"] == "error" and e.get("id") is None)]
    assert not path.exists()


def test_ps_shows_a_name_whose_adapter_failed_until_it_is_unloaded(tiny_model, tmp_path, spawn_pool):
    path = tmp_path / "ctl.sock"
    missing = tmp_path / "style.safetensors"  # a configured adapter may appear later: the base runs meanwhile
    pool = spawn_pool("--config", write_config(tmp_path, {"base": (tiny_model, None), "styled": (tiny_model, missing)}, f'control_socket = "{path}"'))
    pool.wait_ev("ready", model="base")
    failed = pool.wait_ev("adapter_error", model="styled")
    listed = {r["model"]: r for r in json.loads(cli("ps", "--json", "--control-socket", str(path)).stdout)["models"]}
    assert listed["base"]["state"] == "ready" and listed["base"]["error"] is None
    assert listed["styled"]["state"] == "adapter_error" and listed["styled"]["error"] == failed["msg"] and str(missing) in failed["msg"]
    table = cli("ps", "--control-socket", str(path)).stdout.decode()
    rows, reasons = table.split("\n")[:3], table.split("\n")[3:]
    shown = ps_table("\n".join(rows).encode())
    assert shown["styled"]["STATE"] == "adapter_error" and shown["styled"]["MEMORY"] == "-"
    assert reasons[0] == f"styled ({missing}): {failed['msg']}"

    with ControlClient(path) as client:
        client.send({"op": "unload", "model": "styled"})
        client.wait_ev("unloaded", model="styled")
    after = json.loads(cli("ps", "--json", "--control-socket", str(path)).stdout)
    assert [r["model"] for r in after["models"]] == ["base"]
    assert pool.close() == 0


def test_no_load_once_shutdown_began(tiny_model, second_model, tmp_path, spawn_pool):
    path = tmp_path / "ctl.sock"
    extra = f'control_socket = "{path}"\nshutdown_grace = 600'
    pool = spawn_pool("--config", write_config(tmp_path, {"a": (tiny_model, None), "b": (second_model, None)}, extra, lazy=("b",)))
    pool.wait_ev("ready", model="a")
    pool.send({"model": "a", "id": "long", "prompt": CHAT, "max_tokens": 30_000})
    pool.wait_for(lambda e: e.get("id") == "long")
    with ControlClient(path) as client:
        pool.proc.stdin.close()  # the grace period now waits for "long"
        said(pool.stderr, b"shutting down (stdin closed)", 30)
        client.send({"op": "load", "model": "b"})
        assert client.wait_ev("error")["code"] == "shutting_down"
        client.send({"op": "cancel", "id": "long"})
        client.wait_ev("unloaded", model="a")
    assert pool.close() == 0
    assert pool.terminal("long")["finish_reason"] == "cancelled"
    assert not [e for e in pool.events if e["ev"] in ("loading", "ready") and e["model"] == "b"]


def test_supervisor_imports_neither_mlx_nor_worker():
    probe = "import sys, supervisor.cli, supervisor.metrics; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'worker')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, env=child_env(), cwd=ROOT, check=True)
    assert out.stdout == b"[]\n"


def test_ps_without_a_running_pool(tmp_path):
    missing = cli("ps", env={"LATTICE_CONTROL_SOCKET": str(tmp_path / "none.sock")})
    assert missing.returncode == 1 and missing.stdout == b""
    assert b"no lattice-pool is running" in missing.stderr and str(tmp_path / "none.sock").encode() in missing.stderr
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    left = cli("ps", "--control-socket", str(path))
    assert left.returncode == 1 and b"no lattice-pool is running" in left.stderr and b"ended" in left.stderr


def test_run_shows_load_progress(small_model):
    out = cli("run", "--model-dir", str(small_model), "--prompt", CHAT, "--max-tokens", "2")
    assert out.returncode == 0, out.stderr
    assert f"loading small ({tensor_bytes(small_model) / 1e6:.1f} MB)\n".encode() in out.stderr
    assert b"small ready (bf16, loaded in " in out.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal():
    stream = _Terminal()
    screen = Screen(out=_Terminal(), err=stream)
    progress = LoadProgress(screen)
    progress.update({"ev": "loading", "model": "m", "lora": None})  # the supervisor's: no byte counts
    for done in (500, 1500, 2000):
        progress.update({"ev": "loading", "model": "m", "bytes_loaded": done, "bytes_total": 2000})
    progress.update({"ev": "ready", "model": "m", "format": "q4", "load_ms": 1500})
    frames = stream.getvalue().split("\r")[1:]
    assert [re.search(r"(\d+)% of", f).group(1) for f in frames[:3]] == ["25", "75", "100"]
    assert [f.count("#") for f in frames[:3]] == [7, 22, 30]
    assert frames[3] == "\033[Km ready (q4, loaded in 1.5s)\n"


def test_a_log_record_never_lands_on_the_progress_bar():
    stream = _Terminal()
    screen = Screen(out=_Terminal(), err=stream)
    screen.bar("loading m [###...] 10% of 4.2 MB")
    screen.log(b"2026-12-03 02:18:57,680 INFO worker model=m: hello\n")
    # Cleared, written on a line of its own, the bar drawn again below it.
    assert (
        stream.getvalue() == "\rloading m [###...] 10% of 4.2 MB\r\033[K2026-12-03 02:18:57,680 INFO worker model=m: hello\n\rloading m [###...] 10% of 4.2 MB"
    )
    # Half a reply on the same terminal: the record waits for its newline.
    screen.end_bar()
    before = stream.getvalue()
    screen.reply("half a rep")
    screen.log(b"2026-12-03 02:18:58,000 INFO lattice-pool: later\n")
    assert stream.getvalue() == before
    screen.reply("ly\n")
    assert stream.getvalue() == before + "2026-12-03 02:18:58,000 INFO lattice-pool: later\n"


def test_ps_stop_and_unload_reach_a_chat_through_its_config_socket(tiny_model, tmp_path):
    """`chat` opens the control socket as `serve` does; ps, unload and stop
    find it by the same resolution: the config file, the flag, the variable."""
    path = tmp_path / "cfg.sock"
    config = write_config(tmp_path, {"tiny": (tiny_model, None)}, f'control_socket = "{path}"\nkeep_alive = "5m"')
    chat = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "chat", "--config", config, "--max-tokens", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        chat.stdin.write(b"Hello\n")
        chat.stdin.flush()

        # The row shows once the model loads; the chat's message, once answered.
        def served() -> bool:
            out = cli("ps", "--config", config)
            return out.returncode == 0 and ps_table(out.stdout).get("tiny", {}).get("REQUESTS") == "1"

        wait_for(served, 60, message="chat's request in ps")
        shown = ps_table(cli("ps", "--config", config).stdout)["tiny"]
        assert shown["STATE"] == "ready" and shown["PROCESSOR"] == processor_shown()
        assert re.fullmatch(r"[45] minutes from now", shown["UNTIL"]), shown
        for found in (cli("ps", "--control-socket", str(path)), cli("ps", env={"LATTICE_CONTROL_SOCKET": str(path)})):
            assert found.returncode == 0 and "tiny" in ps_table(found.stdout), found.stderr

        unloaded = cli("unload", "tiny", "--config", config)
        assert unloaded.returncode == 0, unloaded.stderr
        assert ps_table(cli("ps", "--config", config).stdout) == {}
        again = cli("unload", "tiny", "--config", config)
        assert again.returncode == 1 and again.stderr == b"lattice-pool unload: tiny is not loaded\n"

        stopped = cli("stop", "--config", config)
        assert stopped.returncode == 0, stopped.stderr
        assert chat.wait(timeout=30) == 0  # stop returns as the pool goes
        err = chat.stderr.read()
        assert b"model 'tiny' unloaded (unloaded on request)" in err and b"asked to stop" in err
        assert not path.exists()
        gone = cli("stop", "--config", config)
        assert gone.returncode == 1 and b"no lattice-pool is running" in gone.stderr
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
        for stream in (chat.stdin, chat.stdout, chat.stderr):
            stream.close()


def test_ps_memory_is_what_eviction_counts_so_a_gpus_weights_show():
    from supervisor.ps import cells
    from supervisor.status import StatusRow

    def row(rss: int, active: int, cache: int) -> StatusRow:
        figures = dict(rss_bytes=rss, uss_bytes=rss, mlx_active_bytes=active, mlx_peak_bytes=active, mlx_cache_bytes=cache, weights_bytes=active)
        counts = dict(adapter_bytes=0, queued=0, in_flight=0, served=0, tokens=0, restarts=0, uptime_s=1.0)
        return StatusRow(model="m", lora=None, state="ready", pid=4242, format="bf16", processor="cuda", **figures, **counts)

    # A CUDA worker: 2 GB resident on the host, 16 GB of weights and caches
    # and 1 GB of MLX's buffer cache on the GPU.
    assert cells(row(2_000_000_000, 16_000_000_000, 1_000_000_000))[4] == "17 GB"
    # A CPU worker: MLX's buffers are part of its resident size.
    assert cells(row(3_000_000_000, 2_000_000_000, 0))[4] == "3.0 GB"
