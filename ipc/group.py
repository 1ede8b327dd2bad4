"""A model over several processes (docs/scaling.md): the host list the pool hands
its worker (`--hosts`, JSON), and the backends and splits it can run.
"""

from __future__ import annotations

import msgspec

# The distributed backends the pool launches as `mlx.launch` does (mpi is
# launched by mpirun, so not by the pool).
BACKENDS = ("ring", "jaccl", "jaccl-ring", "nccl")
# mlx-lm's two ways of splitting a model.
PARALLEL = ("pipeline", "tensor")


class HostSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One rank's host: `ssh` is what ssh connects to (an IP address works
    too), `ip` the address the other ranks reach it at (default: `ssh`
    resolved), `rdma` its RDMA device to each rank (JACCL only; null for
    itself), as in mlx.launch's hostfile."""

    ssh: str
    ip: str | None = None
    rdma: list[str | list[str] | None] | None = None


def encode_hosts(hosts: list[HostSpec]) -> str:
    return msgspec.json.encode(hosts).decode()


def decode_hosts(text: str) -> list[HostSpec]:
    """Raises ValueError with a message fit for a person."""
    try:
        return msgspec.json.decode(text, type=list[HostSpec])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a JSON list of hosts: {exc}") from None
