"""The worker process of each rank of a group (docs/scaling.md).

Rank 0 is the worker the pool talks to: WorkerServer's threads and inbox,
plus, at every step, the items it took from its inbox shared with the other
ranks before it applies them: requests (each with a seed: rank 0 draws one
for a request that has none, so every rank samples alike), cancels, the
idle release of MLX's buffer cache, and the shutdown. A follower (rank >= 1)
takes exactly those items from the group instead of an inbox, so every rank
runs the same Scheduler calls; its request lines go nowhere, and its stdout
carries its `rank_stats` to rank 0 (worker.group.launch).

A model split over processes takes no LoRA adapters (their layers would be
split too): a request naming one, and every adapter message, is answered
with `adapter_error`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import threading
import time

import msgspec

from ipc.events import ADAPTER_ERROR, encode_error, encode_event
from ipc.messages import Cancel, Generate, LoadAdapter, ReloadAdapter, Shutdown, UnloadAdapter
from ipc.worker_events import MemoryFigures, RankFigures
from worker.group.launch import RANK_JOINING, RANK_STATS, Launcher
from worker.group.model import GroupScheduler, StepChannel, abort, choose_split, gather, join, split
from worker.group.plan import GroupPlan, plan
from worker.runtime.loader import LazyModel, LoadedModel
from worker.runtime.memory import memory_figures
from worker.shell.channel import EventChannel
from worker.shell.inbox import Arrived, EmbedArrived, IdleRelease, Item, Wake
from worker.shell.server import WorkerServer

log = logging.getLogger("worker")

NO_ADAPTERS = "a model split over several processes (ranks > 1) takes no LoRA adapters"
# The figures a group reports as the sum of its ranks': every memory figure.
SUMMED = MemoryFigures.__struct_fields__


# The items rank 0 shares at every step: its inbox's items but for the
# arrival times (each rank stamps its own) and the wakes (its own threads').
StepItem = Generate | Cancel | Shutdown | IdleRelease
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[StepItem]).decode


class LeaderServer(WorkerServer):
    """Rank 0."""

    def __init__(self, name: str, channel: EventChannel, group_plan: GroupPlan, argv: list[str], timeout: float):
        super().__init__(name, channel)
        self.plan = group_plan
        self.launcher = Launcher(group_plan, argv, timeout, lambda: self.step_since)
        self.steps: StepChannel | None = None
        # When the step under way began (None while waiting for work): the
        # launcher ends a group whose step waits on a stalled rank.
        self.step_since: float | None = None
        self._seeds = random.SystemRandom()

    def form(self, lazy: LazyModel, vocab: bool) -> GroupScheduler:
        """Checks that mlx-lm can split the model (before anything else
        starts: a model it cannot split fails at once), starts the other
        ranks, joins the group and keeps rank 0's share of the model."""
        how = choose_split(lazy.model, lazy.config.get("model_type", "?"), self.plan.parallel, self.plan.ranks)
        self.launcher.start()
        group = join(self.plan, 0, self.launcher.wait_joining)
        self.launcher.formed = True
        log.info("group of %d formed (%s backend, %s split)", group.size(), self.plan.backend, how)
        split(lazy.model, how, group, vocab)
        self.steps = StepChannel(group)
        return group

    def serve_forever(self) -> None:
        # From here on a rank that dies is a crash (restart), not a start
        # that cannot succeed.
        self.launcher.ready = True
        super().serve_forever()

    def _take(self, block: bool) -> list[Item]:
        self.step_since = None
        items = super()._take(block)
        self.step_since = time.monotonic()
        kept: list[Item] = []
        shared: list[StepItem] = []
        for item in items:
            match item:
                case Wake():
                    continue
                case EmbedArrived():
                    kept.append(item)  # refused here (WorkerServer._embed): a group computes no embeddings
                    continue
                case Arrived(req=req) if req.lora is not None:
                    self.channel.write(encode_error(NO_ADAPTERS, ADAPTER_ERROR, req.id_json))
                    continue
                case Arrived(req=req) if req.seed is None:
                    # What RowSampling would draw, drawn once for every rank.
                    item = Arrived(msgspec.structs.replace(req, seed=self._seeds.getrandbits(63)), item.at)
                case LoadAdapter() | ReloadAdapter() | UnloadAdapter():
                    self.channel.write(encode_event("adapter_error", model=self.name, lora=item.path, code=ADAPTER_ERROR, msg=NO_ADAPTERS))
                    continue
            kept.append(item)
            shared.append(item.req if isinstance(item, Arrived) else item)
        try:
            self.steps.share(_encode(shared) if shared else b"")
        except RuntimeError as exc:
            self.launcher.broken(f"rank 0 lost the group: {exc}; the group restarts")
        return kept

    def stats_event(self, seq: int) -> bytes:
        mine = RankFigures(rank=0, host=self.plan.hosts[0].name, pid=os.getpid(), weights_bytes=self.weights_bytes, **memory_figures())
        ranks = [mine, *self.launcher.figures()]
        sums = {f: sum(getattr(r, f) for r in ranks) for f in SUMMED}
        return self.encode_stats(seq, sums.pop("weights_bytes"), sums, ranks=[msgspec.to_builtins(r) for r in ranks])


