"""One model over several processes (docs/scaling.md): a `[[models]]`
entry with `ranks = 2` runs as one MLX distributed group (ring backend over
127.0.0.1) behind one worker slot. Real pools, real ranks, the tiny demo
model; a copy of it runs as a single process beside, for the reference
text."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket

import psutil
import pytest

from harness.cli import cli, ps_table
from harness.metrics import metrics_port, scrape
from harness.pool import PoolProc
from harness.procs import pid_alive, wait_for
from harness.prompts import MIXED, PROMPTS
from tests.conftest import GREEDY_MARGIN, keep_alive_across_tests, margins_of, release

TOKENS = 12
_ids = itertools.count(1)


def group_config(path, name: str = "two", ranks: int = 2, **keys) -> str:
    lines = [f'[[models]]\nname = "{name}"\npath = "{path}"\nranks = {ranks}']
    for key, value in keys.items():
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def pool(tiny_model, tiny_q4_model, tmp_path_factory):
    """`two`: the tiny model over 2 ranks (pipeline), `tensor`: the same by
    tensor parallelism, `one`: a copy of it in one process; `three`: the
    4-bit tiny model over 3 ranks (a middle stage, and a vocabulary that
    does not split evenly), `one-q4`: a copy of it in one process. No
    prefix cache, so a prompt computes the same way every time."""
    root = tmp_path_factory.mktemp("ranks")
    single = shutil.copytree(tiny_model, root / "tiny-copy")
    tensor = shutil.copytree(tiny_model, root / "tiny-tensor")
    single_q4 = shutil.copytree(tiny_q4_model, root / "tiny-q4-copy")
    config = root / "pool.toml"
    adapters = root / "adapters"
    adapters.mkdir()
    config.write_text(
        f'prefix_cache_bytes = 0\nadapter_dirs = ["{adapters}"]\n'
        + group_config(tiny_model, preload="true")
        + group_config(tensor, "tensor", parallel='"tensor"', preload="true")
        + group_config(tiny_q4_model, "three", ranks=3, preload="true")
        + f'[[models]]\nname = "one"\npath = "{single}"\npreload = true\n'
        + f'[[models]]\nname = "one-q4"\npath = "{single_q4}"\npreload = true\n'
    )
    p = PoolProc("--config", str(config), "--metrics-port", "0", "--control-socket", str(root / "ctl.sock"))
    p.socket = root / "ctl.sock"
    keep_alive_across_tests(p.proc.pid)
    try:
        for name in ("two", "tensor", "three", "one", "one-q4"):
            p.wait_ev("ready", model=name)
        yield p
    finally:
        release(p.proc.pid)
        assert p.close() == 0


def request(model: str, **kw) -> dict:
    return {"id": f"r{next(_ids)}", "model": model, "prompt": PROMPTS[0], "temperature": 0.0, "max_tokens": TOKENS, **kw}


def texts(pool: PoolProc, reqs: list[dict]) -> list[str]:
    """Sends the requests in one write (they decode together) and returns
    their texts; each must end with a done line."""
    pool.send(b"".join(PoolProc.line(r) for r in reqs))
    pool.sent_ids += [r["id"] for r in reqs]
    for r in reqs:
        assert pool.terminal(r["id"])["ev"] == "gen_token", pool.of(r["id"])[-1]
    return [pool.text(r["id"]) for r in reqs]


def status_row(pool: PoolProc, model: str) -> dict:
    pool.send({"op": "status"})
    return next(row for row in pool.wait_ev("status")["models"] if row["model"] == model)


def rank_pids(pool: PoolProc, model: str) -> list[int]:
    """Every rank's pid once each has reported."""

    def reported():
        row = status_row(pool, model)
        ranks = row["ranks"] or []
        return [r["pid"] for r in ranks] if len(ranks) == 2 and all(r["pid"] and r["weights_bytes"] for r in ranks) else None

    return wait_for(reported, 60, interval=0.5, message=f"both ranks of {model} to report")


