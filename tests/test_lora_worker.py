"""LoRA through real worker processes: `--lora` at start, SetAdapter swaps,
and broken adapters, against a model with the same update merged in."""

import hashlib

import mlx.core as mx
import pytest

from ipc.messages import Generate, SetAdapter, Stats
from tests.conftest import keep_alive_across_tests, release
from tests.lora_files import BAD_KINDS, deltas, lora_pairs, targets_of, write_bad, write_merged_model, write_mlx, write_mlx_lm, write_peft
from tests.workerproc import WorkerProc, terminal, text_of

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nWhat did the miller say?<|im_end|>\n<|im_start|>assistant\n"
RANK, ALPHA = 4, 8.0

_rid = iter(range(1, 1_000_000))


def greedy(w, prompt=CHAT, max_tokens=60) -> str:
    w.send(Generate(rid=next(_rid), prompt=prompt, temperature=0.0, max_tokens=max_tokens))
    events = w.collect()
    assert terminal(events)["ev"] == "gen_token"
    return text_of(events)


def set_adapter(w, path) -> dict:
    w.send(SetAdapter(path=None if path is None else str(path)))
    return w.next_event()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """One update written in all three formats (each scaling it by 2), and a
    model with that update merged into its weights.

    Strong enough that greedy text follows the adapter's scale (2x gives
    other text; 1.25x gave the same text on an Intel Xeon) while bf16
    rounding of merged vs unfused does not flip a token.
    """
    root = tmp_path_factory.mktemp("lora")
    pairs = lora_pairs(targets_of(tiny_model), rank=RANK, seed=21, strength=2.0)
    return {
        "peft_scale_2x": write_peft(root / "peft-alpha16", pairs, r=RANK, alpha=ALPHA * 2),
        "peft": write_peft(root / "peft", pairs, r=RANK, alpha=ALPHA),
        "mlx": write_mlx(root / "chat_metal.safetensors", pairs, alpha=ALPHA),
        "mlx-lm": write_mlx_lm(root / "mlx_lm", pairs, rank=RANK, scale=ALPHA / RANK),
        "merged_model": write_merged_model(tiny_model, root / "merged", deltas(pairs, ALPHA / RANK)),
    }


def run_once(model, *args, prompts=(CHAT, OTHER)) -> tuple[dict, list[str]]:
    w = WorkerProc(model, *args)
    try:
        ready = w.wait_ready()
        return ready, [greedy(w, p) for p in prompts]
    finally:
        assert w.close() == 0


@pytest.fixture(scope="module")
def merged_texts(adapters):
    return run_once(adapters["merged_model"])[1]


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = WorkerProc(tiny_model)
    keep_alive_across_tests(w.pid)
    w.wait_ready()
    w.base_texts = [greedy(w, CHAT), greedy(w, OTHER)]
    yield w
    release(w.pid)
    assert w.close() == 0


@pytest.mark.parametrize("fmt", ["peft", "mlx", "mlx-lm"])
def test_adapter_at_start_generates_like_the_merged_model(adapters, tiny_model, merged_texts, worker, fmt):
    ready, texts = run_once(tiny_model, "--lora", str(adapters[fmt]))
    assert ready["lora"] == str(adapters[fmt])
    assert texts == merged_texts
    assert texts != worker.base_texts


