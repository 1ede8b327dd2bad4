"""One prefix-cache snapshot as a file (worker.cache.prefix_disk keeps the
files): a safetensors file, so that mlx reads its arrays straight into
their memory. Its tensors are the token ids ("tokens", int32), then the
snapshot's arrays a0, a1, ... in the order of their bytes; its header's
`__metadata__` holds this tier's own JSON under "lattice": the format, the
adapter's content key, the tree that puts the arrays back into layers, a
SHA-256 of all that (`head_digest`) and a CRC-32 of every `chunk` bytes of
the data (a checksum against damage, not tampering: a file is as trusted
as the directory it is in, and CRC-32 went 2.3x faster than SHA-256 on a
2-core EPYC, 3.7 against 1.6 GB/s a thread).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SUFFIX = ".lpx"
# What a file's metadata says it is: a file of another layout (an earlier
# version's) is removed when seen.
FORMAT = "lattice-pool prefix 2"
LENGTH = struct.Struct("<Q")
# The largest header a file may claim (its JSON: layout, adapter key,
# checksums).
MAX_HEADER = 1 << 20
# The largest checksum piece a file may claim: each reading thread keeps a
# buffer of one.
MAX_CHUNK = 64 << 20

# safetensors' names of the dtypes a snapshot holds, and their sizes.
DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
}
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8}


def _compute_dtype(model) -> str:
    """The dtype most of the model's parameters are held in (float32 on the
    CPU, as the checkpoint stores them elsewhere)."""
    from mlx.utils import tree_flatten

    counts: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        counts[str(p.dtype)] = counts.get(str(p.dtype), 0) + p.size
    return max(counts, key=counts.get) if counts else "none"


def model_key(model_dir: Path, fmt: str, model) -> str:
    """A hash of what decides a snapshot's values besides its tokens: the
    model's config and weights, the dtype it computes in, mlx's version.
    Weights are identified by their safetensors headers (names, shapes,
    offsets) and a MiB read at the start, middle and end of each file, so a
    model of many gigabytes is not read whole at every start."""
    h = hashlib.sha256()
    h.update(f"mlx {mx.__version__} format {fmt} dtype {_compute_dtype(model)}\n".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("model*.safetensors")):
        size = path.stat().st_size
        h.update(f"\n{path.name} {size}\n".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(f.read(min(int.from_bytes(head, "little"), MAX_HEADER)))
            for at in (0, size // 2, max(0, size - (1 << 20))):
                f.seek(at)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def entry_name(adapter: str | None, tokens: np.ndarray) -> str:
    h = hashlib.sha256((adapter or "").encode() + b"\0")
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()[:40] + SUFFIX


# -- a snapshot's layers as a JSON tree and a list of arrays ---------------------


def flatten(node, arrays: list) -> object:
    if node is None:
        return None
    if isinstance(node, mx.array):
        arrays.append(node)
        return len(arrays) - 1
    items = [flatten(x, arrays) for x in node]
    return {"t": items} if isinstance(node, tuple) else items


def unflatten(tree, arrays: list):
    if tree is None:
        return None
    if isinstance(tree, int):
        return arrays[tree]
    if isinstance(tree, dict):
        return tuple(unflatten(x, arrays) for x in tree["t"])
    return [unflatten(x, arrays) for x in tree]


def dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def bytes_of(a: mx.array) -> memoryview:
    """An array's bytes, in row-major order, copied only where the array
    is not contiguous."""
    m = memoryview(a)
    return (m if m.c_contiguous else memoryview(m.tobytes())).cast("B")


class BadEntry(Exception):
    pass


@dataclass
class Layout:
    """A file's header: what its metadata says and where its data lies."""

    meta: dict
    tensors: dict  # safetensors' entries: dtype, shape, data_offsets
    arrays: int  # named a0, a1, ... after "tokens"
    tokens: int
    data_start: int
    data_size: int


