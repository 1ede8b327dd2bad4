"""One model over several processes, as each rank runs it (docs/scaling.md).

Every rank of the group loads its share of the model (mlx-lm's pipeline or
tensor split), runs the same Scheduler and makes the same model calls in the
same order with the same shapes: MLX's collectives (the pipeline's send,
recv and all_gather, the tensor split's all_sum) pair up only then. Rank 0
decides each step's inputs, the messages it took from its inbox, and hands
them to the other ranks through the group before the step (StepChannel);
seeds it draws for unseeded requests travel with them. Every rank ends a
step with the same logits (the pipeline all_gathers rank 0's hidden state;
all_sum hands every rank identical bytes), so every rank samples the same
tokens and its scheduler takes the same decisions.

What a rank measures about itself (cache bytes per row, free memory, which
cache kinds its layers have, a prefix snapshot's bytes) differs between
ranks, so where a decision depends on it the ranks agree first
(GroupScheduler, GroupPrefixCache). A step that fails on a rank may leave
the ranks disagreeing about what comes next, so it ends the whole group
(exit 75), and the pool restarts it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import gather_last_axis

from ipc.worker_events import FATAL_PREFIX
from worker.cache.prefix_cache import PrefixCache
from worker.engine.scheduler import Scheduler
from worker.group.plan import CONTENT_PREFIX, EX_TEMPFAIL, GroupError, GroupPlan, write_content_files

log = logging.getLogger("worker")


def abort(cause: str, code: int = EX_TEMPFAIL) -> None:
    """Ends this rank at once, from any thread, its cause the last line on
    stderr (the pool quotes it); the other ranks follow (worker.group.launch)."""
    # Another thread may be logging the same failure (a step's traceback
    # while a rank's reader ends the process): with the handlers' locks
    # held, no record can land after the cause before the exit.
    for handler in logging.getLogger().handlers:
        handler.acquire()
    print(FATAL_PREFIX + " ".join(cause.split()), file=sys.stderr, flush=True)
    os._exit(code)


# -- splitting the model ---------------------------------------------------------


def splits(model: nn.Module) -> list[str]:
    """How mlx-lm can split this model, the way sharded_load tells."""
    found = []
    if hasattr(model, "model") and hasattr(model.model, "pipeline"):
        found.append("pipeline")
    if hasattr(model, "shard"):
        found.append("tensor")
    return found


def choose_split(model: nn.Module, model_type: str, wanted: str | None, ranks: int) -> str:
    """The split to use: `wanted`, or pipeline where mlx-lm has it (one
    hand-over per forward, where the tensor split has two all_sums per
    layer, which costs more over Ethernet or Thunderbolt), else tensor."""
    can = splits(model)
    if not can:
        raise GroupError(f"mlx-lm cannot split model_type {model_type!r} over processes (it has neither a pipeline nor a tensor split)")
    if wanted is not None and wanted not in can:
        raise GroupError(f"mlx-lm cannot split model_type {model_type!r} by {wanted} (it can by {' or '.join(can)})")
    choice = wanted or can[0]
    if choice == "pipeline":
        layers = len(model.model.layers)
        if layers < ranks:
            raise GroupError(f"a pipeline of {ranks} ranks needs at least {ranks} layers; model_type {model_type!r} has {layers}")
    return choice


def split(model: nn.Module, how: str, group: mx.distributed.Group, vocab: bool = True) -> None:
    """Keeps this rank's share of the (still lazy) model: its layers of the
    pipeline, or its slices of every layer; with `vocab`, its rows of the
    embedding and LM head too."""
    try:
        if how == "pipeline":
            model.model.pipeline(group)
        else:
            model.shard(group)
    except (AssertionError, ValueError) as exc:
        raise GroupError(f"mlx-lm cannot split this model by {how} over {group.size()} ranks: {exc}") from None
    if vocab:
        split_vocab(model, how, group)
    else:
        log.info("the embedding and LM head stay whole on every rank (--whole-vocab)")


def split_vocab(model: nn.Module, how: str, group: mx.distributed.Group) -> None:
    """Gives each rank 1/N of the token embedding and of the LM head, where
    mlx-lm keeps them whole on every rank: on a large vocabulary they are a
    good part of the weights (a third of the 0.8b shape's), so without this
    a rank of two holds two thirds of the model, not half."""
    lm = next((m for m in (model, getattr(model, "language_model", None)) if m is not None and hasattr(getattr(m, "model", None), "embed_tokens")), None)
    if lm is None:
        return
    # In a pipeline only the first stage (the last rank) uses the embedding;
    # the others must still take part in its all_sum, at the same point.
    eager = how == "pipeline" and group.rank() != group.size() - 1
    lm.model.embed_tokens = VocabSlice(lm.model.embed_tokens, group, eager)
    head = getattr(lm, "lm_head", None)
    if head is not None and getattr(lm, "sharding_group", None) is None:
        lm.lm_head = VocabSlice(head, group, eager=False)


class VocabSlice(nn.Module):
    """This rank's rows of a vocabulary-sized table: an embedding (looked up
    here for the tokens in this rank's rows, then summed over the group,
    which adds only zeros to each row, so it is exact) or an LM head, tied
    or not (each rank computes its slice of the logits, then every rank
    gathers them all)."""

    def __init__(self, table: nn.Module, group: mx.distributed.Group, eager: bool):
        super().__init__()
        vocab = table.weight.shape[0]
        self.rows = -(-vocab // group.size())
        self.lo = group.rank() * self.rows
        self.vocab = vocab
        self.group = group
        self.eager = eager
        # Decided once: the table is looked up, or applied as an LM head.
        self.embedding = isinstance(table, nn.Embedding | nn.QuantizedEmbedding)
        for key, value in table.items():
            if isinstance(value, mx.array):
                table[key] = _rows(value, self.lo, self.rows)
        self.table = table

    def __call__(self, x: mx.array) -> mx.array:
        if self.embedding:
            return self._lookup(x)
        return self._logits(self.table(x))

    def as_linear(self, x: mx.array) -> mx.array:
        return self._logits(self.table.as_linear(x))

    def _lookup(self, ids: mx.array) -> mx.array:
        inside = (ids >= self.lo) & (ids < self.lo + self.rows)
        local = self.table(mx.where(inside, ids - self.lo, 0))
        out = mx.distributed.all_sum(mx.where(inside[..., None], local, mx.zeros_like(local)), group=self.group)
        if self.eager:
            # Nothing on this rank reads the result (a later stage takes its
            # input from the previous one), so left lazy it would never run
            # and the first stage would wait in it for ever.
            mx.eval(out)
        return out

    def _logits(self, local: mx.array) -> mx.array:
        return gather_last_axis(local, self.group)[..., : self.vocab]


def _rows(a: mx.array, lo: int, rows: int) -> mx.array:
    """Rows lo..lo+rows of a (zeros past its end), in an array of their own:
    a slice alone would keep the whole table in memory."""
    part = a[lo : lo + rows]
    short = rows - part.shape[0]
    if short:
        return mx.concatenate([part, mx.zeros((short, *a.shape[1:]), dtype=a.dtype)])
    return mx.contiguous(part)


# -- joining ---------------------------------------------------------------------


def join(plan: GroupPlan, rank: int, rendezvous: Callable[[], None]) -> mx.distributed.Group:
    """This rank joins the group: its environment (set by worker.group.launch,
    as mlx.launch would) names the backend's peers. Blocks until every rank
    has joined.

    MLX's init holds the GIL while it waits for its peers, so no other
    thread of this process runs meanwhile (heartbeats, the watch on the
    other ranks). So the wait happens before it, in `rendezvous`: rank 0
    waits there until every other rank is about to join (or one died:
    worker.group.launch), the others say they are; and each rank first checks
    that its port is free, the one failure it could not report from inside
    init."""
    with tempfile.TemporaryDirectory(prefix="lattice-group-") as files:
        # MLX reads its hostfile during init only.
        os.environ.update(write_content_files(dict(os.environ), files))
        _check_port(plan, rank)
        rendezvous()
        try:
            group = mx.distributed.init(strict=True, backend=plan.backend)
        except RuntimeError as exc:
            raise GroupError(f"{plan.describe(rank)} cannot join the {plan.backend} group: {exc}") from None
    if group.size() != plan.ranks or group.rank() != rank:
        raise GroupError(f"MLX formed a group of {group.size()} with this process as rank {group.rank()}; expected {plan.ranks} and rank {rank}")
    return group


def _check_port(plan: GroupPlan, rank: int) -> None:
    """Binds this rank's ring address for a moment, as MLX is about to."""
    addresses = _ring_addresses()
    if plan.backend != "ring" or addresses is None:
        return
    ip, port = addresses[rank]
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as exc:
            # A port the pool picked itself may have been taken since: the
            # next start picks others. A configured one stays taken.
            ports = [p for _, p in addresses]
            raise GroupError(
                f"{plan.describe(rank, ports)}: the port is in use ({exc.strerror}); set another `port` for this model", retry=plan.port is None
            ) from None


