"""LoRA through real worker processes: `--lora` at start, SetAdapter (which
sets the default adapter, what requests without `lora` run with), and broken
adapters; and, in process on the same code, logits against a model with the
same update merged in. Several adapters at once: tests/test_lora_multi.py.

Greedy text is compared only between runs that compute exactly the same
thing (the same adapter at start or swapped in, no adapter and a cleared
one), so it cannot tie differently on another CPU; merged weights against
an unfused adapter differ by float rounding, so those compare logits."""

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Generate, SetAdapter, Stats, UnloadAdapter
from tests.conftest import GREEDY_MARGIN, keep_alive_across_tests, margins_of, release
from tests.lora_files import BAD_KINDS, deltas, lora_pairs, targets_of, use_only, write_bad, write_merged_model, write_mlx, write_mlx_lm, write_peft

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nWhat did the miller say?<|im_end|>\n<|im_start|>assistant\n"
RANK, ALPHA = 4, 8.0
FORMATS = ("peft", "mlx", "mlx-lm")

_rid = iter(range(1, 1_000_000))


def greedy(w, prompt=CHAT, max_tokens=60) -> str:
    w.send(Generate(rid=next(_rid), prompt=prompt, temperature=0.0, max_tokens=max_tokens))
    events = w.collect()
    assert terminal(events)["ev"] == "gen_token"
    return text_of(events)


def set_adapter(w, path) -> dict:
    w.send(SetAdapter(path=None if path is None else str(path)))
    return w.next_event()


def sha256sum(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """One update written in all three formats (each scaling it by 2; the
    tensors each format holds are the same floats, so all three compute
    exactly the same thing), the same tensors at 1.25x the scale, and a
    model with the update merged into its weights."""
    root = tmp_path_factory.mktemp("lora")
    pairs = lora_pairs(targets_of(tiny_model), rank=RANK, seed=21, strength=2.0)
    return {
        "peft_scale_1.25x": write_peft(root / "peft-alpha10", pairs, r=RANK, alpha=ALPHA * 1.25),
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
def start_texts(adapters, tiny_model):
    """Greedy texts of a worker started with `--lora` (the PEFT dir)."""
    return run_once(tiny_model, "--lora", str(adapters["peft"]))[1]


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = WorkerProc(tiny_model)
    keep_alive_across_tests(w.pid)
    w.wait_ready()
    w.base_texts = [greedy(w, CHAT), greedy(w, OTHER)]
    yield w
    release(w.pid)
    assert w.close() == 0


def test_logits_match_the_merged_model_and_follow_the_scale(adapters, tiny_model):
    """The worker's own loader and LoRA layers, in process: each format's
    logits are the merged model's within float32 rounding; the same tensors
    at 1.25x the scale are far outside that tolerance; clearing gives back
    the base logits bit for bit."""
    from worker.lora.formats import read_adapter
    from worker.lora.layers import LoRASlots
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    loaded = load(tiny_model)
    prompt = mx.array(TextCodec(tiny_model, loaded.config).encode(CHAT))[None]

    def logits(model) -> np.ndarray:
        return np.array(model(prompt)[0].astype(mx.float32), dtype=np.float64)

    def rel(a, b) -> float:
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    base = logits(loaded.model)
    merged = logits(load(adapters["merged_model"]).model)
    assert rel(base, merged) > 0.1, "the adapter should change the logits"
    slots = LoRASlots(loaded.model)
    # On CPU the worker computes in float32 (measured: 4e-7); on a GPU the
    # merged weights themselves are rounded to bf16.
    tolerance = 1e-4 if mx.default_device() == mx.cpu else 1e-2
    for fmt in FORMATS:
        use_only(slots, read_adapter(adapters[fmt], slots.targets))
        assert rel(logits(loaded.model), merged) < tolerance, fmt
    use_only(slots, read_adapter(adapters["peft_scale_1.25x"], slots.targets))
    assert rel(logits(loaded.model), merged) > 5 * tolerance  # measured: 0.11
    use_only(slots, None)
    assert (logits(loaded.model) == base).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_adapter_at_start_generates_the_same_in_every_format(adapters, tiny_model, start_texts, worker, fmt):
    ready, texts = run_once(tiny_model, "--lora", str(adapters[fmt])) if fmt != "peft" else (None, start_texts)
    if ready is not None:
        assert ready["lora"] == str(adapters[fmt])
    assert texts == start_texts
    assert texts != worker.base_texts


def test_set_adapter_swaps_and_none_restores_the_base_exactly(adapters, start_texts, worker, tiny_model):
    for fmt in FORMATS:
        loaded = set_adapter(worker, adapters[fmt])
        assert list(loaded)[:5] == ["ev", "model", "lora", "sha256", "ms"], loaded
        assert loaded["ev"] == "adapter_loaded" and loaded["lora"] == str(adapters[fmt]) and loaded["format"] == fmt
        assert isinstance(loaded["ms"], int) and loaded["ms"] >= 0
        # Swapped in, it computes what it computes when loaded at start.
        assert [greedy(worker, CHAT), greedy(worker, OTHER)] == start_texts
    # sha256 is what `sha256sum` prints for the weights file; the config has its own.
    lm_dir = adapters["mlx-lm"]
    assert loaded["sha256"] == sha256sum(lm_dir / "adapters.safetensors")
    assert loaded["config_sha256"] == sha256sum(lm_dir / "adapter_config.json")
    scaled = set_adapter(worker, adapters["peft_scale_1.25x"])
    peft_dir = adapters["peft_scale_1.25x"]
    assert scaled["ev"] == "adapter_loaded" and scaled["sha256"] == sha256sum(peft_dir / "adapter_model.safetensors")
    assert scaled["config_sha256"] == sha256sum(peft_dir / "adapter_config.json")
    single = set_adapter(worker, adapters["mlx"])
    assert single["sha256"] == sha256sum(adapters["mlx"]) and single["config_sha256"] is None

    worker.send(Stats())
    stats = worker.next_event()
    # A and B take the layers' dtype: float32 when the worker computes on CPU.
    itemsize = 4 if mx.default_device() == mx.cpu else 2
    one = sum(itemsize * RANK * (d_in + d_out) for d_in, d_out in targets_of(tiny_model).values())
    # Every adapter set stays resident; the last one set is the default.
    resident = {a["lora"]: a for a in stats["adapters"]}
    assert set(resident) == {str(adapters[k]) for k in (*FORMATS, "peft_scale_1.25x")}
    assert [p for p, a in resident.items() if a["default"]] == [str(adapters["mlx"])]
    assert {a["bytes"] for a in resident.values()} == {one} and stats["adapter_bytes"] == len(resident) * one

    cleared = set_adapter(worker, None)
    assert cleared["ev"] == "adapter_loaded" and cleared["lora"] is None and cleared["sha256"] is None
    assert [greedy(worker, CHAT), greedy(worker, OTHER)] == worker.base_texts
    for path in resident:
        worker.send(UnloadAdapter(path=path))
        assert worker.next_event() | {"_line": None} == {"ev": "adapter_unloaded", "model": "tiny", "lora": path, "resident": True, "_line": None}
    worker.send(Stats())
    stats = worker.next_event()
    assert stats["adapter_bytes"] == 0 and stats["adapters"] == []


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_at_start_exits_78_with_its_message(tmp_path, tiny_model, kind):
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets_of(tiny_model), seed=23))
    w = WorkerProc(tiny_model, "--lora", str(path))
    assert w.proc.wait(timeout=120) == 78
    w.close()
    err = w.stderr.decode()
    assert "bad adapter" in err and phrase in err and name in err, err


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_by_set_adapter_keeps_the_old_one(tmp_path, tiny_model, adapters, start_texts, worker, kind):
    assert set_adapter(worker, adapters["peft"])["ev"] == "adapter_loaded"
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets_of(tiny_model), seed=24))
    error = set_adapter(worker, path)
    assert list(error) == ["ev", "model", "lora", "code", "msg", "_line"]
    assert error["ev"] == "adapter_error" and error["code"] == "adapter_error" and error["lora"] == str(path)
    assert phrase in error["msg"] and name in error["msg"]
    assert greedy(worker, CHAT) == start_texts[0]


