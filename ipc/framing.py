"""Length-prefixed msgpack frames: 4-byte big-endian length, then the payload.

A length prefix (rather than a delimiter) lets prompts carry any bytes and
lets the reader allocate once per frame.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator

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


class FrameReader:
    """Frames from a blocking fd, handed on as they arrived together.

    `batch()` blocks for the next read and returns every frame it (and the
    bytes before it) completed: frames the writer sent in one write come out
    in one batch, so the worker's main thread never sees some of them before
    the rest (it would start the first requests alone and the others only
    after their prompts were read). An oversized frame comes out as a
    FrameTooLarge in its place, and its bytes are skipped as they arrive, so
    the stream stays in sync. The buffer holds at most one frame and one
    read: MAX_FRAME plus READ_SIZE bytes.
    """

    READ_SIZE = 1 << 16

    def __init__(self, fd: int):
        self._fd = fd
        self._buf = bytearray()
        self._skip = 0  # bytes of an oversized frame still to drop

    def batch(self) -> list[bytes | FrameTooLarge] | None:
        """The frames completed by the next read(s), at least one; None at
        EOF (a partial frame left is dropped)."""
        while True:
            out = self._frames()
            if out:
                return out
            want = self._missing()
            chunk = os.read(self._fd, min(max(want, self.READ_SIZE), 1 << 20))
            if not chunk:
                return None
            if self._skip:
                dropped = min(self._skip, len(chunk))
                self._skip -= dropped
                chunk = chunk[dropped:]
            self._buf += chunk

    def _missing(self) -> int:
        """Bytes the frame at the head of the buffer still needs."""
        if len(self._buf) < HEADER.size:
            return HEADER.size - len(self._buf)
        (size,) = HEADER.unpack_from(self._buf)
        return HEADER.size + size - len(self._buf)

    def _frames(self) -> list[bytes | FrameTooLarge]:
        out: list[bytes | FrameTooLarge] = []
        buf, pos = self._buf, 0
        while not self._skip and len(buf) - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME:
                out.append(FrameTooLarge(size))
                pos += HEADER.size
                dropped = min(size, len(buf) - pos)
                pos += dropped
                self._skip = size - dropped
                continue
            if len(buf) - pos - HEADER.size < size:
                break
            out.append(bytes(buf[pos + HEADER.size : pos + HEADER.size + size]))
            pos += HEADER.size + size
        del buf[:pos]
        return out


def read_messages(fd: int, malformed: Callable[[Exception], None]) -> Iterator[list[ToWorker]]:
    """The messages of each read of `fd` (FrameReader.batch), decoded, until
    the writer closes it or a read fails. A frame that is too large or does
    not decode goes to `malformed` and the stream goes on: a hostile frame
    costs only itself."""
    reader = FrameReader(fd)
    while True:
        try:
            batch = reader.batch()
        except OSError:
            return
        if batch is None:
            return
        messages = []
        for payload in batch:
            if isinstance(payload, FrameTooLarge):
                malformed(payload)
                continue
            try:
                messages.append(decode_payload(payload))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                malformed(exc)
        if messages:
            yield messages