class FollowerServer(WorkerServer):
    """Rank >= 1: no inbox; rank 0's items, through the group."""

    def __init__(self, name: str, channel: EventChannel, group_plan: GroupPlan, rank: int):
        super().__init__(name, channel)
        self.plan = group_plan
        self.rank = rank
        self.steps: StepChannel | None = None

    def form(self, lazy: LazyModel, vocab: bool):
        how = choose_split(lazy.model, lazy.config.get("model_type", "?"), self.plan.parallel, self.plan.ranks)
        group = join(self.plan, self.rank, lambda: self.channel.write(encode_event(RANK_JOINING, rank=self.rank)))
        split(lazy.model, how, group, vocab)
        self.steps = StepChannel(group)
        return group

    def start_heartbeat(self, interval_s: float) -> None:
        # Rank 0 hears this rank is alive, and its memory, from these lines.
        def beat() -> None:
            while True:
                self.report()
                time.sleep(interval_s)

        threading.Thread(target=beat, name="rank-stats", daemon=True).start()

    def report(self) -> None:
        figures = RankFigures(rank=self.rank, host=self.plan.hosts[self.rank].name, pid=os.getpid(), weights_bytes=self.weights_bytes, **memory_figures())
        self.channel.write(encode_event(RANK_STATS, **msgspec.to_builtins(figures)))

    def serve_forever(self) -> None:
        self.report()  # the figures with the model loaded, at once
        super().serve_forever()

    def start_reader(self) -> None:
        # stdin is the lifeline: rank 0 (or the ssh session that carries
        # it) writes nothing and closes it only by going away.
        def watch() -> None:
            try:
                while os.read(self.request_fd, 1 << 16):
                    pass
            except OSError:
                pass
            log.info("rank 0 is gone (stdin closed); exiting")
            os._exit(0)

        threading.Thread(target=watch, name="lifeline", daemon=True).start()

    def _take(self, block: bool) -> list[Item]:
        try:
            data = self.steps.receive()
        except RuntimeError as exc:
            abort(f"rank {self.rank} lost the group: {exc}")
        arrived = time.perf_counter()
        return [Arrived(msg, arrived) if isinstance(msg, Generate) else msg for msg in (_decode(data) if data else ())]


def _discard(line: bytes) -> None:
    pass


class GroupRole:
    """What differs in a worker that is one rank of a group (worker.__main__)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.rank = int(os.environ.get("MLX_RANK") or 0)
        self.plan = plan(args.ranks, args.hosts, args.backend, args.parallel, args.port, resolve=self.rank == 0)
        self.argv = argv
        self.timeout = args.rank_timeout
        self.vocab = not args.whole_vocab
        self.server: LeaderServer | FollowerServer | None = None
        self.group = None

    def make_server(self, name: str, channel: EventChannel) -> WorkerServer:
        if self.rank == 0:
            self.server = LeaderServer(name, channel, self.plan, self.argv, self.timeout)
        else:
            self.server = FollowerServer(name, channel, self.plan, self.rank)
        return self.server

    def form(self, lazy: LazyModel) -> None:
        self.group = self.server.form(lazy, self.vocab)

    def scheduler(self, loaded: LoadedModel, codec, emit, **kwargs) -> GroupScheduler:
        # A split model's forward evaluates as it goes (its layers exchange
        # activations between ranks), which a compiled trace cannot hold.
        kwargs["compile_decode"] = False
        if self.rank == 0:
            return GroupScheduler(self.group, loaded, codec, emit, broken=self.server.launcher.broken, **kwargs)
        return GroupScheduler(self.group, loaded, codec, _discard, **kwargs)

    def weights_bytes(self, loaded: LoadedModel) -> int:
        """The whole model's bytes: every rank's share."""
        return sum(r[0] for r in gather(self.group, [loaded.weights_bytes]))
