"""A request's `lora` is a policy, not a door: it names a configured
adapter, or (stdin, control socket) a regular file under adapter_dirs;
request text is never expanded; everything else gets one `bad_request`
that tells nothing of the file. And requests naming files cost the pool
nothing: no watch before an adapter loaded, one watcher for the pool, no
stall of other streams, no new metric series."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from harness.metrics import metrics_port, scrape
from harness.pool import PoolProc, is_terminal
from harness.procs import wait_for
from supervisor.config import Config, ModelEntry
from supervisor.resolve import AdapterRefused, Resolver
from tests.conftest import keep_alive_across_tests, release
from tests.lora_files import lora_pairs, targets_of, write_mlx, write_peft

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
SECRET = "hf_demo_secret"


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """An allowed root holding a good adapter, a PEFT adapter directory and
    every kind of file a request must not reach through it; a configured
    adapter elsewhere."""
    top = tmp_path_factory.mktemp("adapter-paths")
    root = top / "adapters"
    root.mkdir()
    pairs = lora_pairs(targets_of(tiny_model), seed=5)
    good = write_mlx(root / "good.safetensors", pairs, alpha=8.0)
    peft = write_peft(root / "peft", pairs, r=4, alpha=8.0)
    (top / "conf").mkdir()
    styled = write_mlx(top / "conf" / "styled.safetensors", lora_pairs(targets_of(tiny_model), seed=6), alpha=8.0)
    # A file the environment variable would name, were it expanded.
    (root / f"{SECRET}.safetensors").write_bytes(good.read_bytes())
    os.mkfifo(root / "fifo.safetensors")
    (root / "empty-dir").mkdir()
    limit = max(good.stat().st_size, (peft / "adapter_model.safetensors").stat().st_size) + 1024
    big = root / "big.safetensors"
    big.write_bytes(b"\0" * (limit + 1))  # past max_adapter_bytes
    (root / "passwd.safetensors").symlink_to("/etc/passwd")
    junk = root / "junk"
    junk.mkdir()
    tree = root / "tree"
    for i in range(1500):  # a tree a recursive watch would crawl on the event loop
        (tree / f"d{i // 50}" / f"e{i}").mkdir(parents=True)
    return {"top": top, "root": root, "good": good, "peft": peft, "styled": styled, "big": big, "junk": junk, "tree": tree, "limit": limit}


def config_text(tiny_model: Path, files: dict[str, Path], extra: str = "") -> str:
    return (
        f'adapter_dirs = ["{files["root"]}"]\nmax_adapter_bytes = {files["limit"]}\n{extra}'
        f'[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\n'
        f'[[models]]\nname = "styled"\npath = "{tiny_model}"\nlora = "{files["styled"]}"\n'
    )


def hostile(files: dict[str, Path]) -> list[str]:
    """`lora` values a client must not get through; each names something
    that exists or an expansion of something that does."""
    root = files["root"]
    return [
        "/etc/passwd",
        "/etc",
        "/",
        "/dev/zero",
        "/proc/self/environ",
        f"{root}/../../../../../../etc/passwd",
        f"{root}/${{LATTICE_TEST_SECRET}}.safetensors",
        f"{root}/$LATTICE_TEST_SECRET.safetensors",
        "~/.bashrc",
        f"{root}/fifo.safetensors",
        f"{root}/empty-dir",
        str(files["tree"]),
        str(files["big"]),
        f"{root}/passwd.safetensors",
        f"{root}/missing.safetensors",
        f"{root}/a\u0000b",
        "x" * 5000,
    ]


def policy_resolver(tiny_model: Path, files: dict[str, Path], **settings) -> Resolver:
    return Resolver(
        Config(
            adapter_dirs=[str(files["root"])],
            max_adapter_bytes=files["limit"],
            models=[ModelEntry(name="tiny", path=str(tiny_model)), ModelEntry(name="styled", path=str(tiny_model), lora=str(files["styled"]))],
            **settings,
        )
    )


def in_thread(call):
    """Runs `call` where a blocking open (of a FIFO) cannot hang the test."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(_outcome(call)), daemon=True)
    worker.start()
    worker.join(30)
    assert result, "the call blocked"
    return result[0]


def _outcome(call):
    try:
        return call()
    except Exception as exc:
        return exc


