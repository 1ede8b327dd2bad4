"""Length-prefixed msgpack frames: 4-byte big-endian length, then the payload.

A length prefix (rather than a delimiter) lets prompts carry any bytes and
lets the reader allocate once per frame.
"""

from __future__ import annotations

import asyncio
import os
import struct

import msgspec

from ipc.messages import ToWorker

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ToWorker)


class FrameTooLarge(Exception):
    def __init__(self, size: int):
        super().__init__(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
        self.size = size


def encode_frame(msg: ToWorker) -> bytes:
    payload = _encoder.encode(msg)
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> ToWorker:
    """Raises msgspec.DecodeError / ValidationError on a malformed payload."""
    return _decoder.decode(payload)


def _read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from fd, or None at EOF before all of them arrived."""
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_payload(fd: int) -> bytes | None:
    """The next frame's payload from a blocking fd; None at EOF.

    An oversized frame is skipped whole (so the stream stays in sync) and
    reported with FrameTooLarge.
    """
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        remaining = size
        while remaining:
            skipped = _read_exact(fd, min(remaining, 1 << 20))
            if skipped is None:
                return None
            remaining -= len(skipped)
        raise FrameTooLarge(size)
    payload = _read_exact(fd, size)
    return payload


def write_frame(fd: int, msg: ToWorker) -> None:
    view = memoryview(encode_frame(msg))
    while view:
        view = view[os.write(fd, view) :]


async def read_frame_async(reader: asyncio.StreamReader) -> ToWorker | None:
    """asyncio counterpart of read_payload + decode_payload; None at EOF."""
    try:
        header = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME:
            raise FrameTooLarge(size)
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    return decode_payload(payload)