def read_layout(f, size: int) -> Layout:
    """A file is a safetensors file: its header's `__metadata__` holds this
    tier's own JSON, and its tensors are "tokens" then a0, a1, ... in the
    order of their bytes."""
    head = f.read(LENGTH.size)
    if len(head) < LENGTH.size:
        raise BadEntry("shorter than its header")
    (length,) = LENGTH.unpack(head)
    if length > MAX_HEADER:
        raise BadEntry("not a prefix cache file")
    raw = f.read(length)
    if len(raw) < length:
        raise BadEntry("shorter than its header says")
    try:
        header = json.loads(raw)
        meta = json.loads(header.pop("__metadata__")["lattice"])
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise BadEntry("not a prefix cache file of this version")
        # The adapter key is hashed into the file's name (`entry_name`): a
        # number, or a lone surrogate that does not encode, raised there.
        adapter = meta.get("adapter")
        if adapter is not None and not (isinstance(adapter, str) and _encodes(adapter)):
            raise BadEntry("its adapter key is not a valid string")
        names = ["tokens", *(f"a{i}" for i in range(len(header) - 1))]
        at = 0
        for name in names:
            dtype, shape, (lo, hi) = header[name]["dtype"], header[name]["shape"], header[name]["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise BadEntry(f"array {name} has a malformed shape")
            if lo != at or hi - lo != ITEMSIZE[dtype] * math.prod(shape):
                raise BadEntry(f"array {name} is not where its header says")
            at = hi
        tokens = header["tokens"]
        if tokens["dtype"] != "I32" or len(tokens["shape"]) != 1:
            raise BadEntry("its token ids are malformed")
    # A header nested deeper than json's recursion limit raises RecursionError.
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise BadEntry(f"malformed header ({exc!r})") from None
    start = LENGTH.size + length
    if size != start + at:
        raise BadEntry(f"{size} bytes where its header says {start + at}: truncated or extended")
    return Layout(meta, header, len(names) - 1, tokens["shape"][0], start, at)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def read_tokens(f, layout: Layout) -> np.ndarray:
    f.seek(layout.data_start)
    raw = f.read(4 * layout.tokens)
    if layout.tokens <= 0 or len(raw) < 4 * layout.tokens:
        raise BadEntry("its token ids are missing")
    return np.frombuffer(raw, dtype=np.int32).astype(np.int64)


def pieces(segments: list[memoryview], size: int) -> list[list[memoryview]]:
    """The bytes of `segments`, end to end, cut into pieces of `size` (a
    piece may span segments)."""
    out: list[list[memoryview]] = []
    piece: list[memoryview] = []
    room = size
    for seg in segments:
        at = 0
        while at < len(seg):
            take = min(room, len(seg) - at)
            piece.append(seg[at : at + take])
            at += take
            room -= take
            if room == 0:
                out.append(piece)
                piece, room = [], size
    if piece:
        out.append(piece)
    return out


def head_digest(tensors: dict, adapter: str | None, tree: object) -> str:
    """A SHA-256 of what a file's header says beside its checksums: a flipped
    byte there could otherwise put a sound array in the wrong place."""
    return hashlib.sha256(json.dumps([tensors, adapter, tree], sort_keys=True).encode()).hexdigest()


def crc_of(parts: list[memoryview]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def checked_layout(f, size: int, adapter: str | None, tokens: np.ndarray) -> Layout:
    """The layout of the open file `f` of `size` bytes, once its header holds
    up: checksums that cover its data, the header's own digest, and the
    adapter and token ids of its index entry. Raises BadEntry (and what a
    malformed header raises) otherwise."""
    layout = read_layout(f, size)
    found = read_tokens(f, layout)
    meta = layout.meta
    chunk, crcs = meta.get("chunk"), meta.get("crc32")
    if not isinstance(chunk, int) or not 0 < chunk <= MAX_CHUNK or not isinstance(crcs, list) or len(crcs) != -(-layout.data_size // chunk):
        raise BadEntry("its checksums do not cover its data")
    if meta.get("head") != head_digest(layout.tensors, meta.get("adapter"), meta.get("tree")):
        raise BadEntry("its header's checksum does not match: the file is corrupt")
    if meta.get("adapter") != adapter or not np.array_equal(found, tokens):
        raise BadEntry("its adapter or token ids changed since it was indexed")
    return layout


def check_chunk(fd: int, layout: Layout, i: int, buffer: memoryview) -> None:
    """Reads chunk `i` of a checked layout's data through `fd` into `buffer`
    (at least a chunk long) and compares its CRC-32; raises BadEntry."""
    chunk = layout.meta["chunk"]
    part = buffer[: min(chunk, layout.data_size - i * chunk)]
    got = 0
    while got < len(part):
        n = os.preadv(fd, [part[got:]], layout.data_start + i * chunk + got)
        if not n:
            raise BadEntry("shorter than its header says")
        got += n
    if zlib.crc32(part) != layout.meta["crc32"][i]:
        raise BadEntry("its checksum does not match: the file is corrupt")


def encode(tokens: np.ndarray, arrays: list[mx.array], adapter: str | None, tree: object, chunk: int, crcs: Callable) -> tuple[bytes, list[memoryview]]:
    """A snapshot as a file: its header's JSON and its data's segments, to
    be written after the header's length (LENGTH), one after the other.
    `crcs` takes the data's pieces of `chunk` bytes (`pieces`) to their
    CRC-32s (on threads, say)."""
    segments = [memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B"), *(bytes_of(a) for a in arrays)]
    kinds = [("I32", [len(tokens)]), *((DTYPES[dtype_name(a)], list(a.shape)) for a in arrays)]
    header: dict = {}
    at = 0
    for i, ((dtype, shape), seg) in enumerate(zip(kinds, segments)):
        header["tokens" if i == 0 else f"a{i - 1}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(seg)]}
        at += len(seg)
    checksums = list(crcs(pieces(segments, chunk)))
    head = head_digest(header, adapter, tree)
    header["__metadata__"] = {"lattice": json.dumps({"format": FORMAT, "adapter": adapter, "tree": tree, "chunk": chunk, "crc32": checksums, "head": head})}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    return raw, segments
