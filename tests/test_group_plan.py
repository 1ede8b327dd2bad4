"""Where the ranks of a group run and the environment they start with, as
mlx.launch would set it (worker.group.plan), and the config keys that ask
for a group (docs/scaling.md). Pure: no process, no MLX."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipc.group import HostSpec
from supervisor.child import worker_command
from supervisor.config import ConfigError, load_config
from supervisor.resolve import Resolver
from worker.group.plan import CONTENT_PREFIX, GroupError, GroupPlan, Host, plan, resolve_hosts, write_content_files

MINE = {"127.0.0.1", "10.0.0.1"}


def test_the_default_is_every_rank_on_this_machine():
    hosts = resolve_hosts([], 3, MINE)
    assert hosts == [Host("127.0.0.1", "127.0.0.1", True)] * 3


def test_hosts_are_resolved_and_sorted_into_local_and_remote():
    hosts = resolve_hosts([HostSpec("10.0.0.1"), HostSpec("me@mac-b", ip="10.0.0.2"), HostSpec("10.0.0.1")], 3, MINE)
    assert [(h.ip, h.local) for h in hosts] == [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.1", True)]
    # A name is resolved here (ssh's user@ prefix aside).
    assert resolve_hosts([HostSpec("127.0.0.1"), HostSpec("me@localhost")], 2, MINE)[1] == Host("me@localhost", "127.0.0.1", True)


@pytest.mark.parametrize(
    "specs, message",
    [
        ([HostSpec("127.0.0.1")], "1 hosts for 2 ranks"),
        ([HostSpec("10.0.0.2"), HostSpec("127.0.0.1")], "rank 0 runs on this machine, but the first host is '10.0.0.2'"),
        ([HostSpec("127.0.0.1"), HostSpec("mac-b", ip="10.0.0.2")], "rank 0 listens on 127.0.0.1, which 'mac-b' cannot reach"),
        ([HostSpec("127.0.0.1"), HostSpec("no-such-host.invalid")], "cannot resolve host 'no-such-host.invalid'"),
        ([HostSpec("127.0.0.1"), HostSpec("mac-b", ip="mac-b.local")], "ip 'mac-b.local' is not an IP address"),
    ],
)
def test_hosts_that_cannot_work_are_refused_with_the_reason(specs, message):
    with pytest.raises(GroupError, match=message):
        resolve_hosts(specs, 2, MINE)


def remote_plan(port=None, backend="ring") -> GroupPlan:
    hosts = [Host("10.0.0.1", "10.0.0.1", True), Host("mac-b", "10.0.0.2", False), Host("mac-b", "10.0.0.2", False)]
    return GroupPlan(hosts, backend, None, port)


def test_ports_follow_mlx_launch_or_are_free_ones_for_a_local_group():
    assert remote_plan().ports() == [32323, 32324, 32325]
    assert remote_plan(port=40000).ports() == [40000, 40001, 40002]
    local = GroupPlan([Host("127.0.0.1", "127.0.0.1", True)] * 3, "ring", None, None).ports()
    assert len(set(local)) == 3 and all(p > 0 for p in local)


def test_the_ring_environment_is_mlx_launchs_hostfile_and_rank():
    p = remote_plan()
    env = p.rank_env(2, p.shared_env(p.ports()))
    assert env["MLX_RANK"] == "2"
    assert json.loads(env[CONTENT_PREFIX + "MLX_HOSTFILE"]) == [["10.0.0.1:32323"], ["10.0.0.2:32324"], ["10.0.0.2:32325"]]


def test_nccl_and_jaccl_get_the_variables_mlx_launch_sets(tmp_path):
    p = remote_plan(backend="nccl")
    shared = p.shared_env(p.ports())
    assert shared == {"NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "12345", "MLX_WORLD_SIZE": "3"}
    # One GPU per rank on a host: mac-b's two ranks get devices 0 and 1.
    assert [p.rank_env(r, shared)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["0", "0", "1"]
    rdma = [None, "rdma_en2", "rdma_en3"]
    j = GroupPlan([Host(h.ssh, h.ip, h.local, tuple(rdma)) for h in remote_plan().hosts], "jaccl-ring", None, None)
    env = j.rank_env(1, j.shared_env(j.ports()))
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:32323" and env["MLX_JACCL_RING"] == "1"
    files = write_content_files(env, str(tmp_path))
    assert json.loads(Path(files["MLX_IBV_DEVICES"]).read_text()) == [rdma] * 3


def test_the_worker_flags_are_checked_before_anything_starts():
    with pytest.raises(GroupError, match="backend 'mpi' cannot be launched"):
        plan(2, None, "mpi", None, None)
    with pytest.raises(GroupError, match="not a JSON list of hosts"):
        plan(2, '{"ssh": "x"}', "ring", None, None)
    with pytest.raises(GroupError, match="every host needs `rdma`"):
        plan(2, None, "jaccl", None, None)
    # Ranks other than 0 take the addresses rank 0 hands out as they are.
    follower = plan(2, '[{"ssh": "10.9.9.9"}, {"ssh": "mac-b", "ip": "10.0.0.2"}]', "ring", None, None, resolve=False)
    assert [h.name for h in follower.hosts] == ["10.9.9.9", "mac-b"]


def write(tmp_path, body: str) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(body)
    return path


MODEL = '[[models]]\nname = "big"\npath = "/models/big"\n'


@pytest.mark.parametrize(
    "keys, message",
    [
        ('ranks = 2\nhosts = ["127.0.0.1"]', "1 hosts for ranks = 2"),
        ('ranks = 2\nlora = "/a.safetensors"', "a model split over ranks takes no lora"),
        ('parallel = "tensor"\nport = 4000', "parallel, port set with ranks = 1"),
        ("split_vocab = false", "split_vocab set with ranks = 1"),
        ('ranks = 2\nbackend = "mpi"', "backend"),
        ('ranks = 2\nparallel = "data"', "parallel"),
        ("ranks = 0", "ranks"),
    ],
)
def test_config_keys_of_a_group_are_checked(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, MODEL + keys + "\n"))


def test_a_group_entry_becomes_the_workers_flags(tmp_path):
    config = load_config(
        write(
            tmp_path, MODEL + 'ranks = 2\nhosts = ["10.0.0.1", {ssh = "me@mac-b", ip = "10.0.0.2"}]\nparallel = "pipeline"\nport = 40000\nsplit_vocab = false\n'
        )
    )
    argv, _ = worker_command(Resolver(config).resolve("big"), config, None)
    tail = argv[argv.index("--ranks") :]
    assert tail == [
        "--ranks", "2", "--backend", "ring", "--rank-timeout", "120.0",
        "--hosts", '[{"ssh":"10.0.0.1"},{"ssh":"me@mac-b","ip":"10.0.0.2"}]',
        "--parallel", "pipeline", "--port", "40000", "--whole-vocab",
    ]  # fmt: skip
    single = load_config(write(tmp_path, MODEL))
    assert "--ranks" not in worker_command(Resolver(single).resolve("big"), single, None)[0]


def test_a_ranks_stderr_is_relayed_line_by_line_and_its_cause_is_what_it_said(capfd):
    """Rank 0 relays another rank's stderr: a line the rank's death cut off
    still ends there (rank 0's own last message, which the pool quotes,
    starts a line of its own), and the cause it names for that rank is the
    rank's last line that is not a log record."""
    import io
    from types import SimpleNamespace

    from worker.group.launch import Launcher, Rank

    said = b"Traceback (most recent call last):\nValueError: no such layer\n2026-12-07 15:42:58,867 INFO worker model=two ready\n2026-12-07 15:42:59,001 INFO worker cut"
    r = Rank(rank=1, host=Host("127.0.0.1", "127.0.0.1", True), proc=SimpleNamespace(stderr=io.BytesIO(said)))
    Launcher(plan(2, None, "ring", None, None), [], 5.0)._read_stderr(r)
    assert r.stderr_done.is_set() and r.tail == "ValueError: no such layer"
    assert capfd.readouterr().err.endswith("INFO worker cut\n")
