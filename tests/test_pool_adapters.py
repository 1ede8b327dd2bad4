"""Many names on one base model through a real pool (docs/adapters.md): one worker
for every [[models]] entry that shares a path, each request with its name's
adapter, mixed batches, eviction under max_adapters, per-adapter hot
reload, a crash, load/unload ops with a lora, and the monitoring rows.

Texts are compared with greedy texts of models with the update merged in,
computed in this process (tests/conftest.py's references), which
also check that every greedy choice wins by far more than float noise: a
row's text is then the same batched or alone, on any CPU."""

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from harness.cli import cli, ps_table
from harness.metrics import metrics_port, scrape, series
from harness.pool import PoolProc
from harness.procs import pid_alive, wait_for
from harness.prompts import ADAPTER_LONG, ADAPTER_PROMPTS, ADAPTER_TOKENS
from supervisor.ps import by_worker, table
from supervisor.status import Status, StatusRow
from tests.conftest import GREEDY_MARGIN, keep_alive_across_tests, release

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 tolerances of the CPU path")

MAX_ADAPTERS = 2


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def live(files, tmp_path_factory):
    """Copies of x and y (PEFT dirs) at paths the tests rewrite, and z: x's
    update in chat_metal's single-file format, so three adapters in all."""
    root = tmp_path_factory.mktemp("names")
    paths = {name: shutil.copytree(files[name, "peft"], root / name) for name in ("x", "y")}
    paths["z"] = files["x", "mlx"]
    paths["w"] = root / "w.safetensors"  # no file yet
    return paths


@pytest.fixture(scope="module")
def pool(tiny_model, live, tmp_path_factory):
    """base (no adapter), x and y preloaded, z and w (whose file is not
    there yet) on first use: one worker holding at most two adapters."""
    root = tmp_path_factory.mktemp("pool")
    text = f'max_adapters = {MAX_ADAPTERS}\nprefix_cache_bytes = 0\nmetrics_port = 0\ncontrol_socket = "{root / "ctl.sock"}"\n'
    for name, lora in (("base", None), ("x", live["x"]), ("y", live["y"]), ("z", live["z"]), ("w", live["w"])):
        text += f'[[models]]\nname = "{name}"\npath = "{tiny_model}"\npreload = {str(name in ("base", "x", "y")).lower()}\n'
        text += f'lora = "{lora}"\n' if lora else ""
    (root / "pool.toml").write_text(text)
    p = PoolProc("--config", str(root / "pool.toml"))
    keep_alive_across_tests(p.proc.pid)
    try:
        for name in ("base", "x", "y"):
            p.wait_ev("ready", model=name)
        p.socket = root / "ctl.sock"
        yield p
        assert p.close() == 0
    finally:
        release(p.proc.pid)
        p.kill()


_ids = iter(range(1, 1_000_000))