def test_two_ranks_give_the_single_process_text_greedy_and_seeded(pool, greedy_margins, tiny_q4_model):
    # Meaningful only where no step's best logit is within float noise of
    # the runner-up (the tensor split sums its slices in another order,
    # and each rank computes its slice of the logits).
    assert min(greedy_margins(PROMPTS[:3], TOKENS)) > GREEDY_MARGIN
    assert min(margins_of(tiny_q4_model)(PROMPTS[:3], TOKENS)) > GREEDY_MARGIN
    greedy = [dict(prompt=p) for p in PROMPTS[:3]]
    one = texts(pool, [request("one", **g) for g in greedy])
    assert texts(pool, [request("two", **g) for g in greedy]) == one
    assert texts(pool, [request("tensor", **g) for g in greedy]) == one
    one_q4 = texts(pool, [request("one-q4", **g) for g in greedy])
    assert texts(pool, [request("three", **g) for g in greedy]) == one_q4
    # The pipeline hands every rank rank 0's hidden state: the logits are
    # the single process's, so a seed draws its tokens too.
    seeded = [request("one", **MIXED[1]), request("one", **MIXED[3])]
    assert texts(pool, [{**r, "model": "two", "id": f"r{next(_ids)}"} for r in seeded]) == texts(pool, seeded)
    tensor = [{**r, "model": "tensor", "id": f"r{next(_ids)}"} for r in seeded]
    assert texts(pool, tensor) == texts(pool, [{**r, "id": f"r{next(_ids)}"} for r in tensor])


def test_batched_requests_with_and_without_seeds_run_across_ranks(pool):
    # Unseeded rows sample with the seed rank 0 drew for them: had the
    # ranks drawn their own, their tokens, and so their steps, would part.
    reqs = [request("two", prompt=PROMPTS[i % 3], **MIXED[i % len(MIXED)]) for i in range(5)]
    reqs += [request("two", prompt=PROMPTS[3], temperature=0.8, max_tokens=20), request("two", prompt=PROMPTS[4], temperature=1.0)]
    assert all(texts(pool, reqs))
    pool.send({"id": "cancelled", "model": "two", "prompt": PROMPTS[0], "max_tokens": 4000})
    pool.sent_ids.append("cancelled")
    pool.wait_for(lambda e: e.get("id") == "cancelled")
    pool.send({"op": "cancel", "id": "cancelled"})
    assert pool.terminal("cancelled")["finish_reason"] == "cancelled"
    assert texts(pool, [request("two", max_tokens=3)])  # and the group goes on


def test_a_request_naming_an_adapter_is_refused_and_the_group_goes_on(pool):
    # An adapter's layers would have to be split with the model's.
    lora = pool.socket.parent / "adapters" / "style.safetensors"
    lora.write_bytes(b"not read")
    req = request("two", lora=str(lora))
    pool.send(req)
    pool.sent_ids.append(req["id"])
    end = pool.terminal(req["id"])
    assert end["ev"] == "error" and end["code"] == "adapter_error", end
    assert "takes no LoRA adapters" in end["msg"]
    # The name it made shows adapter_error (ps, status) until it is unloaded.
    pool.send({"op": "unload", "model": "two", "lora": str(lora)})
    pool.wait_for(lambda e: e["ev"] == "unloaded" and e["model"] == "two" and e.get("lora") == str(lora))
    assert texts(pool, [request("two", max_tokens=3)])