def _ring_addresses() -> list[tuple[str, int]] | None:
    """Each rank's (ip, port) in the ring hostfile the launcher handed out."""
    try:
        hostfile = json.loads(os.environ.get(CONTENT_PREFIX + "MLX_HOSTFILE", ""))
        return [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a, *_ in hostfile]
    except (ValueError, TypeError):
        return None


# -- what every rank must agree on ---------------------------------------------------


def gather(group: mx.distributed.Group, values: list[int]) -> list[list[int]]:
    """Every rank's `values`, in rank order (a collective: every rank calls
    it at the same point)."""
    mine = mx.array([values], dtype=mx.int64)
    return np.array(mx.distributed.all_gather(mine, group=group)).tolist()


class StepChannel:
    """Rank 0's bytes to every rank, through the group's own collectives:
    an all_sum of the length, then of the bytes (zeros from the others).
    On the default stream, like the model's collectives, so the two keep
    one order on every rank."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def share(self, data: bytes) -> None:
        self._exchange(data)

    def receive(self) -> bytes:
        return self._exchange(b"")

    def _exchange(self, data: bytes) -> bytes:
        n = int(mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=self.group).item())
        if n == 0:
            return b""
        mine = mx.array(np.frombuffer(data, dtype=np.uint8)) if data else mx.zeros((n,), dtype=mx.uint8)
        return np.array(mx.distributed.all_sum(mine, group=self.group)).tobytes()


class GroupPrefixCache(PrefixCache):
    """A prefix cache whose decisions are the same on every rank: the cache
    kinds of all ranks' layers decide how snapshots are taken, and a
    snapshot counts as the largest rank's share against the budget."""

    def __init__(self, group: mx.distributed.Group, model, budget_bytes: int):
        super().__init__(model, budget_bytes)
        self.group = group
        kinds = gather(group, [int(self.trimmable), int(self.supported)])
        self.trimmable = all(k[0] for k in kinds)
        self.supported = all(k[1] for k in kinds)

    def _counted(self, nbytes: int) -> int:
        return max(r[0] for r in gather(self.group, [nbytes]))