def request(model: str, prompt: int, max_tokens: int = ADAPTER_TOKENS, **fields) -> dict:
    return {
        "model": model,
        "id": f"{model}-{next(_ids)}",
        "prompt": ADAPTER_PROMPTS[prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "repetition_penalty": 1.0,
        **fields,
    }


def send_together(pool, reqs: list[dict]) -> None:
    pool.send(b"".join(pool.line(r) for r in reqs))
    pool.sent_ids += [r["id"] for r in reqs]


def texts(pool, reqs: list[dict]) -> list[str]:
    """Sends the requests in one write (so they decode in one batch) and
    returns their texts."""
    send_together(pool, reqs)
    for r in reqs:
        assert pool.terminal(r["id"])["ev"] == "gen_token", pool.terminal(r["id"])
    return [pool.text(r["id"]) for r in reqs]


def rows(pool) -> dict:
    """Status rows by model name (the names of the pool's config)."""
    return {model: row for (model, lora), row in pairs(pool).items()}


def pairs(pool) -> dict:
    """Status rows by (model, lora)."""
    mark = time.monotonic()
    pool.send({"op": "status"})
    return {(row["model"], row["lora"]): row for row in since(pool, mark, "status")["models"]}


def since(pool, mark: float, ev: str, **fields) -> dict:
    """The first event like pool.wait_ev's that arrived after `mark` (time.monotonic)."""
    return pool.wait_for(lambda e: e["_at"] >= mark and e["ev"] == ev and all(e.get(k) == v for k, v in fields.items()))


def workers_of(pool) -> list[psutil.Process]:
    return psutil.Process(pool.proc.pid).children()


def test_one_worker_serves_every_name_of_a_base(pool, live, updates):
    ready = {e["model"]: e for e in pool.events if e["ev"] == "ready"}
    assert {m: ready[m]["lora"] for m in ("base", "x", "y")} == {"base": None, "x": str(live["x"]), "y": str(live["y"])}
    # The pool's own load of a name's adapter is answered by its ready line.
    assert not [e for e in pool.events if e["ev"] == "adapter_loaded" and e["_at"] <= ready["y"]["_at"]]
    status = rows(pool)
    assert set(status) == {"base", "x", "y"}
    assert len({r["pid"] for r in status.values()}) == 1 and len({r["worker"] for r in status.values()}) == 1
    assert [w.pid for w in workers_of(pool)] == [status["base"]["pid"]]
    argv = workers_of(pool)[0].cmdline()
    assert "--lora" not in argv and argv[argv.index("--max-adapters") + 1] == str(MAX_ADAPTERS)
    # Each name's row counts its own adapter (float32 factors on a CPU worker); the base's none.
    assert status["base"]["adapter_bytes"] == 0
    for m in ("x", "y"):
        assert status[m]["adapter_bytes"] == sum(4 * (a.size + b.size) for a, b in updates[m][0].values())
    for r in status.values():
        assert r["weights_bytes"] == status["base"]["weights_bytes"] > 0 and r["max_adapters"] == MAX_ADAPTERS


def test_rows_of_different_names_in_one_batch_match_each_alone(pool, references):
    expected, margin = references
    batch = [("x", 0), ("y", 1), ("base", 2), ("x", 1), ("y", 3)]
    got = texts(pool, [request(model, p) for model, p in batch])
    assert got == [expected[None if model == "base" else model, p] for model, p in batch]
    assert margin > GREEDY_MARGIN


def test_least_recently_used_adapter_is_evicted_and_read_again_on_next_use(pool, live, references):
    expected, _ = references
    assert texts(pool, [request("x", 0)]) == [expected["x", 0]]
    assert texts(pool, [request("y", 1)]) == [expected["y", 1]]  # x is now the least recently used
    mark, first = time.monotonic(), len(pool.events)
    assert texts(pool, [request("z", 0)]) == [expected["x", 0]]  # z: x's update in another file
    assert since(pool, mark, "ready", model="z")["lora"] == str(live["z"])
    status = rows(pool)
    assert status["x"]["adapter_bytes"] == 0 and status["y"]["adapter_bytes"] > 0 and status["z"]["adapter_bytes"] > 0
    # x is read again for its next request; the worker says so for x alone.
    assert texts(pool, [request("x", 1)]) == [expected["x", 1]]
    loaded = [e for e in pool.events[first:] if e["ev"] == "adapter_loaded"]
    assert [(e["model"], e["lora"]) for e in loaded] == [("x", str(live["x"]))], loaded
    assert rows(pool)["x"]["adapter_bytes"] > 0


def test_hot_reload_of_one_adapter_while_rows_of_another_decode(pool, live, files, references):
    """x's file takes y's update while a row of y and a row of x decode:
    both finish unchanged, and requests of x started after the reload
    compute y's update. (The reload op asks for the re-read at once, so
    that it lands while the rows run; the file watch sends the same
    message: tests/test_hot_reload.py.)"""
    expected, _ = references
    assert texts(pool, [request("x", 0), request("y", 1)]) == [expected["x", 0], expected["y", 1]]
    long_x, long_y = request("x", 0, ADAPTER_LONG), request("y", 1, ADAPTER_LONG)
    send_together(pool, [long_x, long_y])
    for r in (long_x, long_y):
        pool.wait_for(lambda e: e.get("id") == r["id"])
    try:
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(live["y"] / name, live["x"] / name)
        new = sha(live["x"] / "adapter_model.safetensors")
        mark = time.monotonic()
        pool.send({"op": "reload", "model": "x"})
        loaded = since(pool, mark, "adapter_loaded", sha256=new)
        assert loaded["model"] == "x" and loaded["lora"] == str(live["x"])
        assert not [e for e in pool.events if is_end(e, long_y) or is_end(e, long_x)], "the long rows were still running"
        assert texts(pool, [request("x", 1)]) == [expected["y", 1]]
        pool.terminal(long_x["id"])
        pool.terminal(long_y["id"])
        assert pool.text(long_x["id"]) == expected["x", 0, ADAPTER_LONG] and pool.text(long_y["id"]) == expected["y", 1, ADAPTER_LONG]
        assert not [e for e in pool.events if e["ev"] == "adapter_loaded" and e["model"] != "x" and e["_at"] >= loaded["_at"]]
    finally:
        restore(pool, live, files)


def is_end(event: dict, req: dict) -> bool:
    return event.get("id") == req["id"] and (event["ev"] == "error" or event.get("done") is True)


def restore(pool, live, files) -> None:
    """x's file back to x's update, and the worker reading it."""
    mark = time.monotonic()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(files["x", "peft"] + "/" + name, live["x"] / name)
    since(pool, mark, "adapter_loaded", model="x", sha256=sha(live["x"] / "adapter_model.safetensors"))


def test_a_corrupt_replacement_is_an_adapter_error_for_that_name_only(pool, live, files, references):
    expected, _ = references
    assert texts(pool, [request("x", 0), request("y", 1)]) == [expected["x", 0], expected["y", 1]]
    mark, first = time.monotonic(), len(pool.events)
    weights = live["x"] / "adapter_model.safetensors"
    try:
        weights.write_bytes(weights.read_bytes()[:1000])
        error = since(pool, mark, "adapter_error", model="x")
        assert error["lora"] == str(live["x"]) and "keeping the version loaded before" in error["msg"], error
        assert texts(pool, [request("x", 0), request("y", 1), request("base", 2)]) == [expected["x", 0], expected["y", 1], expected[None, 2]]
        assert {e["model"] for e in pool.events[first:] if e["ev"] == "adapter_error"} == {"x"}
    finally:
        restore(pool, live, files)


def test_status_ps_and_metrics_have_a_row_per_name(pool, live):
    texts(pool, [request("x", 0), request("y", 0)])  # both resident
    status = rows(pool)
    served = {m: r["served"] for m, r in status.items()}
    texts(pool, [request("x", 1, max_tokens=3)])
    after = rows(pool)
    assert after["x"]["served"] == served["x"] + 1 and after["x"]["tokens"] >= 3
    assert after["y"]["served"] == served["y"] and after["base"]["served"] == served["base"]

    shown = cli("ps", "--control-socket", str(pool.socket))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.decode().splitlines()[1:]
    names = [line.split()[0] for line in lines]
    assert names[0] == "base" and set(names[1:]) >= {"x", "y"}, lines
    table_rows = ps_table(shown.stdout)
    for line in lines[1:]:
        assert line.startswith("  "), lines  # under their base
    for m in ("x", "y"):
        assert table_rows[m]["PID"] == table_rows["base"]["PID"] == str(after["base"]["pid"])
        assert table_rows[m]["MEMORY"].startswith("+") and table_rows[m]["ADAPTER"] == str(live[m])

    samples = scrape(metrics_port(pool))
    now = rows(pool)
    for m in ("base", "x", "y"):
        adapter = m if m != "base" else ""  # a configured adapter's label is its name, never its path
        # The names' worker: its figures under its base name and pid.
        info = {"model": m, "adapter": adapter, "format": "bf16", "worker": "base", "pid": str(now["base"]["pid"])}
        assert samples[("lattice_model_info", tuple(sorted(info.items())))] == 1
        assert samples[series("lattice_model_adapter_bytes", m, adapter=adapter)] == now[m]["adapter_bytes"]
    worker = [k for k in samples if k[0] == "lattice_worker_rss_bytes"]
    assert worker == [("lattice_worker_rss_bytes", (("model", "base"), ("pid", str(now["base"]["pid"]))))] and samples[worker[0]] > 0
    assert now["x"]["adapter_bytes"] > 0 and now["x"]["worker"] == now["base"]["worker"]
    assert samples[series("lattice_requests_total", "x", adapter="x", surface="stdin")] >= 2
    assert not [k for k in samples if any(v == str(live["x"]) for _, v in k[1])]


def test_a_crash_restarts_the_base_worker_once_and_every_name_comes_back(pool, references):
    expected, _ = references
    before = rows(pool)
    names = sorted(before)
    mark, first = time.monotonic(), len(pool.events)
    os.kill(before["base"]["pid"], signal.SIGKILL)
    for m in names:
        since(pool, mark, "ready", model=m)
    events = pool.events[first:]
    assert sorted(e["model"] for e in events if e["ev"] == "restarting") == names
    assert sorted(e["model"] for e in events if e["ev"] == "ready") == names
    after = rows(pool)
    assert len({r["pid"] for r in after.values()}) == 1 and after["base"]["pid"] != before["base"]["pid"]
    assert all(r["restarts"] == before[m]["restarts"] + 1 for m, r in after.items())
    assert [w.pid for w in workers_of(pool)] == [after["base"]["pid"]]
    assert texts(pool, [request("x", 0), request("y", 1), request("base", 2)]) == [expected["x", 0], expected["y", 1], expected[None, 2]]


def test_load_and_unload_a_lora_on_the_running_worker(pool, files, references):
    expected, _ = references
    pid = rows(pool)["base"]["pid"]
    other = files["y", "mlx-lm"]  # y's update in mlx-lm's format
    mark = time.monotonic()
    pool.send({"op": "load", "model": "base", "lora": other})
    assert since(pool, mark, "ready", model="base", lora=other)["format"] == "bf16"
    assert texts(pool, [request("base", 1, lora=other)]) == [expected["y", 1]]
    status = pairs(pool)
    assert status["base", other]["pid"] == pid and status["base", other]["adapter_bytes"] > 0
    mark = time.monotonic()
    pool.send({"op": "unload", "model": "base", "lora": other})
    assert since(pool, mark, "unloaded", model="base", lora=other)["reason"] == "unloaded on request"
    status = pairs(pool)
    assert ("base", other) not in status and status["base", None]["pid"] == pid
    assert texts(pool, [request("base", 2)]) == [expected[None, 2]]
    assert not [e for e in pool.events if e["ev"] == "adapter_unloaded"]
    # Unloading a name leaves the others on the worker; a load brings it back.
    mark = time.monotonic()
    pool.send({"op": "unload", "model": "y"})
    since(pool, mark, "unloaded", model="y")
    assert "y" not in rows(pool) and rows(pool)["x"]["pid"] == pid
    mark = time.monotonic()
    pool.send({"op": "load", "model": "y"})
    since(pool, mark, "ready", model="y")
    assert texts(pool, [request("y", 1)]) == [expected["y", 1]] and rows(pool)["y"]["pid"] == pid


def test_a_bad_adapter_fails_its_name_only_until_a_load_brings_it_up(pool, live, files, references):
    """A name whose adapter cannot be read gets adapter_error, and each of
    its requests an adapter_error error; the base and the other names go on.
    Once the file is good, it comes up (its watch reloads it, or a load)."""
    expected, _ = references
    mark = time.monotonic()
    pool.send({"op": "load", "model": "w"})
    error = since(pool, mark, "adapter_error", model="w")
    assert error["lora"] == str(live["w"]) and str(live["w"]) in error["msg"]
    bad, good = request("w", 0), request("y", 1)
    send_together(pool, [bad, good])
    assert pool.terminal(bad["id"])["code"] == "adapter_error" and pool.of(bad["id"])[0]["ev"] == "error"
    assert pool.terminal(good["id"])["ev"] == "gen_token" and pool.text(good["id"]) == expected["y", 1]
    assert not [e for e in pool.events if e["ev"] in ("failed", "ready") and e["model"] == "w"]
    mark = time.monotonic()
    shutil.copy(files["x", "mlx"], live["w"])
    pool.send({"op": "load", "model": "w"})
    assert since(pool, mark, "ready", model="w")["lora"] == str(live["w"])
    assert texts(pool, [request("w", 0)]) == [expected["x", 0]]
    assert len(workers_of(pool)) == 1


def test_a_config_of_one_worker_per_pair_keeps_working(tiny_model, live, references, tmp_path, spawn_pool):
    """The config shape of docs/configuration.md, a name with an adapter and one without on the same
    path: the same events and answers as one worker each, one process."""
    expected, _ = references
    config = tmp_path / "pool.toml"
    config.write_text(
        f'max_loaded = 1\n[[models]]\nname = "plain"\npath = "{tiny_model}"\npreload = true\n'
        f'[[models]]\nname = "styled"\npath = "{tiny_model}"\nlora = "{live["y"]}"\npreload = true\n'
    )
    pool = spawn_pool("--config", str(config))
    for name, lora in (("plain", None), ("styled", str(live["y"]))):
        assert pool.wait_ev("ready", model=name)["lora"] == lora
    kinds = [(e["ev"], e["model"]) for e in pool.events if "bytes_total" not in e]
    assert kinds == [("loading", "plain"), ("loading", "styled"), ("ready", "plain"), ("ready", "styled")], kinds
    got = texts(pool, [request("plain", 2), request("styled", 1)])
    assert got == [expected[None, 2], expected["y", 1]]
    assert len(workers_of(pool)) == 1  # max_loaded = 1 counts the one worker
    pool.send({"op": "unload", "model": "plain"})
    pool.wait_ev("unloaded", model="plain")
    assert texts(pool, [request("styled", 1)]) == [expected["y", 1]]
    pid = rows(pool)["styled"]["pid"]
    pool.send({"op": "unload", "model": "styled"})
    pool.wait_ev("unloaded", model="styled")
    wait_for(lambda: not pid_alive(pid), 10, message="the worker to exit with its last name")
    assert pool.close() == 0


def test_names_past_max_names_leave_least_recently_used_first(tiny_model, files, references, tmp_path, spawn_pool):
    """A client naming adapter after adapter: past max_names the least
    recently used name without requests leaves the worker; a busy one
    stays however old; a name that left comes back on its next request."""
    expected, _ = references
    config = tmp_path / "pool.toml"
    x, y, z = files["x", "peft"], files["y", "peft"], files["x", "mlx"]
    roots = sorted({str(Path(p).parent) for p in (x, y, z)})
    config.write_text(f'max_names = 2\nprefix_cache_bytes = 0\nadapter_dirs = {json.dumps(roots)}\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    pool = spawn_pool("--config", str(config))

    def adapted(lora: str, **fields) -> dict:
        return request("tiny", 1, lora=lora, **fields)

    assert texts(pool, [adapted(x)]) == [expected["x", 1]]
    assert texts(pool, [adapted(y)]) == [expected["y", 1]]
    assert texts(pool, [adapted(z)]) == [expected["x", 1]]
    gone = pool.wait_ev("unloaded", model="tiny")
    assert gone["lora"] == x and "max_names (2)" in gone["reason"], gone
    assert set(pairs(pool)) == {("tiny", y), ("tiny", z)}

    # y is now the oldest, but a request of it is running: z leaves instead.
    busy = adapted(y, max_tokens=30_000)
    pool.send(busy)
    pool.wait_for(lambda e: e.get("id") == busy["id"])
    assert texts(pool, [adapted(x)]) == [expected["x", 1]]
    assert pool.wait_ev("unloaded", model="tiny")["lora"] == z
    assert set(pairs(pool)) == {("tiny", y), ("tiny", x)}
    pool.send({"op": "cancel", "id": busy["id"]})
    assert pool.terminal(busy["id"])["finish_reason"] == "cancelled"
    assert pool.close() == 0


def test_ps_puts_the_adapters_of_a_worker_under_its_first_row():
    def row(model, lora, worker, pid):
        zero = dict.fromkeys(("uss_bytes", "mlx_active_bytes", "mlx_peak_bytes", "mlx_cache_bytes", "queued", "in_flight", "served", "tokens", "restarts"), 0)
        return StatusRow(
            model, lora, "ready", pid, "bf16", rss_bytes=2_000_000, weights_bytes=1, adapter_bytes=5000 if lora else 0, uptime_s=1.0, worker=worker, **zero
        )

    status = Status(
        [row("b-style", "/a/s", 2, 12), row("a", None, 1, 11), row("a-terse", "/a/t", 1, 11), row("b", None, 2, 12), row("c-only", "/c", 3, 13)], 0, 0, 0
    )
    assert [g[0].model for g in by_worker(status.models)] == ["a", "b", "c-only"]
    lines = table(status).splitlines()
    assert [line.split()[0] for line in lines] == ["NAME", "a", "a-terse", "b", "b-style", "c-only"]
    assert [line.startswith("  ") for line in lines[1:]] == [False, True, False, True, False]
    assert "+5.0 KB" in lines[2] and "2.0 MB" in lines[1] and "2.0 MB" in lines[5] and "+5.0 KB" not in lines[5]


def test_a_worker_stays_as_long_as_the_longest_keep_alive_of_its_names():
    from pathlib import Path

    from supervisor.policy import RestartPolicy
    from supervisor.slot import WorkerSlot
    from supervisor.spec import ModelSpec

    def spec(name, lora, keep):
        return ModelSpec(name, Path("/m"), Path(lora) if lora else None, keep_alive=keep)

    slot = WorkerSlot(spec("a", None, 10.0), None, None, None, RestartPolicy(), None)
    slot.roster.join(spec("a", None, 10.0))
    slot.roster.join(spec("b", "/x", 30.0))
    assert slot.roster.keep_alive == 30.0 and len(slot.names) == 2
    slot.roster.join(spec("c", "/y", None))
    assert slot.roster.keep_alive is None
