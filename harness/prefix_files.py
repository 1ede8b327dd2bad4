"""Prefix cache files for tests of the disk tier: prompts that share a
long system prompt, a disk tier over one prompt's snapshots, hand-made
snapshots and where their files go."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from harness.engine import engine_for, run
from harness.procs import wait_for
from harness.prompts import SYSTEM, chatml

LONG_SYSTEM = SYSTEM + " " + "The mill wheel turns all day beside the bridge. " * 12
FIRST = chatml([("user", "Where does the river bend?")], LONG_SYSTEM)
SECOND = chatml([("user", "Who built the mill?")], LONG_SYSTEM)


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.lpx"))


def wait_files(root: Path, n: int) -> list[Path]:
    return wait_for(lambda: len(files(root)) >= n and files(root), timeout=30, message=f"{n} prefix cache files")


def snapshot_layers(seed: int, tokens: int):
    import mlx.core as mx

    mx.random.seed(seed)
    kv = (mx.random.normal((1, 2, tokens, 8)).astype(mx.bfloat16), mx.random.normal((1, 2, tokens, 8)).astype(mx.bfloat16))
    state = [mx.random.normal((1, 3, 4)), None]
    mx.eval(kv, state)
    return [kv, state, None]


def path_of(disk, tokens) -> Path:
    from worker.cache.prefix_file import entry_name

    return disk.dir / entry_name(None, tokens)


def disk_after_first(tiny_model, tmp_path):
    """A disk tier over the files of FIRST's snapshots, as a new worker of
    the tiny model finds them."""
    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_file import model_key
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    key = model_key(tiny_model, loaded.format, loaded.model)
    writer = engine_for(tiny_model, prefix_disk=PrefixDisk(tmp_path, key, 1 << 30))
    run(writer, prompt=FIRST)
    assert writer.prefix_cache.disk.flush(30)
    return PrefixDisk(tmp_path, key, 1 << 30)


def shortest_file(tiny_model, tmp_path):
    """disk_after_first's tier, its entry of the fewest tokens (the system
    prompt's), and that file's path, bytes and parts (FileParts)."""
    disk = disk_after_first(tiny_model, tmp_path)
    entry = min(disk._index.values(), key=lambda e: len(e.tokens))
    path = disk.dir / entry.name
    raw = path.read_bytes()
    return disk, entry, path, raw, FileParts.of(raw)


@dataclass
class FileParts:
    """A cache file's bytes taken apart: its header's tensors, its own
    metadata and the data after the header."""

    header: dict
    meta: dict
    data: bytes

    @classmethod
    def of(cls, raw: bytes) -> FileParts:
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        meta = json.loads(header.pop("__metadata__")["lattice"])
        return cls(header, meta, raw[8 + length :])

    def made(self, tensors: dict | None = None, body: bytes | None = None, **meta) -> bytes:
        """The file's bytes with these tensors and metadata, its header's
        checksum made again to match (what a file made to pass its checks
        holds); `body` stands for the whole header."""
        from worker.cache.prefix_file import head_digest

        tensors = self.header if tensors is None else tensors
        meta = {**self.meta, **meta}
        meta["head"] = head_digest(tensors, meta["adapter"], meta["tree"])
        body = body or json.dumps({**tensors, "__metadata__": {"lattice": json.dumps(meta)}}).encode()
        return struct.pack("<Q", len(body)) + body + self.data
