"""Warm prompts: prefilled while the worker loads, kept in its prefix cache
whatever else comes and goes."""

from harness.prompts import SYSTEM, chatml
from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Generate

WARM = f"<|im_start|>system\n{SYSTEM} Tools: river_depth(place), mill_hours(day).<|im_end|>\n"

_rid = iter(range(1, 1_000_000))


def ask(w, prompt: str) -> tuple[str, dict]:
    w.send(Generate(rid=next(_rid), prompt=prompt, temperature=0.0, max_tokens=8))
    events = w.collect()
    return text_of(events), terminal(events)


def warm_tokens(model_dir) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(WARM, add_special_tokens=False).ids)


def test_a_warm_prompt_serves_the_first_request_and_is_never_evicted(tiny_model):
    # Room for a few snapshots of these prompts: the others push each other out.
    w = WorkerProc(tiny_model, "--warm-prompt", WARM, "--prefix-cache-bytes", "400000")
    try:
        w.wait_ready()
        n = warm_tokens(tiny_model)
        _, done = ask(w, WARM + "<|im_start|>user\nHow deep is the river?<|im_end|>\n<|im_start|>assistant\n")
        assert done["cached_tokens"] == n
        others = [chatml([("user", f"Question {i} about the bridge.")], f"Another system prompt, number {i}.") for i in range(6)]
        for prompt in others:
            ask(w, prompt)
        # The first of the others was pushed out...
        _, done = ask(w, others[0][: -len("<|im_start|>assistant\n")] + "<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n")
        assert done.get("cached_tokens", 0) < done["prompt_tokens"] // 2
        # ...the warm prompt was not.
        _, done = ask(w, WARM + "<|im_start|>user\nWhen does the mill open?<|im_end|>\n<|im_start|>assistant\n")
        assert done["cached_tokens"] == n
    finally:
        assert w.close() == 0


def test_pool_warm_prompt_from_a_file(tiny_model, tmp_path, spawn_pool):
    path = tmp_path / "agent.txt"
    path.write_text(WARM)
    config = tmp_path / "pool.toml"
    config.write_text(
        f'prefix_cache_disk_bytes = 0\n[[models]]\nname = "agent"\npath = "{tiny_model}"\npreload = true\n'
        f'warm_prompts = [{{ file = "{path}" }}, "-<|im_start|>system\\nShort.<|im_end|>\\n"]\n'
    )
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="agent")
    done = pool.generate({"model": "agent", "id": 1, "prompt": WARM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "max_tokens": 4})
    assert done["cached_tokens"] == warm_tokens(tiny_model)
    assert pool.close() == 0
    assert pool.stderr.count(b"warm prompt of") == 2
