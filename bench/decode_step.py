"""Where a decode step goes, in one process: the model with argmax, with the
worker's sampler, with mlx-lm's sampler and logits processors, and one whole
request through the worker's scheduler. Each variant runs the same pipelined loop
(mx.async_eval one step ahead), twice; the second round is reported.

    python -m bench.decode_step [--size small|0.8b] [--tokens 128] [--batches 1,2,4,8]

With `--batches`, it also runs N greedy requests (no repetition penalty)
through the worker's scheduler, the same with its decode step built op by
op (`compile_decode` off), and through mlx-lm (stream_generate for N = 1,
batch_generate's engine above), alternated `--runs` times: the engines'
speeds without pipes or a client.

With `--head-runs R` (CPU), the argmax loop also runs R times with the LM
head cut over the CPU streams (worker.runtime.cpu_head, as the loader
leaves it) and R times with the same head whole, alternated.

mlx-lm's repetition penalty looks at the prompt only here (its window would
need the generated ids, read back with a sync every step).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--tag", default="")
    p.add_argument("--batches", help="comma-separated N: the batched engines compared in this process")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--head-runs",
        type=int,
        default=0,
        help="also time the argmax loop with the LM head cut over the CPU streams and whole, alternated, this many runs each (CPU)",
    )
    args = p.parse_args()

    from bench.common import load_average, load_model, machine, tagged, write_result

    path, loaded, codec = load_model(args.size)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from ipc.messages import Generate
    from ipc.sampling import Sampling
    from worker.engine.sampling import BatchSampler, RowSampling
    from worker.engine.scheduler import Scheduler

    model = loaded.model
    vocab = loaded.config.get("text_config", loaded.config)["vocab_size"]  # Qwen3 keeps it at the top
    text = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
    prompt = mx.array(codec.encode(text))
    n = args.tokens

    def loop(pick) -> float:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[None, :-1], cache=cache))
        y = pick(model(prompt[None, -1:], cache=cache)[:, -1, :], prompt[-1:])
        mx.async_eval(y)
        t0 = time.perf_counter()
        for _ in range(n):
            nxt = pick(model(y.reshape(1, 1), cache=cache)[:, -1, :], y)
            mx.async_eval(nxt)
            y.item()
            y = nxt
        return (time.perf_counter() - t0) / n * 1000

    ours = BatchSampler(vocab)
    ours.extend([RowSampling(Sampling(seed=1), vocab, prompt.tolist())])
    sampler = make_sampler(temp=0.7, top_p=0.9, top_k=50)
    processors = make_logits_processors(repetition_penalty=1.1)

    def mlx_lm(logits, _):
        for proc in processors:
            logits = proc(prompt, logits)
        return sampler(logits)

    sizes = [int(x) for x in args.batches.split(",")] if args.batches else [1]
    scheduler = Scheduler(loaded, codec, lambda line: None, batch_memory=1 << 30, prefix_cache_bytes=0, max_batch=max(sizes))

    def engine_run() -> float:
        t0 = time.perf_counter()
        scheduler.submit(Generate(rid=1, prompt=text, max_tokens=n, seed=1), t0)
        scheduler.drain()
        return (time.perf_counter() - t0) / n * 1000

    variants = {
        "argmax": lambda: loop(lambda logits, _: mx.argmax(logits, axis=-1)),
        "worker_sampler": lambda: loop(lambda logits, y: ours(logits, y)),
        "mlx_lm_sampler": lambda: loop(mlx_lm),
        "engine_run_incl_prefill": engine_run,
    }
    load_before = load_average()
    ms = {}
    for _ in range(2):
        ms = {name: round(fn(), 3) for name, fn in variants.items()}
    result = {"size": args.size, "tokens": n, "ms_per_token": ms, "sampler_ratio": round(ms["mlx_lm_sampler"] / ms["worker_sampler"], 3)}
    if args.head_runs:
        result["head"] = head_ab(model, lambda: loop(lambda logits, _: mx.argmax(logits, axis=-1)), args.head_runs)
        print(f"argmax loop, LM head cut / whole (time): {result['head'].get('cut_over_whole', result['head'].get('note'))}")
    if args.batches:
        eager = Scheduler(loaded, codec, lambda line: None, batch_memory=1 << 30, prefix_cache_bytes=0, max_batch=max(sizes), compile_decode=False)
        result["batched"] = batched_engines(loaded, codec, scheduler, eager, sizes, n, args.runs)
    result.update(machine=machine(), load_average={"before": load_before, "after": load_average()})
    backend = "cuda" if mx.cuda.is_available() else ("metal" if mx.metal.is_available() else "cpu")
    write_result(tagged(f"decode-step-{backend}-{args.size}", args.tag), result)
    for name, value in ms.items():
        print(f"{name:26}{value:9.2f} ms/token")
    print(f"mlx-lm sampler / worker sampler: {result['sampler_ratio']} (above 1: the worker's step is faster)")
    for row in result.get("batched", []):
        print(
            f"N={row['n']:<3} worker {row['worker_tok_s']:8.1f} tok/s  eager {row['eager_tok_s']:8.1f}  mlx-lm {row['mlx_lm_tok_s']:8.1f}"
            f"  ratio {row['ratio']} (eager {row['eager_ratio']})"
        )
    return 0


def head_ab(model, run, runs: int) -> dict:
    """The argmax loop with the LM head cut over the CPU streams
    (worker.runtime.cpu_head, as the loader leaves it) and with the same
    head whole, alternated `runs` times each: ms per token, their medians
    and the per-run ratio (below 1: the cut head is faster)."""
    import mlx.nn as nn

    from bench.common import median, summary
    from worker.runtime import cpu_head
    from worker.runtime.parts import head_module

    head = head_module(model)
    cut = type(head)
    if cut not in (cpu_head._CutLinear, cpu_head._CutEmbedding):
        return {"note": f"the head is not cut here ({cut.__name__})"}
    whole = nn.Linear if cut is cpu_head._CutLinear else nn.Embedding
    ms: dict[str, list[float]] = {"cut": [], "whole": []}
    for r in range(runs):
        for side in ("cut", "whole") if r % 2 == 0 else ("whole", "cut"):
            head.__class__ = cut if side == "cut" else whole
            ms[side].append(round(run(), 2))
    head.__class__ = cut
    ratios = [c / w for c, w in zip(ms["cut"], ms["whole"])]
    return {"ms_per_token": ms, "cut_ms": median(ms["cut"]), "whole_ms": median(ms["whole"]), "cut_over_whole": summary(ratios)}


def batched_engines(loaded, codec, scheduler, eager, sizes: list[int], tokens: int, runs: int) -> list[dict]:
    from mlx_lm.generate import stream_generate
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from bench.chat import user_messages
    from bench.common import median
    from bench.mlx_lm_baseline import batch_run
    from ipc.messages import Generate

    tokenizer = load_tokenizer(loaded.path)
    prompts = [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in user_messages(codec.tokenizer, max(sizes), 24)]
    ids = [codec.encode(p) for p in prompts]

    def ours(n: int, scheduler=scheduler) -> float:
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts[:n]):
            scheduler.submit(Generate(rid=i, prompt=prompt, max_tokens=tokens, temperature=0.0, repetition_penalty=1.0), t0)
        made = scheduler.drain()
        return sum(len(v) for v in made.values()) / (time.perf_counter() - t0)

    def theirs(n: int) -> float:
        if n > 1:
            run = batch_run(loaded.model, tokenizer, ids[:n], tokens)
            return run["tokens"] / run["wall_s"]
        t0 = time.perf_counter()
        made = sum(1 for _ in stream_generate(loaded.model, tokenizer, ids[0], max_tokens=tokens))
        return made / (time.perf_counter() - t0)

    rows = []
    for n in sizes:
        ours(n), ours(n, eager), theirs(n)  # warm-up
        runs_n = [(ours(n), ours(n, eager), theirs(n)) for _ in range(runs)]
        rows.append(
            {
                "n": n,
                "worker_tok_s": round(median([a for a, _, _ in runs_n]), 1),
                "eager_tok_s": round(median([e for _, e, _ in runs_n]), 1),
                "mlx_lm_tok_s": round(median([b for _, _, b in runs_n]), 1),
                "ratio": round(median([a / b for a, _, b in runs_n]), 3),
                "eager_ratio": round(median([e / b for _, e, b in runs_n]), 3),
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
