"""What a worker knows about each adapter path, and which one to evict.

A *version* is one read of an adapter file, in one slot of the LoRA layers;
rows pin the version they started with until they end. An *entry* is one
adapter path: its current version (None when it is not resident), the
adapter messages about it not yet settled, and when it was last used.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


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
