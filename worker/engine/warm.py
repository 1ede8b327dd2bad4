"""Warm prompts: prefixes a worker prefills while it loads and keeps in its
prefix cache for good, so the first request that starts with one (an
agent's system prompt and tools) resumes from it.

A warm prompt is ChatML text used verbatim, usually ending with a whole
message (`<|im_end|>\n`). Its snapshot is taken where the next message
would start, the point a request that continues it resumes from: the
prompt runs as if followed by `<|im_start|>`, whose position is a chunk cut
and a snapshot point of both runs. A snapshot the disk tier holds is read
from there instead of being computed again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ipc.sampling import Sampling
from worker.cache.prefix_cache import cut_points
from worker.engine.generator import Row
from worker.engine.sampling import RowSampling

log = logging.getLogger("worker")

# A warm prompt file larger than this is refused (the pool's prompts are
# bounded by max_prompt_bytes too).
MAX_WARM_BYTES = 16 << 20


def read_warm_file(path: Path) -> str:
    """A warm prompt file's text (ValueError when it cannot serve as one)."""
    try:
        size = path.stat().st_size
        if size > MAX_WARM_BYTES:
            raise ValueError(f"warm prompt file {path} is {size} bytes; the limit is {MAX_WARM_BYTES}")
        return path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read warm prompt file {path}: {exc}") from exc


def warm_prompts(scheduler, texts: list[str]) -> int:
    """Prefills each text and pins its snapshot in the scheduler's prefix
    cache; returns the tokens pinned in all."""
    cache = scheduler.prefix_cache
    if not texts:
        return 0
    if not cache.enabled:
        log.warning("%d warm prompts not held: the prefix cache is off", len(texts))
        return 0
    generator = scheduler._generator(cache)
    marker = generator.chat_marker
    greedy = Sampling(temperature=0.0)
    pinned = 0
    for text in texts:
        ids = scheduler.codec.encode(text)
        if not ids:
            continue
        # Followed by the next message's start: its snapshot point.
        run = ids + [marker if marker is not None else ids[-1]]
        disk = cache.disk
        if disk is not None:
            for entry, _ in cache.disk_reads(run, cut_points(run, marker)):
                loaded = disk.load_now(entry)
                restored = loaded.layers() if loaded is not None else None
                if restored is not None:
                    cache.insert_read(entry.adapter, entry.tokens, *restored)
        row = Row(0, run, RowSampling(greedy, scheduler.vocab_size, run))
        generator.start([row])
        while row in generator.prefilling:
            generator.step()
        generator.remove([row])
        if cache.pin(None, ids):
            pinned += len(ids)
            log.info("warm prompt of %d tokens held (%d resumed from the cache)", len(ids), row.cached)
        else:
            log.warning("warm prompt of %d tokens not held: no snapshot where it ends (prefix cache budget %d bytes)", len(ids), cache.budget)
    return pinned