def test_status_reports_every_rank_and_the_sums(pool):
    pids = rank_pids(pool, "two")
    row = status_row(pool, "two")
    ranks = row["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] == row["pid"] == pids[0]
    assert all(r["host"] == "127.0.0.1" for r in ranks)
    # Rank 1 is rank 0's child, in its process group (the pool's kill of
    # the worker's group reaches it).
    child = psutil.Process(pids[1])
    assert child.ppid() == pids[0] and os.getpgid(pids[1]) == os.getpgid(pids[0])
    for field in ("rss_bytes", "uss_bytes", "mlx_active_bytes", "weights_bytes"):
        assert row[field] == sum(r[field] for r in ranks) and all(r[field] > 0 for r in ranks), field
    # Each rank holds only its layers and its half of the embedding (tied
    # to the LM head): about half of the model.
    one = status_row(pool, "one")
    assert max(r["weights_bytes"] for r in ranks) < 0.6 * one["weights_bytes"]
    assert one["ranks"] is None

    samples = scrape(metrics_port(pool))
    for r in ranks:
        labels = {"model": "two", "rank": str(r["rank"]), "host": "127.0.0.1", "pid": str(r["pid"])}
        assert samples[("lattice_rank_weights_bytes", tuple(sorted(labels.items())))] == r["weights_bytes"]
        assert samples[("lattice_rank_rss_bytes", tuple(sorted(labels.items())))] > 0
    assert samples[("lattice_worker_weights_bytes", (("model", "two"), ("pid", str(row["pid"]))))] == row["weights_bytes"]

    shown = cli("ps", "--control-socket", str(pool.socket))
    assert shown.returncode == 0, shown.stderr
    table = ps_table(shown.stdout)
    assert table["two"]["PID"] == str(pids[0]) and table["two"]["STATE"] == "ready"
    assert table["two"]["PROCESSOR"] == table["one"]["PROCESSOR"] != "-"
    for r in ranks:
        line = table[f"rank {r['rank']} 127.0.0.1"]
        assert line["PID"] == str(r["pid"]) and re.fullmatch(r"[\d.]+ MB", line["MEMORY"])
    assert "rank 0 127.0.0.1" in shown.stdout.decode().split("two", 1)[1]  # under its model


def lose_rank_1(pool: PoolProc, pids: list[int], sig: int) -> dict:
    """Sends `sig` to rank 1 while a request streams; returns that request's
    one terminal event once the group is back."""
    rid = f"r{next(_ids)}"
    pool.send(request("two", id=rid, max_tokens=4000))
    pool.wait_for(lambda e: e.get("id") == rid)
    os.kill(pids[1], sig)
    end = pool.terminal(rid)
    assert end["ev"] == "error" and end["code"] == "worker_crashed", end
    assert "exit code 75" in pool.wait_ev("restarting", model="two")["reason"]
    pool.wait_ev("ready", model="two")
    assert texts(pool, [request("two", max_tokens=3)])
    return end


def test_a_killed_or_stalled_rank_restarts_the_group_and_unload_stops_every_rank(spawn_pool, tiny_model, tmp_path):
    config = tmp_path / "pool.toml"
    # stall_timeout also bounds a rank's start (its imports take seconds on
    # two busy cores), so it is not made shorter than this.
    config.write_text("stall_timeout = 8\nheartbeat_interval = 0.5\n" + group_config(tiny_model, preload="true"))
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="two")
    first = rank_pids(pool, "two")
    assert "rank 1 on 127.0.0.1" in lose_rank_1(pool, first, signal.SIGKILL)["msg"]
    second = rank_pids(pool, "two")
    assert not set(first) & set(second) and not any(pid_alive(p) for p in first)
    # A stopped rank is alive but silent, and rank 0 waits for it in vain.
    end = lose_rank_1(pool, second, signal.SIGSTOP)
    assert "has been silent" in end["msg"] or "waited" in end["msg"], end
    third = rank_pids(pool, "two")
    assert not any(pid_alive(p) for p in second)
    pool.send({"op": "unload", "model": "two"})
    pool.wait_ev("unloaded", model="two")
    wait_for(lambda: not any(pid_alive(p) for p in third), 10, message="every rank to exit")
    assert pool.close() == 0


def test_every_rank_hands_its_buffer_cache_back_after_the_idle_release(spawn_pool, tiny_model, tmp_path):
    """The other ranks wait on the group while rank 0 is idle; rank 0 tells
    them when the idle release comes."""
    config = tmp_path / "pool.toml"
    config.write_text('idle_release = "2s"\nheartbeat_interval = 0.5\nprefix_cache_bytes = 0\n' + group_config(tiny_model, preload="true"))
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="two")
    rank_pids(pool, "two")

    def caches() -> list[int]:
        return [r["mlx_cache_bytes"] for r in status_row(pool, "two")["ranks"]]

    # Each rank's figures come with its heartbeat: wait for ones sent while
    # the buffers of the requests below were still held.
    long = "<|im_start|>user\n" + "Tell me about the river. " * 120 + "<|im_end|>\n<|im_start|>assistant\n"
    assert texts(pool, [request("two", prompt=long, max_tokens=40) for _ in range(4)])

    def holding() -> list[int] | None:
        now = caches()
        return now if all(now) else None

    held = wait_for(holding, 10, interval=0.2, message="both ranks to report a buffer cache")
    wait_for(lambda: all(c < h / 100 for c, h in zip(caches(), held)), 30, interval=0.3, message=f"every rank's buffer cache handed back ({held})")
    assert texts(pool, [request("two", max_tokens=3)])
    assert pool.close() == 0


