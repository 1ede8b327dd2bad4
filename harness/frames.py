"""Frames written to a raw fd and read from an asyncio stream: a second
writer and reader that tests check ipc.framing's against (the pool and
the worker use neither)."""

from __future__ import annotations

import asyncio
import os

from ipc.framing import HEADER, MAX_FRAME, FrameTooLarge, decode_payload, encode_frame
from ipc.messages import ToWorker


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
