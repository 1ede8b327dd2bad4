"""LoRA through real worker processes: requests naming an adapter (`lora`),
LoadAdapter, and broken adapters; and, in process on the same code, logits
against a model with the same update merged in. Several adapters at once:
tests/test_lora_multi.py.

Greedy text is compared only between runs that compute exactly the same
thing (the same tensors in any format, loaded on demand or by LoadAdapter;
no adapter before and after adapters ran), so it cannot tie differently on
another CPU; merged weights against an unfused adapter differ by float
rounding, so those compare logits."""

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Generate, LoadAdapter, Stats, UnloadAdapter
from tests.conftest import GREEDY_MARGIN, float32_margins, keep_alive_across_tests, margins_of, release
from tests.lora_files import BAD_KINDS, deltas, lora_pairs, targets_of, use_only, write_bad, write_merged_model, write_mlx, write_mlx_lm, write_peft

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nWhat did the miller say?<|im_end|>\n<|im_start|>assistant\n"
RANK, ALPHA = 4, 8.0
FORMATS = ("peft", "mlx", "mlx-lm")

_rid = iter(range(1, 1_000_000))


# Below the 2 GB file of the size-limit test, above every adapter here.
MAX_ADAPTER_BYTES = 64 << 20


def greedy(w, prompt=CHAT, max_tokens=60, lora=None) -> str:
    w.send(Generate(rid=next(_rid), prompt=prompt, temperature=0.0, max_tokens=max_tokens, lora=None if lora is None else str(lora)))
    events = w.collect()
    assert terminal(events)["ev"] == "gen_token"
    return text_of(events)


def texts(w, lora=None) -> list[str]:
    return [greedy(w, p, lora=lora) for p in (CHAT, OTHER)]


def load_adapter(w, path) -> dict:
    return w.ask(LoadAdapter(path=str(path)))


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


@pytest.fixture(scope="module")
def worker(tiny_model):
    w = WorkerProc(tiny_model, "--max-adapter-bytes", str(MAX_ADAPTER_BYTES))
    keep_alive_across_tests(w.pid)
    w.wait_ready()
    w.base_texts = texts(w)
    yield w
    release(w.pid)
    assert w.close() == 0


@pytest.fixture(scope="module")
def adapted_texts(adapters, worker):
    """Greedy texts of requests naming the PEFT dir, which the first of
    them loads."""
    return texts(worker, adapters["peft"])


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
def test_requests_naming_an_adapter_generate_the_same_in_every_format(adapters, adapted_texts, worker, fmt):
    assert texts(worker, adapters[fmt]) == adapted_texts
    assert adapted_texts != worker.base_texts


def test_load_adapter_answers_with_its_figures_and_the_base_stays_exact(adapters, adapted_texts, worker, tiny_model):
    for fmt in FORMATS:
        worker.ask(UnloadAdapter(path=str(adapters[fmt])))
        loaded = load_adapter(worker, adapters[fmt])
        assert list(loaded)[:5] == ["ev", "model", "lora", "sha256", "ms"], loaded
        assert loaded["ev"] == "adapter_loaded" and loaded["lora"] == str(adapters[fmt]) and loaded["format"] == fmt
        assert isinstance(loaded["ms"], int) and loaded["ms"] >= 0
        # Loaded by LoadAdapter, it computes what it computes loaded on demand.
        assert texts(worker, adapters[fmt]) == adapted_texts
    # sha256 is what `sha256sum` prints for the weights file; the config has its own.
    lm_dir = adapters["mlx-lm"]
    assert loaded["sha256"] == sha256sum(lm_dir / "adapters.safetensors")
    assert loaded["config_sha256"] == sha256sum(lm_dir / "adapter_config.json")
    scaled = load_adapter(worker, adapters["peft_scale_1.25x"])
    peft_dir = adapters["peft_scale_1.25x"]
    assert scaled["ev"] == "adapter_loaded" and scaled["sha256"] == sha256sum(peft_dir / "adapter_model.safetensors")
    assert scaled["config_sha256"] == sha256sum(peft_dir / "adapter_config.json")
    single = load_adapter(worker, adapters["mlx"])
    assert single["sha256"] == sha256sum(adapters["mlx"]) and single["config_sha256"] is None

    stats = worker.ask(Stats())
    # A and B take the layers' dtype: float32 when the worker computes on CPU.
    itemsize = 4 if mx.default_device() == mx.cpu else 2
    one = sum(itemsize * RANK * (d_in + d_out) for d_in, d_out in targets_of(tiny_model).values())
    # Every adapter loaded stays resident, no row running with it.
    resident = {a["lora"]: a for a in stats["adapters"]}
    assert set(resident) == {str(adapters[k]) for k in (*FORMATS, "peft_scale_1.25x")}
    assert {a["rows"] for a in resident.values()} == {0}
    assert {a["bytes"] for a in resident.values()} == {one} and stats["adapter_bytes"] == len(resident) * one

    # With all of them resident, a request for the base model computes it bit for bit.
    assert texts(worker) == worker.base_texts
    for path in resident:
        worker.send(UnloadAdapter(path=path))
        assert worker.next_event() | {"_line": None} == {"ev": "adapter_unloaded", "model": "tiny", "lora": path, "resident": True, "_line": None}
    stats = worker.ask(Stats())
    assert stats["adapter_bytes"] == 0 and stats["adapters"] == []


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_adapter_is_refused_with_its_message_and_the_good_one_serves(tmp_path, tiny_model, adapters, adapted_texts, worker, kind):
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets_of(tiny_model), seed=24))
    error = load_adapter(worker, path)
    assert list(error) == ["ev", "model", "lora", "code", "msg", "_line"]
    assert error["ev"] == "adapter_error" and error["code"] == "adapter_error" and error["lora"] == str(path)
    assert phrase in error["msg"] and name in error["msg"]
    # A request for it, sent after that failure, gets the same cause.
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=4, lora=str(path), id_json='"bad"'))
    refused = terminal(worker.collect())
    assert refused["ev"] == "error" and refused["code"] == "adapter_error" and refused["id"] == "bad" and refused["msg"] == error["msg"]
    assert greedy(worker, CHAT, lora=adapters["peft"]) == adapted_texts[0]


