import asyncio
import os

import msgspec
import pytest

from ipc.framing import HEADER, MAX_FRAME, FrameTooLarge, decode_payload, encode_frame, read_frame_async, read_payload, write_frame
from ipc.messages import Cancel, Generate, LoadAdapter, Message, ReloadAdapter, SetAdapter, Shutdown, Stats, UnloadAdapter

MESSAGES = [
    Generate(rid=1, prompt="hi", seed=3, stop=["\n"], id_json='"a"'),
    Generate(rid=2, messages=[Message("user", "héllo")], temperature=0.0),
    Generate(rid=3, prompt="hi", lora="/x/adapter"),
    Generate(rid=4, prompt="hi", lora=None),
    Cancel(rid=1),
    LoadAdapter(path="/x/adapter"),
    ReloadAdapter(path="/x/adapter"),
    UnloadAdapter(path="/x/adapter"),
    SetAdapter(path="/x/adapter.safetensors"),
    SetAdapter(path=None),
    Stats(),
    Shutdown(),
]


def test_sync_roundtrip_over_a_pipe():
    r, w = os.pipe()
    try:
        for msg in MESSAGES:
            write_frame(w, msg)
        for msg in MESSAGES:
            assert decode_payload(read_payload(r)) == msg
        os.close(w)
        w = -1
        assert read_payload(r) is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


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


def test_oversized_frame_is_skipped_whole(monkeypatch):
    import ipc.framing as framing

    monkeypatch.setattr(framing, "MAX_FRAME", 16)
    r, w = os.pipe()
    try:
        os.write(w, HEADER.pack(40) + b"x" * 40 + encode_frame(Stats()))
        with pytest.raises(FrameTooLarge):
            read_payload(r)
        assert decode_payload(read_payload(r)) == Stats()
    finally:
        os.close(r)
        os.close(w)
    assert MAX_FRAME > 16


def test_a_generate_without_lora_is_not_one_for_the_base_model():
    """Left out, `lora` means the worker's default adapter; null, the base
    model: the difference survives the wire."""
    unset, base = (decode_payload(encode_frame(Generate(rid=1, **kw))[HEADER.size :]) for kw in ({}, {"lora": None}))
    assert unset.lora is msgspec.UNSET and base.lora is None
