"""The worker's engine driven in this process (no worker process): a
scheduler over a loaded model, what it wrote, a constraint's mask."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from ipc.messages import Generate


def scheduler_for(loaded, model=None, **kw):
    from worker.engine.scheduler import Scheduler
    from worker.text.tokenizer import TextCodec

    lines: list[bytes] = []
    kw.setdefault("batch_memory", 1 << 30)
    kw.setdefault("prefix_cache_bytes", 0)
    if model is not None:
        loaded = dataclasses.replace(loaded, model=model)
    s = Scheduler(loaded, TextCodec(loaded.path, loaded.config), lines.append, **kw)
    return s, lines


def events(lines: list[bytes]) -> list[dict]:
    """The events of what the scheduler wrote (each write holds whole lines)."""
    return [json.loads(line[len(b"@@lattice ") :]) for line in b"".join(lines).splitlines()]


def ends_by_id(lines: list[bytes]) -> dict:
    out: dict = {}
    for e in events(lines):
        if e["ev"] == "error" or e.get("done"):
            out.setdefault(e["id"], []).append(e)
    return out


def engine_for(model_dir, **kw):
    """A scheduler of `model_dir` with its prefix cache, in this process;
    its output lines in `.lines`."""
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    loaded = load(model_dir)
    lines: list[bytes] = []
    scheduler = Scheduler(loaded, TextCodec(model_dir, loaded.config), lines.append, batch_memory=1 << 30, prefill_step=16, **kw)
    scheduler.lines = lines
    return scheduler


def run(scheduler, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 12)
    scheduler.submit(Generate(rid=0, **kw), 0.0)
    ids = scheduler.drain()[0]
    return ids, json.loads(scheduler.lines[-1].splitlines()[-1][len(b"@@lattice ") :])


def allowed_ids(masks, row_bits) -> set[int]:
    bits = np.unpackbits(np.ascontiguousarray(row_bits).view(np.uint8), bitorder="little")[: masks.vocab_size]
    return set(np.nonzero(bits)[0].tolist())
