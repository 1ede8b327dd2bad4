"""Where the ranks of a group run and how MLX finds them: the hosts, their
addresses and ports, and the environment each rank starts with, as
`mlx.launch` sets it (mlx/_distributed_utils/launch.py). Pure: no MLX here.

Rank 0 is the worker the pool started; it runs on this machine. A host is
local when its address is one of this machine's (loopback included): its
rank is started directly; any other host is reached over ssh, as
`mlx.launch` does. The ring backend connects to IP addresses, so a host
given by name is resolved here, once, at the group's start.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass

from ipc.group import BACKENDS, HostSpec, decode_hosts

# sysexits.h's EX_TEMPFAIL: the group broke (a rank died, stalled, failed a
# step, or a port picked at random was taken); restarting the group can help.
EX_TEMPFAIL = 75
# mlx.launch's default first port for the ring backend.
DEFAULT_PORT = 32323
# mlx.launch's NCCL default port.
DEFAULT_NCCL_PORT = 12345
# Variables whose value MLX reads as a file path: the launcher passes the
# file's content in LATTICE_CONTENT_<NAME>, and each rank writes its own file
# (on its own host) right before it joins (worker.group.model.join).
FILE_VARS = ("MLX_HOSTFILE", "MLX_IBV_DEVICES")
CONTENT_PREFIX = "LATTICE_CONTENT_"


class GroupError(Exception):
    """The group cannot start as configured; `retry`: it may once the cause
    passes (a port picked at random turned out taken), so the worker exits
    for a restart instead of with EX_CONFIG."""

    def __init__(self, msg: str, retry: bool = False):
        super().__init__(msg)
        self.retry = retry


@dataclass(frozen=True)
class Host:
    ssh: str
    ip: str
    local: bool
    rdma: tuple = ()

    @property
    def name(self) -> str:
        """How status and logs name it: as configured."""
        return self.ssh


def local_addresses() -> set[str]:
    import psutil

    found = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        found.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return found


def _resolve(name: str) -> str:
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    # user@host is ssh's syntax; the address is the host's.
    host = name.rsplit("@", 1)[-1]
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise GroupError(f"cannot resolve host {name!r}: {exc}") from None
    return infos[0][4][0]


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def resolve_hosts(specs: list[HostSpec], ranks: int, mine: set[str] | None = None) -> list[Host]:
    """The configured hosts (default: this machine for every rank), each
    with its address and whether it is this machine."""
    if not specs:
        specs = [HostSpec("127.0.0.1")] * ranks
    if len(specs) != ranks:
        raise GroupError(f"{len(specs)} hosts for {ranks} ranks: give one host per rank")
    mine = local_addresses() if mine is None else mine
    hosts = []
    for spec in specs:
        ip = spec.ip if spec.ip is not None else _resolve(spec.ssh)
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise GroupError(f"host {spec.ssh!r}: ip {ip!r} is not an IP address") from None
        local = _is_loopback(ip) or ip in mine
        hosts.append(Host(spec.ssh, ip, local, tuple(spec.rdma or ())))
    if not hosts[0].local:
        raise GroupError(f"rank 0 runs on this machine, but the first host is {hosts[0].ssh!r} ({hosts[0].ip}), not one of its addresses")
    remote = [h for h in hosts if not h.local]
    if remote:
        looped = [r for r, h in enumerate(hosts) if _is_loopback(h.ip)]
        if looped:
            raise GroupError(
                f"rank {looped[0]} listens on {hosts[looped[0]].ip}, which {remote[0].ssh!r} cannot reach: "
                "give this machine's Ethernet or Thunderbolt address instead"
            )
    return hosts


def free_ports(n: int) -> list[int]:
    """n ports no socket of this machine listens on now (held open together,
    so they differ); the group binds them a moment later."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class GroupPlan:
    hosts: list[Host]
    backend: str
    parallel: str | None
    port: int | None  # the first port as configured; None: chosen here

    @property
    def ranks(self) -> int:
        return len(self.hosts)

    def ports(self) -> list[int]:
        """Each rank's port: consecutive from `port` (mlx.launch's rule), or
        free ones when every rank is local and none was configured."""
        if self.port is None and all(h.local for h in self.hosts):
            return free_ports(self.ranks)
        first = DEFAULT_PORT if self.port is None else self.port
        return [first + r for r in range(self.ranks)]

    def shared_env(self, ports: list[int]) -> dict[str, str]:
        """The variables every rank gets, as mlx.launch sets them for the
        backend (file variables as LATTICE_CONTENT_*)."""
        if self.backend == "ring":
            hostfile = [[f"{h.ip}:{port}"] for h, port in zip(self.hosts, ports)]
            return {CONTENT_PREFIX + "MLX_HOSTFILE": json.dumps(hostfile)}
        if self.backend == "nccl":
            return {"NCCL_HOST_IP": self.hosts[0].ip, "NCCL_PORT": str(self.port or DEFAULT_NCCL_PORT), "MLX_WORLD_SIZE": str(self.ranks)}
        # jaccl, jaccl-ring: a coordinator on rank 0 and each host's RDMA devices.
        env = {"MLX_JACCL_COORDINATOR": f"{self.hosts[0].ip}:{ports[0]}", CONTENT_PREFIX + "MLX_IBV_DEVICES": json.dumps([list(h.rdma) for h in self.hosts])}
        if self.backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1"
        return env

    def rank_env(self, rank: int, shared: dict[str, str]) -> dict[str, str]:
        env = {**shared, "MLX_RANK": str(rank)}
        if self.backend == "nccl":
            # One GPU per rank on a host, as mlx.launch assigns them.
            env["CUDA_VISIBLE_DEVICES"] = str(sum(1 for h in self.hosts[:rank] if h.ssh == self.hosts[rank].ssh))
        return env

    def describe(self, rank: int, ports: list[int] | None = None) -> str:
        h = self.hosts[rank]
        where = h.ssh if h.ssh == h.ip else f"{h.ssh} ({h.ip})"
        return f"rank {rank} on {where}" + (f", port {ports[rank]}" if ports and self.backend == "ring" else "")


def plan(ranks: int, hosts_json: str | None, backend: str, parallel: str | None, port: int | None, *, resolve: bool = True) -> GroupPlan:
    """The group as configured. Rank 0 resolves the hosts (`resolve`);
    the other ranks take the addresses it gives them and name hosts only."""
    if backend not in BACKENDS:
        raise GroupError(f"backend {backend!r} cannot be launched by the pool; use one of {', '.join(BACKENDS)}")
    try:
        specs = decode_hosts(hosts_json) if hosts_json else []
    except ValueError as exc:
        raise GroupError(f"--hosts is {exc}") from None
    if resolve:
        hosts = resolve_hosts(specs, ranks)
    else:
        hosts = [Host(s.ssh, s.ip or s.ssh, False, tuple(s.rdma or ())) for s in specs] or [Host("127.0.0.1", "127.0.0.1", True)] * ranks
    if backend.startswith("jaccl") and any(len(h.rdma) != ranks for h in hosts):
        raise GroupError(f"backend {backend}: every host needs `rdma`, its device to each of the {ranks} ranks (null for itself)")
    return GroupPlan(hosts, backend, parallel, port)


def write_content_files(env: dict[str, str], directory: str) -> dict[str, str]:
    """For each LATTICE_CONTENT_<NAME> in env: the file <NAME> points at,
    written into `directory`; returns the variables to set."""
    out = {}
    for name in FILE_VARS:
        content = env.get(CONTENT_PREFIX + name)
        if content is None:
            continue
        path = os.path.join(directory, name.lower() + ".json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        out[name] = path
    return out