def test_set_adapter_swaps_and_none_restores_the_base_exactly(adapters, merged_texts, worker, tiny_model):
    for fmt in ("peft", "mlx", "mlx-lm"):
        loaded = set_adapter(worker, adapters[fmt])
        assert list(loaded)[:5] == ["ev", "model", "lora", "sha256", "ms"], loaded
        assert loaded["ev"] == "adapter_loaded" and loaded["lora"] == str(adapters[fmt]) and loaded["format"] == fmt
        assert isinstance(loaded["ms"], int) and loaded["ms"] >= 0
        assert [greedy(worker, CHAT), greedy(worker, OTHER)] == merged_texts
    lm_dir = adapters["mlx-lm"]
    lm_content = (lm_dir / "adapters.safetensors").read_bytes() + (lm_dir / "adapter_config.json").read_bytes()
    assert loaded["sha256"] == hashlib.sha256(lm_content).hexdigest()
    # The comparison can tell scales apart: the same tensors at 2x differ.
    assert set_adapter(worker, adapters["peft_scale_2x"])["ev"] == "adapter_loaded"
    assert [greedy(worker, CHAT), greedy(worker, OTHER)] != merged_texts
    single = adapters["mlx"]
    assert set_adapter(worker, single)["sha256"] == hashlib.sha256(single.read_bytes()).hexdigest()

    worker.send(Stats())
    stats = worker.next_event()
    # A and B take the layers' dtype: float32 when the worker computes on CPU.
    itemsize = 4 if mx.default_device() == mx.cpu else 2
    assert stats["adapter_bytes"] == sum(itemsize * RANK * (d_in + d_out) for d_in, d_out in targets_of(tiny_model).values())

    cleared = set_adapter(worker, None)
    assert cleared["ev"] == "adapter_loaded" and cleared["lora"] is None and cleared["sha256"] is None
    assert [greedy(worker, CHAT), greedy(worker, OTHER)] == worker.base_texts
    worker.send(Stats())
    assert worker.next_event()["adapter_bytes"] == 0


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_at_start_exits_78_with_its_message(tmp_path, tiny_model, kind):
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets_of(tiny_model), seed=23))
    w = WorkerProc(tiny_model, "--lora", str(path))
    assert w.proc.wait(timeout=120) == 78
    w.close()
    err = w.stderr.decode()
    assert "bad adapter" in err and phrase in err and name in err, err


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_by_set_adapter_keeps_the_old_one(tmp_path, tiny_model, adapters, merged_texts, worker, kind):
    assert set_adapter(worker, adapters["peft"])["ev"] == "adapter_loaded"
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets_of(tiny_model), seed=24))
    error = set_adapter(worker, path)
    assert list(error) == ["ev", "model", "lora", "code", "msg", "_line"]
    assert error["ev"] == "adapter_error" and error["code"] == "adapter_error" and error["lora"] == str(path)
    assert phrase in error["msg"] and name in error["msg"]
    assert greedy(worker, CHAT) == merged_texts[0]


def test_swap_waits_for_the_running_request(adapters, merged_texts, worker):
    """A request started before the swap finishes on the adapter it began with."""
    assert set_adapter(worker, None)["ev"] == "adapter_loaded"
    long_base = greedy(worker, max_tokens=300)
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=300))
    first = worker.next_event()
    assert first["ev"] == "gen_token"
    worker.send(SetAdapter(path=str(adapters["peft"])))
    events = [first] + worker.collect()
    assert text_of(events) == long_base
    assert worker.next_event()["ev"] == "adapter_loaded"
    assert greedy(worker, CHAT) == merged_texts[0]


def test_requests_sent_after_a_swap_wait_for_it_and_run_on_the_new_adapter(adapters, merged_texts, worker):
    """Batching: while a swap waits for the running request, later requests
    wait too (they do not join the old version's batch), then run on the
    new adapter."""
    assert set_adapter(worker, None)["ev"] == "adapter_loaded"
    long_base = greedy(worker, max_tokens=300)
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=300, id_json='"old"'))
    first = worker.next_event()
    assert first["ev"] == "gen_token" and first["id"] == "old"
    worker.send(SetAdapter(path=str(adapters["peft"])))
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=60, id_json='"new"'))
    events = [first]
    while not (events[-1]["ev"] == "gen_token" and events[-1]["id"] == "new" and events[-1]["done"]):
        events.append(worker.next_event())
    order = [(e["ev"], e.get("id"), e.get("done")) for e in events]
    old_done = order.index(("gen_token", "old", True))
    loaded = order.index(("adapter_loaded", None, None))
    new_first = next(i for i, e in enumerate(events) if e.get("id") == "new")
    assert old_done < loaded < new_first
    assert text_of([e for e in events if e.get("id") == "old"]) == long_base
    assert text_of([e for e in events if e.get("id") == "new"]) == merged_texts[0]


def test_quantized_base_with_adapter_generates_and_differs(tiny_q4_model, tmp_path):
    adapter = write_peft(tmp_path / "q4", lora_pairs(targets_of(tiny_q4_model), rank=RANK, seed=25), r=RANK, alpha=ALPHA)
    w = WorkerProc(tiny_q4_model, "--lora", str(adapter))
    try:
        ready = w.wait_ready()
        assert ready["format"] == "q4" and ready["lora"] == str(adapter)
        adapted = greedy(w)
        assert adapted
        w.send(Stats())
        stats = w.next_event()
        assert stats["adapter_bytes"] > 0
        assert set_adapter(w, None)["ev"] == "adapter_loaded"
        base = greedy(w)
        assert base and base != adapted
        assert set_adapter(w, adapter)["ev"] == "adapter_loaded"
        assert greedy(w) == adapted
    finally:
        assert w.close() == 0
