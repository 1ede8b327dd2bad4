import asyncio
import os

import msgspec
import pytest

from harness.frames import read_frame_async, write_frame
from ipc.framing import HEADER, MAX_FRAME, FrameReader, FrameTooLarge, decode_payload, encode_frame, read_messages
from ipc.messages import Cancel, Generate, LoadAdapter, Message, ReloadAdapter, Shutdown, Stats, UnloadAdapter

MESSAGES = [
    Generate(rid=1, prompt="hi", seed=3, stop=["\n"], id_json='"a"'),
    Generate(rid=2, messages=[Message("user", "héllo")], temperature=0.0),
    Generate(rid=3, prompt="hi", lora="/x/adapter"),
    Generate(rid=4, prompt="hi", lora=None),
    Cancel(rid=1),
    LoadAdapter(path="/x/adapter"),
    ReloadAdapter(path="/x/adapter"),
    UnloadAdapter(path="/x/adapter"),
    Stats(),
    Shutdown(),
]


class Pipe:
    """Both ends of an os.pipe; `end()` closes the writing one (EOF)."""

    def __init__(self):
        self.r, self.w = os.pipe()

    def end(self) -> None:
        if self.w >= 0:
            os.close(self.w)
            self.w = -1


@pytest.fixture
def pipe():
    p = Pipe()
    yield p
    p.end()
    os.close(p.r)


def test_sync_roundtrip_over_a_pipe(pipe):
    for msg in MESSAGES:
        write_frame(pipe.w, msg)
    reader = FrameReader(pipe.r)
    got = []
    while len(got) < len(MESSAGES):
        got += [decode_payload(p) for p in reader.batch()]
    assert got == MESSAGES
    pipe.end()
    assert reader.batch() is None


def test_frames_written_together_come_out_together_and_split_ones_wait(pipe):
    """The worker takes one batch per read: requests written in one write
    start together. A frame split across writes comes out once whole."""
    frames = [encode_frame(Generate(rid=i, prompt="x" * (i * 300))) for i in range(8)]
    reader = FrameReader(pipe.r)
    os.write(pipe.w, b"".join(frames))
    assert [decode_payload(p).rid for p in reader.batch()] == list(range(8))
    tail = frames[3]
    os.write(pipe.w, frames[1] + tail[:5])
    assert [decode_payload(p).rid for p in reader.batch()] == [1]
    os.write(pipe.w, tail[5:] + frames[2][:2])
    assert [decode_payload(p).rid for p in reader.batch()] == [3]
    os.write(pipe.w, frames[2][2:])
    assert [decode_payload(p).rid for p in reader.batch()] == [2]
    pipe.end()
    assert reader.batch() is None


def test_read_messages_hands_malformed_frames_aside_and_goes_on(pipe):
    """The read loop of the worker (and the fake one): each read's messages
    decoded, a frame that does not decode reported and skipped, the end at
    EOF."""
    os.write(pipe.w, encode_frame(Cancel(rid=1)) + HEADER.pack(1) + b"\xc1" + encode_frame(Stats()))
    pipe.end()
    problems = []
    assert list(read_messages(pipe.r, problems.append)) == [[Cancel(rid=1), Stats()]]
    assert [type(p) for p in problems] == [msgspec.DecodeError]


def test_asyncio_roundtrip():
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(encode_frame(m) for m in MESSAGES))
        reader.feed_eof()
        return [await read_frame_async(reader) for _ in range(len(MESSAGES) + 1)]

    assert asyncio.run(main()) == MESSAGES + [None]


def test_malformed_payloads_raise_msgspec_errors():
    with pytest.raises(msgspec.DecodeError):
        decode_payload(b"\xc1")
    with pytest.raises(msgspec.ValidationError):
        decode_payload(msgspec.msgpack.encode({"type": "generate"}))
    with pytest.raises(msgspec.ValidationError):
        decode_payload(msgspec.msgpack.encode({"type": "nope"}))


def test_oversized_frame_is_skipped_whole(monkeypatch, pipe):
    import ipc.framing as framing

    monkeypatch.setattr(framing, "MAX_FRAME", 32)
    monkeypatch.setattr(FrameReader, "READ_SIZE", 8)
    reader = FrameReader(pipe.r)
    # Its bytes arrive over several reads; the frame after it is intact.
    os.write(pipe.w, HEADER.pack(40) + b"x" * 40 + encode_frame(Stats()))
    got = []
    while len(got) < 2:
        got += reader.batch()
    assert isinstance(got[0], FrameTooLarge) and got[0].size == 40
    assert decode_payload(got[1]) == Stats()
    assert MAX_FRAME > 32