def test_a_new_default_serves_new_requests_while_the_running_one_keeps_its_own(adapters, start_texts, worker, tiny_model):
    """SetAdapter no longer waits for running requests: the request that was
    running finishes on the adapter it began with, beside a request sent
    after the SetAdapter, which waits for it and runs on the new default."""
    assert set_adapter(worker, None)["ev"] == "adapter_loaded"
    long_base = greedy(worker, max_tokens=300)
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=300, id_json='"old"'))
    first = worker.next_event()
    assert first["ev"] == "gen_token" and first["id"] == "old"
    worker.send(SetAdapter(path=str(adapters["peft"])))
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=60, id_json='"new"'))
    events = [first]
    while not all(any(e.get("id") == i and e.get("done") for e in events) for i in ("old", "new")):
        events.append(worker.next_event())
    order = [(e["ev"], e.get("id"), e.get("done")) for e in events]
    loaded = order.index(("adapter_loaded", None, None))
    new_first = next(i for i, e in enumerate(events) if e.get("id") == "new")
    assert loaded < new_first < order.index(("gen_token", "old", True)), "the new request ran beside the old one"
    assert text_of([e for e in events if e.get("id") == "old"]) == long_base
    assert text_of([e for e in events if e.get("id") == "new"]) == start_texts[0]
    # Texts of rows that ran side by side equal texts of rows alone because
    # every greedy choice wins by far more than batching moves logits.
    assert min(margins_of(tiny_model)([CHAT], 300) + margins_of(adapters["merged_model"])([CHAT], 60)) > GREEDY_MARGIN
    # A request naming the base model explicitly gets it whatever the default.
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=60, lora=None))
    assert text_of(worker.collect()) == worker.base_texts[0]


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


def test_an_adapter_file_over_the_size_limit_is_refused_unread(tmp_path, tiny_model, worker):
    """A 2 GB sparse file was read whole, four times over (worker RSS 95 MB
    to 2.1 GB). Its size is checked first: by SetAdapter, and at start."""
    huge = tmp_path / "huge.safetensors"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)
    worker.send(Stats())
    before = worker.next_event()["rss_bytes"]
    error = set_adapter(worker, huge)
    assert error["ev"] == "adapter_error" and f"huge.safetensors is {2 << 30} bytes, more than max_adapter_bytes" in error["msg"]
    worker.send(Stats())
    assert worker.next_event()["rss_bytes"] < before + (64 << 20)
    w = WorkerProc(tiny_model, "--lora", str(huge), "--max-adapter-bytes", str(1 << 20))
    assert w.proc.wait(timeout=120) == 78
    w.close()
    last = w.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("lattice-pool worker: bad adapter: ") and "more than max_adapter_bytes (1048576)" in last
