"""Reading a model dir's small files with a bound, and telling regular
files from FIFOs, devices and directories, for the worker and the supervisor.

A model dir comes from whoever configured the pool or named it on stdin:
its `config.json` could be a gigabyte, and any file in it a FIFO (an open
for reading blocks until a writer comes) or a device (reads never end).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

# config.json, tokenizer_config.json, generation_config.json: the largest in
# real checkpoints are tens of KiB (a chat template included), so 16 MiB
# leaves room for any real one and keeps a hostile one from filling memory.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


class FileRefused(Exception):
    """The file is not a regular file or is too large; the message names it."""


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular(path: Path) -> os.stat_result:
    """The file's stat (symlinks followed, as Hugging Face caches link to
    blobs); FileRefused if it is not a regular file. Never opens it."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{path} is {kind_of(st.st_mode)}, not a regular file")
    return st


def read_capped(path: Path, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. The size is
    checked before any read, and the read stops at limit + 1 bytes in case
    the file grows meanwhile. Opened non-blocking so that a file swapped for
    a FIFO after the check cannot hang the caller. OSError as os raises it."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{path} is {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileRefused(f"{path} is {st.st_size} bytes; the limit is {limit} bytes")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise FileRefused(f"{path} grew past the limit of {limit} bytes while being read")
        return data
    finally:
        os.close(fd)


def read_json(path: Path, limit: int = MAX_CONFIG_BYTES) -> object:
    """A JSON file read through read_capped. ValueError when it does not
    parse, including one that nests too deeply for Python's parser (which
    recurses per level: a hostile file must be a bad file, not a crash)."""
    data = read_capped(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("it nests too deeply") from None