def test_request_text_is_never_expanded(tiny_model, files, monkeypatch):
    """`"lora":"/x/${HF_TOKEN}"` came back as `adapter /x/hf_demo_secret:
    cannot read it`: the pool's environment, to whoever sends a request."""
    monkeypatch.setenv("LATTICE_TEST_SECRET", SECRET)
    monkeypatch.setenv("HOME", str(files["root"]))
    resolver = policy_resolver(tiny_model, files)
    for lora in (f"{files['root']}/${{LATTICE_TEST_SECRET}}.safetensors", f"{files['root']}/$LATTICE_TEST_SECRET.safetensors", "~/good.safetensors"):
        with pytest.raises(AdapterRefused) as refused:
            resolver.resolve("tiny", lora, lora_paths=True)
        assert SECRET not in str(refused.value) and str(files["root"] / "good") not in str(refused.value)
    assert resolver.resolve("tiny", str(files["root"] / f"{SECRET}.safetensors"), lora_paths=True).lora == files["root"] / f"{SECRET}.safetensors"


def test_every_refusal_reads_the_same_and_opens_nothing(tiny_model, files, monkeypatch):
    """Missing, outside the roots, a FIFO, a directory, a device, too big, a
    link out: one answer, naming only the text sent; and a FIFO is never
    opened (an open would block this thread)."""
    monkeypatch.setenv("LATTICE_TEST_SECRET", SECRET)
    resolver = policy_resolver(tiny_model, files)
    for lora in hostile(files):
        for paths in (True, False):
            outcome = in_thread(lambda: resolver.resolve("tiny", lora, lora_paths=paths))
            assert isinstance(outcome, AdapterRefused), (lora, outcome)
            assert str(outcome) == resolver.adapters.refusal(lora, paths)
    # What the policy lets through: configured adapters by name or path
    # everywhere, files and adapter directories under the roots on stdin.
    for lora, path in (("styled", files["styled"]), (str(files["styled"]), files["styled"])):
        assert resolver.resolve("tiny", lora).lora == path
    for lora in (str(files["good"]), str(files["peft"])):
        assert resolver.resolve("tiny", lora, lora_paths=True).lora == Path(lora)
        with pytest.raises(AdapterRefused):
            resolver.resolve("tiny", lora)  # HTTP's default: configured adapters only
    assert policy_resolver(tiny_model, files, http_adapters="adapter_dirs").resolve("tiny", str(files["good"])).lora == files["good"]


def test_the_default_roots_are_the_configured_adapters_dirs_and_the_users(tiny_model, files):
    resolver = Resolver(Config(models=[ModelEntry(name="styled", path=str(tiny_model), lora=str(files["styled"]))]))
    assert set(resolver.adapters.roots) == {files["styled"].parent, Path("~/.lattice/adapters").expanduser().resolve()}
    assert resolver.adapters.name_of(files["styled"]) == "styled"
    assert resolver.adapters.name_of(files["good"]) == "good" and resolver.adapters.name_of(files["peft"] / "adapter_model.safetensors") == "peft"


# -- a real pool -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(tiny_model, files):
    config = files["top"] / "pool.toml"
    config.write_text(config_text(tiny_model, files, 'http = "127.0.0.1:0"\nmetrics_port = 0\n'))
    p = PoolProc("--config", str(config), env={"LATTICE_TEST_SECRET": SECRET})
    keep_alive_across_tests(p.proc.pid)
    try:
        p.wait_ev("ready", model="tiny")
        found = wait_for(lambda: re.search(rb"http on (http://127\.0\.0\.1:\d+/v1)", p.stderr), 60, message="the http log line")
        p.url = found.group(1).decode()
        p.metrics = metrics_port(p)
        yield p
        assert p.close() == 0
    finally:
        release(p.proc.pid)
        p.kill()


