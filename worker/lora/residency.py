"""Which adapters a worker holds: each adapter path's entry, the version in
each slot of the LoRA layers, the rows that pin a version, and which one to
evict for another (the model's thread only).

A *version* is one read of an adapter file, in one slot of the LoRA layers;
rows pin the version they started with until they end. An *entry* is one
adapter path: its current version (None when it is not resident), the
adapter messages about it not yet settled, and when it was last used.

Bounds: at most `max_adapters` current versions, plus superseded ones still
used by running rows (at most one per row).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from worker.lora.formats import AdapterWeights
from worker.lora.layers import LoRASlots

log = logging.getLogger("worker")


@dataclass(eq=False)
class Version:
    slot: int
    path: str
    sha256: str  # of the weights file, what `sha256sum` prints for it
    config_sha256: str | None
    key: str  # content hash of weights and config: what prefix-cache entries are keyed by
    format: str
    modules: int
    nbytes: int  # its own arrays, without the rank padding of the stacks
    rows: int = 0  # active rows running with it
    retired: bool = False  # no longer current: dropped when its last row ends


@dataclass(eq=False)
class Entry:
    path: str
    current: Version | None = None
    pending: deque[int] = field(default_factory=deque)  # sequence numbers of unsettled jobs, oldest first
    in_flight: int = 0  # of them, jobs with the reader thread
    claimed: bool = False  # a place among the resident adapters is held for a read in flight
    failed: int = -1  # clock value of the last failed read while not resident
    failure: str = ""
    last_used: int = 0

    @property
    def occupies(self) -> bool:
        """Counts against max_adapters."""
        return self.current is not None or self.claimed

    @property
    def idle(self) -> bool:
        return self.current is None and not self.pending and not self.claimed


def choose_victim(entries, keep: str) -> Entry | None:
    """The resident adapter to evict for another: least recently used among
    those no row runs with and no message is about (and never `keep`)."""
    candidates = [e for e in entries if e.current is not None and e.current.rows == 0 and not e.pending and not e.claimed and e.path != keep]
    return min(candidates, key=lambda e: e.last_used, default=None)


class Residency:
    """The entries, the LoRA layers' slots and what fills them."""

    def __init__(self, model, max_adapters: int):
        self.slots = LoRASlots(model)
        self.max_adapters = max(1, max_adapters)
        self.entries: dict[str, Entry] = {}
        self._tick = 0  # uses, for least recently used
        self._next_slot = 0
        self._drops: set[int] = set()  # slots to empty

    def entry(self, path: str) -> Entry:
        entry = self.entries.get(path)
        if entry is None:
            entry = self.entries[path] = Entry(path)
        return entry

    def forget_idle(self) -> None:
        """Drops the entries of paths neither resident nor asked about."""
        for path in [p for p, e in self.entries.items() if e.idle]:
            del self.entries[path]

    def touch(self, entry: Entry) -> None:
        self._tick += 1
        entry.last_used = self._tick

    # -- rows -----------------------------------------------------------------

    def acquire(self, version: Version) -> None:
        version.rows += 1
        self.touch(self.entries[version.path])

    def release(self, version: Version) -> None:
        version.rows -= 1
        if version.retired and version.rows == 0:
            self._drops.add(version.slot)

    # -- room -----------------------------------------------------------------

    def _full(self) -> bool:
        return sum(e.occupies for e in self.entries.values()) >= self.max_adapters

    def has_room(self, entry: Entry) -> bool:
        return not self._full() or choose_victim(self.entries.values(), keep=entry.path) is not None

    def make_room(self, entry: Entry, evict: bool) -> bool:
        if not self._full():
            return True
        victim = choose_victim(self.entries.values(), keep=entry.path) if evict else None
        if victim is None:
            return False
        log.info("adapter %s evicted (least recently used) for %s", victim.path, entry.path)
        self._retire(victim.current)
        victim.current = None
        return True

    # -- versions -------------------------------------------------------------

    def install(self, entry: Entry, weights: AdapterWeights) -> Version:
        old = entry.current
        if old is not None and old.key == weights.key:
            return old  # the same content again: nothing changes
        slot = self._next_slot
        drops = set(self._drops)
        self.slots.update(add={slot: weights}, drop=drops)
        self._drops -= drops
        self._next_slot += 1
        version = Version(
            slot=slot,
            path=entry.path,
            sha256=weights.sha256,
            config_sha256=weights.config_sha256,
            key=weights.key,
            format=weights.format,
            modules=len(weights.pairs),
            nbytes=self.slots.own_bytes(weights),
        )
        entry.current = version
        entry.failed, entry.failure = -1, ""
        if old is not None:
            self._retire(old)
        self.touch(entry)
        return version

    def unload(self, entry: Entry) -> bool:
        """True when it was resident."""
        was = entry.current
        if was is None:
            return False
        self._retire(was)
        entry.current = None
        return True

    def _retire(self, version: Version) -> None:
        """No longer current: its slot is emptied once no row runs with it."""
        version.retired = True
        if version.rows == 0:
            self._drops.add(version.slot)

    def apply_drops(self) -> bool:
        """Empties the slots of versions no row runs with; True when some were."""
        if not self._drops:
            return False
        drops = set(self._drops)
        try:
            self.slots.update(drop=drops)
        except Exception:
            log.exception("adapter slots %s could not be emptied; trying again later", sorted(drops))
            return False
        self._drops -= drops
        return True

    def figures(self) -> dict:
        """For worker_stats: the bytes of every adapter array held (padding
        and versions still used by running rows included), and each resident
        adapter with its own bytes."""
        resident = sorted((e.current for e in self.entries.values() if e.current is not None), key=lambda v: v.path)
        return {
            "adapter_bytes": self.slots.nbytes,
            "adapters": [{"lora": v.path, "sha256": v.sha256, "config_sha256": v.config_sha256, "bytes": v.nbytes, "rows": v.rows} for v in resident],
            "max_adapters": self.max_adapters,
        }