class GroupScheduler(Scheduler):
    """The Scheduler of one rank of a group: its admission reads figures
    every rank agrees on (the largest rank's cache bytes per row, the
    smallest rank's memory and batch), and a failed step ends the group."""

    # A rank's LM head computes its slice of the logits, which the model's
    # forward gathers (and a pipeline stage's body is not the whole model).
    fold_last_token = False

    def __init__(self, group: mx.distributed.Group, *args, broken: Callable[[str], None] = abort, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group
        self.broken = broken
        ranks = gather(group, [self.row_fixed_bytes, self.row_token_bytes, self.batch_memory, self.max_batch])
        self.row_fixed_bytes = max(r[0] for r in ranks)
        self.row_token_bytes = max(r[1] for r in ranks)
        self.batch_memory = min(r[2] for r in ranks)
        self.max_batch = min(r[3] for r in ranks)
        self.prefix_cache = GroupPrefixCache(group, self.loaded.model, self.prefix_cache.budget)
        self.generator = self._generator(self.prefix_cache)
        self.figures = self._figures()

    def step(self) -> None:
        try:
            self._step()
        except Exception as exc:
            log.exception("a step failed on this rank")
            self.broken(f"a step failed on rank {self.group.rank()} ({type(exc).__name__}: {exc}); the group restarts")
        self._flush()

    def _fail(self, row, exc: BaseException) -> None:
        self.broken(f"request {row.rid} failed on rank {self.group.rank()} ({type(exc).__name__}: {exc}); the group restarts")