def test_a_sigkilled_supervisor_leaves_no_rank_behind(spawn_pool, tiny_model, tmp_path):
    config = tmp_path / "pool.toml"
    # With the vocabulary kept whole on every rank (the other tests split it).
    config.write_text(group_config(tiny_model, preload="true", split_vocab="false"))
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="two")
    assert pool.stderr.count(b"the embedding and LM head stay whole on every rank") == 2
    pids = rank_pids(pool, "two")
    pool.send(request("two", id="busy", max_tokens=4000))
    pool.wait_for(lambda e: e.get("id") == "busy")
    pool.wait_for(lambda e: e.get("id") == "busy" and e.get("token"))
    pool.proc.kill()
    pool.proc.wait()
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, message="every rank to exit")


def this_machines_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def taken_after_a_free_port() -> tuple[socket.socket, int]:
    """A socket bound to a port whose port below is free (rank 0's, rank 1's
    taken). Below the systems' ephemeral ranges (from 32768 on Linux, 49152
    on macOS): a port the kernel picked for another socket, as the test's
    neighbours on the machine open them, could take rank 0's port too
    while the pool starts."""
    start = 20000 + (os.getpid() % 500) * 20
    for port in range(start, start + 2000):
        taken, below = socket.socket(), socket.socket()
        try:
            taken.bind(("127.0.0.1", port))
            below.bind(("127.0.0.1", port - 1))
        except OSError:
            taken.close()
            continue
        finally:
            below.close()
        return taken, port
    raise AssertionError(f"no free pair of ports from {start - 1}")


def test_groups_that_cannot_start_fail_with_their_cause_and_are_not_retried(spawn_pool, tiny_model, dense_model, tmp_path):
    taken, port = taken_after_a_free_port()

    def copy(name):  # the pool keeps one worker per model dir
        return shutil.copytree(tiny_model, tmp_path / name)

    models = {
        # A name that does not resolve: refused before any rank starts.
        "nohost": (copy("nohost"), {"hosts": '["127.0.0.1", "no-such-host.invalid"]'}),
        # qwen3 has a tensor split in mlx-lm, but no pipeline.
        "nosplit": (dense_model, {"parallel": '"pipeline"'}),
        # Rank 1's port (the one after rank 0's) is taken.
        "porttaken": (copy("porttaken"), {"port": port - 1}),
    }
    here = this_machines_address()
    if here is not None and shutil.which("ssh"):
        # Reached over ssh, which cannot resolve the name: ssh's own error.
        models["nossh"] = (copy("nossh"), {"hosts": f'["{here}", {{ssh = "no-such-host.invalid", ip = "198.51.100.1"}}]'})
    config = tmp_path / "pool.toml"
    config.write_text("".join(group_config(path, name, **keys) for name, (path, keys) in models.items()))
    pool = spawn_pool("--config", str(config))
    try:
        for name in models:
            pool.send(request(name, id=name))
        ends = {name: pool.terminal(name, timeout=180) for name in models}
    finally:
        taken.close()
    failed = {name: pool.wait_ev("failed", model=name)["reason"] for name in models}
    assert all(end["code"] == "load_failed" for end in ends.values()), ends
    assert "cannot resolve host 'no-such-host.invalid'" in failed["nohost"]
    assert "cannot split model_type 'qwen3' by pipeline (it can by tensor)" in failed["nosplit"]
    assert f"rank 1 on 127.0.0.1, port {port}: the port is in use" in failed["porttaken"]
    assert failed["porttaken"].count("rank 1 on") == 1, failed["porttaken"]
    if "nossh" in failed:
        assert "cannot reach no-such-host.invalid over ssh for rank 1" in failed["nossh"]
        assert "Could not resolve hostname" in failed["nossh"]
    for reason in failed.values():
        assert "exit code 78" in reason and "\n" not in reason
    assert not [e for e in pool.events if e["ev"] == "restarting"]
    assert pool.close() == 0