def post(pool, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(pool.url + "/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_hostile_loras_over_stdin_and_http_get_one_bad_request(pool, files, tiny_model):
    """`/etc/passwd` as `lora` over HTTP answered with its exact size (or,
    for a safetensors file, its tensor names) from the worker's reader.
    Now each answer is the policy's one refusal, a function of the text
    sent alone."""
    policy = policy_resolver(tiny_model, files).adapters
    for n, lora in enumerate(hostile(files)):
        pool.send({"model": "tiny", "id": f"h{n}", "lora": lora, "prompt": CHAT, "max_tokens": 2})
        status, body = post(pool, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": lora})
        error = pool.terminal(f"h{n}")
        assert error["ev"] == "error" and error["code"] == "bad_request" and error["msg"] == policy.refusal(lora, True), (lora, error)
        assert status == 400 and body["error"]["code"] == "bad_request" and body["error"]["message"] == policy.refusal(lora, False), (lora, body)
        assert SECRET not in error["msg"] + body["error"]["message"]
    # Over HTTP a file under the roots is refused too (its tensor names
    # would come back); the configured adapter is served by its name.
    status, body = post(pool, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": str(files["good"])})
    assert status == 400 and "lora_a" not in body["error"]["message"] and "not a configured adapter" in body["error"]["message"]
    status, body = post(pool, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "lora": "styled"})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    pool.send({"model": "tiny", "id": "ok", "lora": str(files["good"]), "prompt": CHAT, "max_tokens": 3})
    assert pool.terminal("ok")["gen_tokens"] == 3
    assert not [e for e in pool.events if e["ev"] in ("failed", "restarting")]


def test_a_broken_adapter_named_by_a_request_is_told_once_per_try(pool, files):
    """Each request for an adapter the worker cannot read: one adapter_error
    line (its `loading` line first, once), and its error; no watch."""
    broken = files["root"] / "broken.safetensors"
    broken.write_bytes(b"not an adapter")
    mark = len(pool.events)
    for n in range(2):
        pool.send({"model": "tiny", "id": f"b{n}", "lora": str(broken), "prompt": CHAT, "max_tokens": 1})
        assert pool.terminal(f"b{n}")["code"] == "adapter_error"
    lines = [e["ev"] for e in pool.events[mark:] if e.get("lora") == str(broken) or e.get("id") in ("b0", "b1")]
    assert lines == ["loading", "adapter_error", "error", "adapter_error", "error"], lines


def inotify_instances(pid: int) -> int:
    """inotify instances held by the pool: its processes' descriptors that
    are links to anon_inode:inotify."""
    count = 0
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        fds = Path(f"/proc/{p.pid}/fd")
        try:
            names = list(fds.iterdir())
        except OSError:
            continue
        for fd in names:
            try:
                count += os.readlink(fd) == "anon_inode:inotify"
            except OSError:
                pass
    return count


def metric_series(pool) -> set[tuple]:
    return {
        key
        for key in scrape(pool.metrics)
        if key[0].startswith("lattice_") and not key[0].startswith(("lattice_model_", "lattice_system_", "lattice_supervisor_"))
    }


def counter(match):
    """A predicate's helper: counts the distinct events it is shown that
    match (wait_for shows an event again in a later call); called without
    an event, says how many so far."""
    seen: set[int] = set()

    def count(event: dict | None = None) -> int:
        if event is not None and id(event) not in seen and match(event):
            seen.add(id(event))
        return len(seen)

    return count


def gaps(events: list[dict], since: float, until: float) -> list[float]:
    times = [e["_at"] for e in events if since <= e["_at"] <= until]
    return [b - a for a, b in zip(times, times[1:])]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts inotify descriptors through /proc")
def test_a_flood_of_paths_costs_the_pool_nothing(pool, files):
    """A `lora` naming a directory started a recursive watch of its parent
    on the event loop (/etc froze every stream for 2.2 s), and every
    distinct path its own inotify instance, made before the adapter was
    read and never released (128 paths took all of the user's), and its
    own metric series. Now: one watcher, watches only on adapters that
    loaded, the stream goes on, no new series."""
    # Every series the stream and a loaded adapter make, made beforehand.
    pool.send({"model": "tiny", "id": "warm", "lora": "styled", "prompt": CHAT, "max_tokens": 2})
    pool.send({"model": "tiny", "id": "warm-base", "prompt": CHAT, "max_tokens": 2})
    pool.terminal("warm")
    pool.terminal("warm-base")
    before = metric_series(pool)
    held = inotify_instances(pool.proc.pid)
    assert held <= 1  # the one watcher: the configured adapter loaded

    # A stall the flood causes shows in every try; this machine's own
    # jitter (other processes on its cores) rarely in three.
    stalls = []
    for attempt in range(3):
        flood = flood_of_paths(files, attempt)
        during, baseline = stream_gaps_under(pool, flood, attempt)
        codes = {pool.terminal(f"f{attempt}-{i}")["code"] for i in range(len(flood))}
        assert codes == {"bad_request", "adapter_error"}, codes
        peak = max(held, inotify_instances(pool.proc.pid))
        assert peak <= 2, f"the pool held {peak} inotify instances"
        stalls.append(f"{during * 1000:.0f} ms (at most {baseline * 1000:.0f} ms before)")
        if during < baseline + 0.1:
            break
    else:
        raise AssertionError(f"the stream stalled under each flood: {stalls}")
    grown = metric_series(pool) - before
    # The 20 names of files called junk.safetensors share one label: one
    # series each, not one per name (a page with a series twice is refused).
    with urllib.request.urlopen(f"http://127.0.0.1:{pool.metrics}/metrics", timeout=30) as response:
        page = [line.rsplit(" ", 1)[0] for line in response.read().decode().splitlines() if line and not line.startswith("#")]
    assert len(page) == len(set(page)), sorted(line for line in page if page.count(line) > 1)[:5]
    assert {dict(labels).get("adapter") for _, labels in grown} <= {"", "junk"}, sorted(grown)
    assert len(grown) <= 3, sorted(grown)  # bad_request; adapter_error; junk's failed load
    assert not [e for e in pool.events if e["ev"] in ("failed", "restarting")]


def flood_of_paths(files: dict[str, Path], attempt: int) -> list[str]:
    """203 distinct `lora` values: a directory tree and two system
    directories, 20 regular files under the root that are no adapters
    (the worker reads them), 180 missing files inside and outside it."""
    junk = []
    for i in range(20):
        path = files["junk"] / f"n{attempt}-{i}" / "junk.safetensors"
        path.parent.mkdir()
        path.write_bytes(b"not an adapter %d" % i)
        junk.append(str(path))
    flood = [str(files["tree"]), "/etc", "/usr/lib", *junk]
    flood += [f"/tmp/lattice-no-such-dir-{attempt}-{i}/adapter.safetensors" for i in range(90)]
    flood += [f"{files['root']}/missing-{attempt}-{i}.safetensors" for i in range(90)]
    assert len(set(flood)) == 203
    return flood


def stream_gaps_under(pool, flood: list[str], attempt: int) -> tuple[float, float]:
    """Sends the flood (ids f{attempt}-N) in one write while a stream
    decodes; its largest gap between tokens from the flood to just after
    its last answer, and its largest in a stretch before, three times as
    long: the 100 ms the flood may add is measured above this machine's
    own jitter."""
    stream_id = f"stream-{attempt}"
    pool.send({"model": "tiny", "id": stream_id, "prompt": CHAT, "max_tokens": 30_000, "temperature": 0.7, "seed": 1})
    # Predicates see each new event once, so that this thread, which holds
    # the GIL while it looks, never delays the reader thread that stamps
    # each line's arrival time (_at).
    tokens = counter(lambda e: e.get("id") == stream_id and e["ev"] == "gen_token")
    pool.wait_for(lambda e: tokens(e) >= 100)
    flood_start = time.monotonic()
    ids = [f"f{attempt}-{i}" for i in range(len(flood))]
    pool.send(b"".join(pool.line({"model": "tiny", "id": i, "lora": lora, "prompt": CHAT, "max_tokens": 1}) for i, lora in zip(ids, flood)))
    pool.sent_ids += ids
    prefix = f"f{attempt}-"
    ended = counter(lambda e: str(e.get("id")).startswith(prefix) and is_terminal(e))
    pool.wait_for(lambda e: ended(e) == len(flood))
    flood_end = time.monotonic()
    count = tokens()
    pool.wait_for(lambda e: tokens(e) >= count + 20)
    pool.send({"op": "cancel", "id": stream_id})
    assert pool.terminal(stream_id)["finish_reason"] == "cancelled"
    stream = [e for e in pool.events if e.get("id") == stream_id and e["ev"] == "gen_token"]
    until = max(flood_end, stream[count - 1]["_at"]) + 0.1
    during = max(gaps(stream, flood_start, until))
    baseline = max(gaps(stream, max(stream[0]["_at"], flood_start - 3 * (until - flood_start)), flood_start))
    return during, baseline


def test_metric_label_pairs_are_bounded_least_recently_used_out():
    """Each (model, adapter) pair a counter saw kept its series for ever:
    6,000 distinct paths made 6,001 series. Past the cap, the least
    recently used pair's series go."""
    from prometheus_client import CollectorRegistry, Counter

    from supervisor.metrics import LabelPairs

    registry = CollectorRegistry()
    errors = Counter("errors", "test", ("model", "adapter", "code"), registry=registry)
    pairs = LabelPairs(cap=3)
    for i in range(3):
        pairs.use(errors, ("m", f"a{i}"), "x").inc()
    pairs.use(errors, ("m", "a0"), "y").inc()  # a0 used again: a1 is the oldest now
    pairs.use(errors, ("m", "a3"), "x").inc()
    left = {(s.labels["adapter"], s.labels["code"]) for metric in registry.collect() for s in metric.samples if s.name == "errors_total"}
    assert left == {("a0", "x"), ("a0", "y"), ("a2", "x"), ("a3", "x")} and len(pairs) == 3
