"""Quantized attention caches (kv_bits) in the batched engine: close to the
model's dtype, batched like any other, with the prefix cache."""

import pytest

from harness.engine import run
from harness.prompts import chatml
from ipc.messages import Generate

PROMPTS = ["<|im_start|>user\n" + "Tell me about the river and the mill. " * k + "<|im_end|>\n<|im_start|>assistant\n" for k in (1, 3, 6, 12)]


@pytest.fixture(scope="module")
def plain(tiny_model):
    from worker.runtime.loader import load

    return load(tiny_model)


def quantized(model_dir, bits: int):
    from worker.engine import kv_quant
    from worker.runtime.loader import load

    loaded = load(model_dir)
    kv_quant.install(loaded.model, bits, 32)
    return loaded


def forced_logits(model, ids: list[int], path: list[int] | None, steps: int):
    """Logits after the prompt and after each following token: `path`'s
    (teacher forced), or the greedy ones (then returned as the path too)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array(ids)[None], cache=cache)[0, -1]]
    greedy = []
    for i in range(steps):
        t = path[i] if path is not None else int(mx.argmax(out[-1]).item())
        greedy.append(t)
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return out, greedy


@pytest.mark.parametrize("bits, tolerance", [(8, 0.15), (4, 3.0)])
def test_quantized_logits_stay_near_the_models_dtype(tiny_model, plain, bits, tolerance):
    import mlx.core as mx

    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, plain.config)
    q = quantized(tiny_model, bits)
    agree = checked = 0
    for prompt in PROMPTS:
        ids = codec.encode(prompt)
        ref, path = forced_logits(plain.model, ids, None, 12)
        got, _ = forced_logits(q.model, ids, path, 12)
        for a, b in zip(ref, got):
            # Measured on this model: 8 bits 0.045 at most, 4 bits 1.15.
            assert mx.abs(a - b).max().item() < tolerance
            top = mx.sort(a)[-2:].tolist()
            if top[1] - top[0] > 2 * tolerance:
                checked += 1
                agree += int(mx.argmax(a).item()) == int(mx.argmax(b).item())
    assert agree == checked
    if bits == 8:
        assert checked > 20


def test_quantized_rows_batch_resume_and_are_smaller(tiny_model):
    from worker.engine.kv_quant import BatchQuantKV
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    def engine(bits):
        loaded = quantized(tiny_model, bits) if bits else load(tiny_model)
        lines: list[bytes] = []
        s = Scheduler(loaded, TextCodec(tiny_model, loaded.config), lines.append, batch_memory=1 << 30, prefill_step=16)
        s.lines = lines
        return s

    base, q8, q4 = engine(None), engine(8), engine(4)
    # The memory guard counts the smaller rows.
    assert base.row_fixed_bytes == q8.row_fixed_bytes == q4.row_fixed_bytes
    assert q4.row_token_bytes < q8.row_token_bytes <= 0.55 * base.row_token_bytes
    assert q8.generator.can_batch and q8.max_batch > 1 and q8.prefix_cache.supported

    # A batch of rows of different lengths, joining together: each gives
    # what it gives alone (float noise aside, far below these margins).
    seen = []
    original = q8.generator._join

    def spy(rows, cache):
        seen.extend(type(c) for c in cache.layers)
        return original(rows, cache)

    q8.generator._join = spy
    for i, prompt in enumerate(PROMPTS):
        q8.submit(Generate(rid=i, prompt=prompt, temperature=0.0, max_tokens=10, id_json=str(i)), 0.0)
    together = q8.drain()
    assert BatchQuantKV in seen
    for i, prompt in enumerate(PROMPTS):
        q8.submit(Generate(rid=100 + i, prompt=prompt, temperature=0.0, max_tokens=10), 0.0)
        assert q8.drain()[100 + i] == together[i]

    # The prefix cache holds quantized snapshots and resumes from them.
    first = chatml([("user", "Where does the river bend?")], "A long system prompt about the mill and the bridge.")
    second = chatml([("user", "Where does the river bend?"), ("assistant", "ok"), ("user", "More.")], "A long system prompt about the mill and the bridge.")
    run(q8, prompt=first)
    entry = next(iter(q8.prefix_cache._entries.values()))
    assert any(isinstance(layer, tuple) and isinstance(layer[0], tuple) and len(layer[0]) == 3 for layer in entry.layers)
    ids, done = run(q8, prompt=second)
    assert done["cached_tokens"] > 0
    # Resumed, it says what a quantized worker says without a prefix cache.
    fresh = engine(8)
    fresh.prefix_cache.budget = 0
    assert run(fresh, prompt=second)[0] == ids


def test_a_pool_serves_quantized_and_plain_models_side_by_side(tiny_model, tmp_path, spawn_pool):
    config = tmp_path / "pool.toml"
    config.write_text(
        f"prefix_cache_disk_bytes = 0\n"
        f'[[models]]\nname = "q8"\npath = "{tiny_model}"\nkv_bits = 8\nkv_group_size = 32\npreload = true\n'
        f'[[models]]\nname = "plain"\npath = "{tiny_model}"\npreload = true\n'
    )
    pool = spawn_pool("--config", str(config))
    for name in ("q8", "plain"):
        pool.wait_ev("ready", model=name)
    requests = [{"model": m, "id": f"{m}{i}", "prompt": p, "temperature": 0, "max_tokens": 12} for m in ("q8", "plain") for i, p in enumerate(PROMPTS)]
    for r in requests:
        pool.send(r)
    texts = {r["id"]: (pool.terminal(r["id"]), pool.text(r["id"])) for r in requests}
    assert all(done["ev"] == "gen_token" for done, _ in texts.values())
    # Each row of the quantized model's batch gives its text alone.
    for i, prompt in enumerate(PROMPTS):
        alone = pool.generate({"model": "q8", "id": f"alone{i}", "prompt": prompt, "temperature": 0, "max_tokens": 12})
        assert alone["ev"] == "gen_token" and pool.text(f"alone{i}") == texts[f"q8{i}"][1]
    pool.send({"op": "status"})
    rows = {r["model"]: r for r in pool.wait_ev("status")["models"]}
    # Two workers; the quantized one batches (a worker that cannot reports max_batch 1).
    assert rows["q8"]["pid"] != rows["plain"]["pid"]
    assert rows["q8"]["max_batch"] == rows["plain"]["max_batch"] == 8
    assert b"attention caches quantized: 8 bits, groups of 32" in pool.stderr
    assert pool.close() == 0