@float32_margins
def test_a_request_waits_for_its_adapter_while_the_running_one_goes_on(adapters, adapted_texts, worker, tiny_model):
    """A read does not wait for running requests: the request that was
    running finishes beside a request sent after a LoadAdapter, which waits
    for it and runs with that adapter."""
    worker.ask(UnloadAdapter(path=str(adapters["peft"])))
    long_base = greedy(worker, max_tokens=300)
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=300, id_json='"old"'))
    first = worker.next_event()
    assert first["ev"] == "gen_token" and first["id"] == "old"
    worker.send(LoadAdapter(path=str(adapters["peft"])))
    worker.send(Generate(rid=next(_rid), prompt=CHAT, temperature=0.0, max_tokens=60, lora=str(adapters["peft"]), id_json='"new"'))
    events = [first]
    while not all(any(e.get("id") == i and e.get("done") for e in events) for i in ("old", "new")):
        events.append(worker.next_event())
    order = [(e["ev"], e.get("id"), e.get("done")) for e in events]
    loaded = order.index(("adapter_loaded", None, None))
    new_first = next(i for i, e in enumerate(events) if e.get("id") == "new")
    assert loaded < new_first < order.index(("gen_token", "old", True)), "the new request ran beside the old one"
    assert text_of([e for e in events if e.get("id") == "old"]) == long_base
    assert text_of([e for e in events if e.get("id") == "new"]) == adapted_texts[0]
    # Texts of rows that ran side by side equal texts of rows alone because
    # every greedy choice wins by far more than batching moves logits.
    assert min(margins_of(tiny_model)([CHAT], 300) + margins_of(adapters["merged_model"])([CHAT], 60)) > GREEDY_MARGIN


def test_quantized_base_with_adapter_generates_and_differs(tiny_q4_model, tmp_path):
    adapter = write_peft(tmp_path / "q4", lora_pairs(targets_of(tiny_q4_model), rank=RANK, seed=25), r=RANK, alpha=ALPHA)
    w = WorkerProc(tiny_q4_model)
    try:
        assert w.wait_ready()["format"] == "q4"
        adapted = greedy(w, lora=adapter)
        assert adapted
        assert w.ask(Stats())["adapter_bytes"] > 0
        base = greedy(w)
        assert base and base != adapted
        assert greedy(w, lora=adapter) == adapted
    finally:
        assert w.close() == 0


def test_an_adapter_file_over_the_size_limit_is_refused_unread(tmp_path, worker):
    """A 2 GB sparse file was read whole, four times over (worker RSS 95 MB
    to 2.1 GB). Its size is checked first, against --max-adapter-bytes."""
    huge = tmp_path / "huge.safetensors"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)
    before = worker.ask(Stats())["rss_bytes"]
    error = load_adapter(worker, huge)
    assert error["ev"] == "adapter_error" and f"huge.safetensors is {2 << 30} bytes, more than max_adapter_bytes ({MAX_ADAPTER_BYTES})" in error["msg"]
    assert worker.ask(Stats())["rss_bytes"] < before + (64 << 20)
