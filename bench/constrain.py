"""Structured output costs: decode tok/s with a JSON-schema constraint vs
none, and a constraint's first-token cost, through a real worker process
(the batched engine, real pipes) for 1 and 8 concurrent rows; whether the
masks overlap the forward pass inside the engine; and llguidance's own
costs per step (mask fill, apply, compile). Each on the demo tokenizer and
on a 151k-token byte-level BPE, every comparison in the same run.
`--parts profile` adds where a worker's engine thread spends its time per
step, free and constrained (under cProfile); `--parts gil`, how late a
batch's masks come back while the engine thread is busy in Python, at
several GIL switch intervals.

    python -m bench.constrain [--size small|0.8b] [--tokens 128] [--rounds 3] [--batches 1,8] [--parts masks,overlap,worker,profile,gil]
                              [--models demo,bpe-151k] [--mask-threads 2,4] [--gil-switch-ms 5,0.5] [--schema bounded|free] [--tag X]

The 151k tokenizer is trained locally on this Python's standard library
sources (nothing downloaded) and cached beside the demo models; the
"-151k" model is the demo model of that size with its vocabulary (embedding
and LM head) widened to 151,936 rows and that tokenizer, so the mask and the
LM head are both real-sized.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import sysconfig
import time
from concurrent.futures import Future
from pathlib import Path

from bench.common import MODELS, demo_model, load_average, machine, summary, tagged, write_result
from ipc.messages import ResponseFormat, read_response_format
from tests.schemas import PET, PET_VALUE

# The prompt of every decode measurement here.
PROMPT = "<|im_start|>user\nList sixteen notes about the river.<|im_end|>\n<|im_start|>assistant\n"
REAL_VOCAB = 151_936  # Qwen2/3's padded vocabulary
# Tokens per row in the in-engine overlap check: the first ones of a LONG
# reply are inside a length-bounded string, llguidance's costliest steps.
OVERLAP_TOKENS = 64
REAL_TOKENS = 151_643

# The tests' schema plus a free-text field. For llguidance the costly steps
# are inside length-bounded strings (about 1.5 ms at 151k), free text is cheap.
PET_NOTES = {**PET, "properties": {**PET["properties"], "notes": {"type": "string"}}, "required": [*PET["required"], "notes"]}
PET_NOTES_VALUE = {**PET_VALUE, "notes": "Sleeps under the stairs, eats socks, and barks at the postman every single morning."}
OBJECT_VALUE = {"order": 1182, "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1}], "paid": True, "memo": None}
# Long enough that every row runs to max_tokens, so both sides decode the same count.
LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 40, "maxLength": 80}, "minItems": 16, "maxItems": 16}},
    "required": ["notes"],
    "additionalProperties": False,
}


# --schema: the bounded one above; free text (every row still runs to
# max_tokens: a random-weight model all but never closes an unbounded string).
FREE = {**LONG, "properties": {"notes": {**LONG["properties"]["notes"], "items": {"type": "string"}}}}
SCHEMAS = {"bounded": LONG, "free": FREE}


def schema_format(schema: dict, name: str = "bench") -> ResponseFormat:
    return read_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})


def real_vocab_tokenizer() -> Path:
    path = MODELS / "bpe-151k" / "tokenizer.json"
    if path.is_file():
        return path
    from worker.demo.build import train_tokenizer

    def lines():
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield from source.read_text("utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue

    tok = train_tokenizer(REAL_TOKENS, lines())
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def real_vocab_model(size: str) -> Path:
    """The demo model of `size` with a 151,936-row vocabulary and the 151k tokenizer."""
    path = MODELS / f"{size}-151k"
    if (path / "config.json").is_file():
        return path
    from worker.demo import build as dm

    # A bench-only shape: the demo builder pads the embedding and LM head to
    # the configured vocabulary (rows past its own tokenizer are zero).
    dm.BENCH_SHAPES[size] = {**dm.BENCH_SHAPES.get(size, {}), "vocab_size": REAL_VOCAB}
    try:
        dm.build(path, size=size)
    finally:
        dm.BENCH_SHAPES.pop(size)
    (path / "tokenizer.json").write_bytes(real_vocab_tokenizer().read_bytes())
    _fill_padded_rows(path / "model.safetensors", dm.tokenizer_vocab(dm.train_tokenizer(1024)))
    return path


def _fill_padded_rows(weights: Path, real_rows: int) -> None:
    """The builder leaves rows past its tokenizer zero; here those ids are
    real tokens of the 151k tokenizer, so give them copies of real rows
    (zero embeddings would make a constrained row's forward pass run on
    zeros, not what a real model does)."""
    import mlx.core as mx
    import numpy as np

    arrays = mx.load(str(weights))
    pick = mx.array(np.random.default_rng(0).integers(0, real_rows, size=REAL_VOCAB - real_rows))
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        if name in arrays:
            arrays[name] = mx.concatenate([arrays[name][:real_rows], arrays[name][pick]])
    mx.save_safetensors(str(weights), arrays, metadata={"format": "pt"})


def mask_costs(tokenizer_json: str, vocab: int, eos: set[int], encode, rounds: int) -> dict:
    """Per-step mask fill and apply times walking valid replies, compile
    times, and a batch of 8 rows filled at once."""
    import llguidance
    import mlx.core as mx

    from worker.engine.constrain import BatchMasks, Constraints

    masks = BatchMasks(vocab, eos)  # as a worker's: default_mask_threads()
    t0 = time.perf_counter()
    constraints = Constraints(tokenizer_json, vocab, eos, lexers=masks.threads)
    constraints.prepare()
    view_ms = (time.perf_counter() - t0) * 1000
    out: dict = {"vocab": vocab, "tokenizer_view_ms": round(view_ms, 1), "mask_threads": masks.threads}

    cases = {
        "json_schema": (schema_format(PET_NOTES), json.dumps(PET_NOTES_VALUE, separators=(",", ":"))),
        "json_object": (read_response_format({"type": "json_object"}), json.dumps(OBJECT_VALUE, separators=(",", ":"))),
    }
    logits = mx.zeros((1, vocab), dtype=mx.float32)
    for name, (text, reply) in cases.items():
        ids = encode(reply)
        fills, applies = [], []
        for _ in range(rounds):
            row = constraints.row(text, [])
            for token in ids:
                t = time.perf_counter()
                bits = masks.fill([row])
                fills.append((time.perf_counter() - t) * 1e6)
                t = time.perf_counter()
                mx.eval(masks.apply(logits, bits))
                applies.append((time.perf_counter() - t) * 1e6)
                row.advance(token)
            assert row.accepting, f"{name}: the valid reply was not accepted"
        out[name] = {
            "reply_tokens": len(ids),
            "fill_us": summary(fills, 1) | {"mean": round(statistics.mean(fills), 1), "p99": round(sorted(fills)[int(0.99 * len(fills))], 1)},
            "apply_us": summary(applies, 1),
        }

    # Compile = a cache miss (a distinct schema name), then the first mask.
    compile_ms, first_ms = [], []
    for i in range(max(rounds, 5)):
        text = schema_format(PET_NOTES, name=f"pet{i}")
        t = time.perf_counter()
        row = constraints.row(text, [])
        compile_ms.append((time.perf_counter() - t) * 1000)
        masks.fill([row])
        first_ms.append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    for _ in range(100):
        constraints.row(schema_format(PET_NOTES), [])
    out["schema_compile_ms"] = summary(compile_ms, 2)
    out["schema_compile_and_first_mask_ms"] = summary(first_ms, 2)
    out["cached_schema_row_ms"] = round((time.perf_counter() - t) * 10, 3)

    # 8 rows at the same point of the same schema, filled by llguidance's
    # thread pool in one call.
    ids = encode(json.dumps(PET_NOTES_VALUE, separators=(",", ":")))
    batch = []
    for _ in range(rounds):
        rows = [constraints.row(schema_format(PET_NOTES), []) for _ in range(8)]
        for token in ids:
            t = time.perf_counter()
            masks.fill(rows)
            batch.append((time.perf_counter() - t) * 1e6)
            for r in rows:
                r.advance(token)
    out["batch8_fill_us"] = summary(batch, 1) | {"mean": round(statistics.mean(batch), 1)}
    out["llguidance"] = llguidance.__version__
    return out


def engine_overlap(model_dir: Path, tokens: int, runs: int, rows: int) -> dict:
    """Does the mask still overlap the forward pass inside the real engine?
    The worker's Scheduler in this process (the model, tokenizer and engine
    a worker runs, without the pipes). Each of `runs` runs decodes `rows`
    rows of `tokens` tokens unconstrained, then the same rows constrained,
    in which the decode steps alternate between the engine as it is (the
    masks filled on BatchMasks' side thread beside the forward pass) and
    the masks filled on the engine's thread before the forward pass is
    handed to mlx (on mlx's CPU backend: one after the other; on a GPU the
    device computes meanwhile either way): step by step, so that a busy
    spell on a shared machine hits both alike. Decode steps only, after
    every row's first token.

    Both of those run step by step (run_ahead off); a third constrained run
    of each round runs ahead (the next forward pass built right after the
    masked draw, TokenGenerator.run_ahead, the engine's default), and a
    fourth runs ahead handing that pass to mlx at once (the CPU's way, which
    a GPU's default leaves to the next step: `ahead_handed_at_once`).

    Then a constrained run with probes in its steps: how long the side
    thread filled the masks, how long the engine thread then waited for
    them, and whether the forward pass was still running once they were
    ready (an mx.eval of the logits before the masks are applied). Where it
    was, no mask time was exposed; elsewhere at most the wait."""
    import mlx.core as mx

    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler
    from worker.runtime.defaults import GIL_SWITCH_MS
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    # As in a worker (worker/runtime/defaults.py, GIL_SWITCH_MS).
    sys.setswitchinterval(GIL_SWITCH_MS / 1000)
    loaded = load(model_dir)
    engine = Scheduler(loaded, TextCodec(model_dir, loaded.config), lambda line: None, batch_memory=1 << 34, max_batch=rows, prefix_cache_bytes=0)
    engine.warm_up()
    masks = engine.masks
    real_fill, real_apply, side_thread = masks.fill, masks.apply, masks.fill_async
    current: dict = {}

    def on_this_thread(constraints):
        t = time.perf_counter()
        done = Future()
        done.set_result(real_fill(constraints))
        current["fill"] = time.perf_counter() - t
        return done

    def timed_fill(constraints):
        t = time.perf_counter()
        bits = real_fill(constraints)
        current["fill"] = time.perf_counter() - t
        return bits

    def probed(constraints):
        return _TimedResult(side_thread(constraints), current)

    def probed_apply(logits, bits):
        t = time.perf_counter()
        mx.eval(logits)
        current["forward_left"] = time.perf_counter() - t
        return real_apply(logits, bits)

    modes = {"none": side_thread, "overlapped": side_thread, "ahead": side_thread, "masks_first": on_this_thread, "probed": probed}
    text = schema_format(LONG)
    rid = iter(range(1, 1 << 30))

    default_hand_over = engine.generator.hand_over_at_once

    def decode(constrained: bool, mode_of, run_ahead: bool = False, at_once: bool | None = None) -> list[dict]:
        """One step record per decode step: its mode, seconds, and probes."""
        engine.generator.run_ahead = run_ahead
        engine.generator.hand_over_at_once = default_hand_over if at_once is None else at_once
        for seed in range(rows):
            engine.submit(Generate(rid=next(rid), prompt=PROMPT, max_tokens=tokens, seed=seed, response_format=text if constrained else None), 0.0)
        while len(engine.generator.decoding) < rows or any(not s.generated for s in engine.streams.values()):
            if not engine.waiting and len(engine.streams) < rows:
                raise RuntimeError("a row failed (see the log above)")
            engine.step()
        steps = []
        while engine.generator:
            mode = mode_of(len(steps))
            masks.fill_async = modes[mode]
            current.clear()
            t = time.perf_counter()
            engine.step()
            steps.append({"mode": mode, "s": time.perf_counter() - t, **current})
        masks.fill_async = side_thread
        return steps

    def mean_ms(steps: list[dict], mode: str, key: str = "s") -> float:
        return statistics.mean(s[key] for s in steps if s["mode"] == mode and key in s) * 1000

    decode(True, lambda k: "overlapped")  # the grammar compiles here
    none, overlapped, masks_first, ahead, at_once, fill_ms, hidden, ratio, probes = [], [], [], [], [], [], [], [], []
    for _ in range(runs):
        free = decode(False, lambda k: "none")
        steps = decode(True, lambda k: ("overlapped", "masks_first")[k % 2])
        ahead.append(mean_ms(decode(True, lambda k: "ahead", run_ahead=True), "ahead"))
        at_once.append(mean_ms(decode(True, lambda k: "ahead", run_ahead=True, at_once=True), "ahead"))
        none.append(mean_ms(free, "none"))
        overlapped.append(mean_ms(steps, "overlapped"))
        masks_first.append(mean_ms(steps, "masks_first"))
        fill_ms.append(mean_ms(steps, "masks_first", "fill"))
        hidden.append((masks_first[-1] - overlapped[-1]) / fill_ms[-1])
        ratio.append(none[-1] / overlapped[-1])
        masks.fill, masks.apply = timed_fill, probed_apply
        probes += decode(True, lambda k: "probed")
        masks.fill, masks.apply = real_fill, real_apply
    # A probed step's masks took `fill`; the engine thread waited `wait` for
    # them after handing over the forward pass; if that pass was still
    # running once they were ready (`forward_left` beyond an mx.eval's own
    # cost), none of the mask time was exposed, else at most the wait.
    ready_first = [p["forward_left"] > 1e-4 for p in probes]
    exposed = sum(0.0 if first else p["wait"] for first, p in zip(ready_first, probes))
    filled = sum(p["fill"] for p in probes)
    out = {
        "model": model_dir.name,
        "rows": rows,
        "tokens": tokens,
        "runs": runs,
        "ms_per_step": {
            "none": summary(none, 2),
            "overlapped": summary(overlapped, 2),
            "masks_first": summary(masks_first, 2),
            "ahead": summary(ahead, 2),
            "ahead_handed_at_once": summary(at_once, 2),
            "masks_alone": summary(fill_ms, 2),
        },
        "share_of_masks_hidden": summary(hidden, 2),
        "ratio_overlapped_vs_none": round(statistics.median(ratio), 3),
        "ratio_ahead_vs_none": round(statistics.median([n / a for n, a in zip(none, ahead)]), 3),
        "probed": {
            "steps": len(probes),
            "masks_ms_per_step": round(filled / len(probes) * 1000, 3),
            "masks_ready_before_the_forward_pass_ended": round(sum(ready_first) / len(probes), 3),
            "exposed_mask_ms_per_step_at_most": round(exposed / len(probes) * 1000, 3),
            "share_of_masks_hidden_at_least": round(1 - exposed / filled, 3),
        },
    }
    # The model goes before clear_cache; `decode` above shares the cell, so
    # it is emptied rather than deleted.
    engine = loaded = None
    mx.clear_cache()
    return out


class _TimedResult:
    """A pending mask fill whose result() records how long its caller waited."""

    def __init__(self, pending: Future, record: dict):
        self.pending, self.record = pending, record

    def result(self):
        t = time.perf_counter()
        bits = self.pending.result()
        self.record["wait"] = time.perf_counter() - t
        return bits


def _main_thread_cpu(proc) -> float:
    """CPU seconds of a process's first thread (on Linux its id is the pid)."""
    for thread in proc.threads():
        if thread.id == proc.pid:
            return thread.user_time + thread.system_time
    return 0.0


def gil_handover(model_dir: Path, steps: int, rows: int = 8, busy_ms: float = 4.0, intervals: tuple[float, ...] = (5, 1, 0.5, 0.2)) -> dict:
    """How late a batch's masks come back while the engine thread is busy in
    Python (on a GPU a small model's engine thread builds its step's graph
    for most of the step): the worker's BatchMasks filling `rows` rows of the
    bounded schema on its side thread, each row advanced by a random allowed
    token (seeded) every step, at several GIL switch intervals (worker
    --gil-switch-ms). Steps alternate between the engine thread waiting for
    the masks at once (`alone`) and running `busy_ms` of Python first
    (`busy`); a fill's time ends when its result is set on the side thread,
    which takes the GIL."""
    import numpy as np
    from tokenizers import Tokenizer

    from worker.engine.constrain import BatchMasks, Constraints

    tok_json = (model_dir / "tokenizer.json").read_text()
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]  # Qwen3 keeps it at the top
    tokenizer = Tokenizer.from_str(tok_json)
    eos = {tokenizer.token_to_id("<|im_end|>")}
    constraints = Constraints(tok_json, vocab, eos, lexers=rows)
    masks = BatchMasks(vocab, eos)  # as a worker's: default_mask_threads()
    text = schema_format(LONG)
    rng = np.random.default_rng(0)
    real = tokenizer.get_vocab_size()

    def busy(seconds: float) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += sum(range(50))
        return n

    before = sys.getswitchinterval()
    out: dict = {
        "model": model_dir.name,
        "rows": rows,
        "busy_ms": busy_ms,
        "steps": steps,
        "mask_threads": masks.threads,
        "unit": "ms from submitting a batch's masks to its result being set",
        "by_switch_ms": {},
    }
    try:
        for interval in intervals:
            sys.setswitchinterval(interval / 1000)
            live = [constraints.row(text, []) for _ in range(rows)]
            took: dict[str, list[float]] = {"alone": [], "busy": []}
            for step in range(steps):
                side = ("alone", "busy")[step % 2]
                done_at: list[float] = []
                t = time.perf_counter()
                pending = masks.fill_async(live)
                pending.add_done_callback(lambda _, at=done_at: at.append(time.perf_counter()))
                if side == "busy":
                    busy(busy_ms / 1000)
                bits = pending.result()
                while not done_at:  # set_result() wakes result() before it runs the callbacks
                    time.sleep(0)
                took[side].append((done_at[0] - t) * 1000)
                allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :real]
                for i, row in enumerate(live):
                    ids = np.flatnonzero(allowed[i])
                    if row.done or ids.size == 0:
                        live[i] = constraints.row(text, [])
                    else:
                        row.advance(int(rng.choice(ids)))
            out["by_switch_ms"][f"{interval:g}"] = {side: summary(v, 3) for side, v in took.items()}
            print(f"switch {interval:g} ms: {json.dumps(out['by_switch_ms'][f'{interval:g}'])}", file=sys.stderr)
    finally:
        sys.setswitchinterval(before)
    return out


def worker_decode(
    model_dir: Path,
    tokens: int,
    rounds: int,
    pairs: int,
    batches: list[int],
    mask_threads: int | None = None,
    switch_ms: float | None = None,
    schema: dict = LONG,
) -> dict:
    """Through a real worker process and its pipes, as the pool drives it:
    decode tok/s of N rows with a JSON-schema constraint vs none, the same
    prompt and seeds; then the first-token cost of a constraint (TTFT of a
    lone request with no response_format, a schema never seen, the same
    schema again). Each round starts a fresh worker, whose first
    constrained request also builds the tokenizer view; within it the two
    sides run in `pairs` back-to-back pairs (order alternating), and each
    pair gives a ratio, so that the load of a shared machine hits both
    sides of a ratio alike. Also the worker's CPU time per token (all its
    threads, and its engine thread alone): work, where tok/s is latency."""
    import psutil

    from harness.worker import WorkerProc

    text = schema_format(schema)
    sides = ("none", "json_schema")
    runs: dict[int, dict[str, list[dict]]] = {n: {side: [] for side in sides} for n in batches}
    ttft: dict[str, list[float]] = {"none": [], "new_schema": [], "cached_schema": [], "first_constrained_request": []}
    names = iter(range(1 << 30))
    flags = ("--mask-threads", str(mask_threads)) if mask_threads else ()
    flags += ("--gil-switch-ms", str(switch_ms)) if switch_ms else ()
    for _ in range(rounds):
        client = WorkerProc.started(model_dir, "--max-batch", str(max(batches)), "--prefix-cache-bytes", "0", *flags)
        proc = psutil.Process(client.proc.pid)
        try:
            first = client.generate(prompt=PROMPT, max_tokens=2, response_format=schema_format(schema, f"first{next(names)}"))
            ttft["first_constrained_request"].append(first["ttft_ms"])
            for n in batches:
                for i in range(pairs):
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        cpu, main = sum(proc.cpu_times()[:2]), _main_thread_cpu(proc)
                        run = client.generate_many(
                            [dict(prompt=PROMPT, max_tokens=tokens, seed=s, response_format=text if side == "json_schema" else None) for s in range(n)]
                        )
                        run["cpu_s"] = sum(proc.cpu_times()[:2]) - cpu
                        run["main_cpu_s"] = _main_thread_cpu(proc) - main
                        runs[n][side].append(run)
            for _ in range(5):
                new = schema_format(schema, f"new{next(names)}")
                for name, fmt in (("none", None), ("new_schema", new), ("cached_schema", new)):
                    ttft[name].append(client.generate(prompt=PROMPT, max_tokens=2, response_format=fmt)["ttft_ms"])
        finally:
            client.close()

    def decode_rate(run: dict) -> float:
        # From the moment every row has its first token to the last final line.
        n = len(run["ttft_ms"])
        return (run["tokens"] - n) / ((max(run["done_ms"]) - max(run["ttft_ms"])) / 1000)

    out: dict = {
        "model": model_dir.name,
        "tokens": tokens,
        "rounds": rounds,
        "pairs_per_round": pairs,
        "mask_threads": mask_threads or "default",
        "gil_switch_ms": switch_ms or "default",
        "schema": next(name for name, s in SCHEMAS.items() if s is schema),
    }
    for n in batches:
        rates = {side: [decode_rate(r) for r in runs[n][side]] for side in sides}
        cpu_ms = {side: [r["cpu_s"] * 1000 / r["tokens"] for r in runs[n][side]] for side in sides}
        main_ms = {side: [r["main_cpu_s"] * 1000 / r["tokens"] for r in runs[n][side]] for side in sides}
        out[f"rows{n}"] = {
            "decode_tok_s": {side: summary(v, 1) for side, v in rates.items()},
            "cpu_ms_per_token": {side: summary(v, 3) for side, v in cpu_ms.items()},
            # The engine's own thread (the rest: the frame reader, mlx's and llguidance's threads).
            "main_thread_cpu_ms_per_token": {side: summary(v, 3) for side, v in main_ms.items()},
            "tokens": {side: sorted({r["tokens"] for r in runs[n][side]}) for side in sides},
            "ratio_json_schema_vs_none": round(statistics.median(c / f for c, f in zip(rates["json_schema"], rates["none"])), 3),
            "cpu_ratio_none_vs_json_schema": round(statistics.median(f / c for c, f in zip(cpu_ms["json_schema"], cpu_ms["none"])), 3),
        }
        print(f"{model_dir.name} {n} rows: {json.dumps(out[f'rows{n}'])}", file=sys.stderr)
    med = {name: statistics.median(v) for name, v in ttft.items()}
    out["ttft_ms"] = {name: summary(v, 2) for name, v in ttft.items()}
    out["first_token_cost_ms"] = {name: round(med[name] - med["none"], 2) for name in ("new_schema", "cached_schema", "first_constrained_request")}
    return out


def engine_thread_profile(model_dir: Path, tokens: int, runs: int, rows: int, top: int = 25) -> dict:
    """Where a worker's engine thread spends its time, free and constrained.
    cProfile (which sees the main thread only: the engine's) runs three
    workers: one that starts, decodes one short batch of each side and
    stops (the baseline), and one per side that then decodes `runs`
    batches of `rows` rows of `tokens` tokens; a side's figures less the
    baseline's, per decode step (a step: `rows` tokens), leave its decoding
    alone: the `top` costliest functions of each side and the largest
    differences. cProfile slows Python code, so the figures say where, not
    how fast."""
    import pstats
    import tempfile

    from harness.worker import WorkerProc
    from ipc.messages import Shutdown

    text = schema_format(LONG)

    def batch(n_tokens: int, constrained: bool) -> list[dict]:
        return [dict(prompt=PROMPT, max_tokens=n_tokens, seed=s, response_format=text if constrained else None) for s in range(rows)]

    def profiled(path: Path, side: str | None) -> tuple[dict[str, float], int]:
        client = WorkerProc.started(model_dir, "--max-batch", str(rows), "--prefix-cache-bytes", "0", profile=path)
        steps = 0
        try:
            for constrained in (False, True):
                client.generate_many(batch(2, constrained))
            for _ in range(runs if side else 0):
                steps += client.generate_many(batch(tokens, side == "json_schema"))["tokens"] // rows
            client.send(Shutdown())
            client.proc.wait(timeout=60)
        finally:
            client.close()
        # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
        stats = pstats.Stats(str(path)).stats
        # Built-ins' names carry their object's address, which differs per worker.
        return {re.sub(r" at 0x[0-9a-f]+", "", f"{Path(f).name}:{line}({name})"): t[2] * 1000 for (f, line, name), t in stats.items()}, steps

    with tempfile.TemporaryDirectory(prefix="lattice-bench-profile-") as tmp:
        base, _ = profiled(Path(tmp) / "base.prof", None)
        per_step = {}
        for side in ("none", "json_schema"):
            ms, steps = profiled(Path(tmp) / f"{side}.prof", side)
            per_step[side] = {n: (t - base.get(n, 0.0)) / steps for n, t in ms.items()}
    free, constrained = per_step["none"], per_step["json_schema"]
    diff = {n: constrained.get(n, 0.0) - free.get(n, 0.0) for n in set(free) | set(constrained)}
    return {
        "model": model_dir.name,
        "rows": rows,
        "unit": "ms per decode step on the engine thread, under cProfile, less a baseline worker's start-up",
        "total": {side: round(sum(v.values()), 3) for side, v in per_step.items()},
        "top": {side: {n: round(ms, 4) for n, ms in sorted(v.items(), key=lambda kv: -kv[1])[:top]} for side, v in per_step.items()},
        "largest_differences": {n: round(d, 4) for n, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each a fresh worker or engine (default 3)")
    p.add_argument("--pairs", type=int, default=4, help="back-to-back pairs of constrained and free runs per round (default 4)")
    p.add_argument("--batches", default="1,8", help="concurrent rows (default 1,8)")
    p.add_argument("--parts", default="masks,overlap,worker", help="what to measure (default all: masks,overlap,worker; also: profile, gil)")
    p.add_argument("--models", default="demo,bpe-151k", help="tokenizers the worker part runs (default demo,bpe-151k)")
    p.add_argument("--mask-threads", default="", help="worker part: comma-separated --mask-threads values to compare (default: the worker's own)")
    p.add_argument("--gil-switch-ms", default="", help="worker part: comma-separated --gil-switch-ms values to compare (default: the worker's own)")
    p.add_argument("--schema", default="bounded", choices=sorted(SCHEMAS), help="the worker part's schema (default bounded: llguidance's costliest steps)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    import mlx.core as mx
    from tokenizers import Tokenizer

    backend = "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else "cpu")
    load_before = load_average()
    demo = demo_model(args.size)
    real = real_vocab_model(args.size)
    batches = [int(b) for b in args.batches.split(",")]
    parts = set(args.parts.split(","))
    result: dict = {"machine": machine(), "backend": backend, "masks": {}, "worker": {}, "complete": False}
    name = tagged(f"constrain-{backend}-{args.size}", args.tag)
    for label, model_dir in (("demo", demo), ("bpe-151k", real)) if "masks" in parts else ():
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "config.json").read_text())
        vocab = config.get("text_config", config)["vocab_size"]  # Qwen3 keeps it at the top
        eos = {tok.token_to_id("<|im_end|>")}
        masks = mask_costs(tok.to_str(), vocab, eos, lambda s: tok.encode(s, add_special_tokens=False).ids, args.rounds)
        masks["tokenizer_tokens"] = tok.get_vocab_size()
        result["masks"][label] = masks
        print(f"{label}: {json.dumps(masks)}", file=sys.stderr)
        write_result(name, result)  # each part as it ends: a later failure keeps it ("complete": false)
    if "gil" in parts:
        result["gil_handover"] = gil_handover(real, args.rounds * args.pairs * 20)
        write_result(name, result)
    if "overlap" in parts:
        result["engine_overlap"] = {f"rows{n}": engine_overlap(real, OVERLAP_TOKENS, args.rounds * args.pairs, n) for n in batches}
        print(f"engine overlap: {json.dumps(result['engine_overlap'])}", file=sys.stderr)
        write_result(name, result)
    threads = [int(t) for t in args.mask_threads.split(",") if t] or [None]
    switches = [float(t) for t in args.gil_switch_ms.split(",") if t] or [None]
    for label, model_dir in (("demo", demo), ("bpe-151k", real)) if "worker" in parts else ():
        if label not in args.models.split(","):
            continue
        for n, switch in itertools.product(threads, switches):
            key = label + (f"-threads{n}" if len(threads) > 1 else "") + (f"-switch{switch:g}ms" if len(switches) > 1 else "")
            result["worker"][key] = worker_decode(model_dir, args.tokens, args.rounds, args.pairs, batches, n, switch, SCHEMAS[args.schema])
            write_result(name, result)
    for label, model_dir in (("demo", demo), ("bpe-151k", real)) if "profile" in parts else ():
        if label in args.models.split(","):
            result.setdefault("engine_thread_profile", {})[label] = engine_thread_profile(model_dir, args.tokens, args.pairs, max(batches))
            print(f"{label} engine thread: {json.dumps(result['engine_thread_profile'][label])}", file=sys.stderr)
            write_result(name, result)
    result["load_average"] = {"before": load_before, "after": load_average()}
    result["complete"] = True
    write_result(name, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
