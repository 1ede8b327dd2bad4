"""Many adapters on one worker (docs/adapters.md): rows of different adapters (and
none) in one batch, eviction under --max-adapters, per-adapter hot reload
and broken files, a 4-bit base; real worker processes on demo models.

Worker texts are compared with greedy texts computed in this process on
models with the update merged into their weights (or, on the 4-bit base,
with the same adapter alone). Those differ from the worker's batched,
unfused arithmetic by float noise only, so every comparison also checks
that each greedy choice wins by far more than that noise: text equality
then holds on any CPU."""

import hashlib
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from harness.prompts import ADAPTER_LONG, ADAPTER_PROMPTS, ADAPTER_TOKENS
from harness.worker import WorkerProc, is_terminal, text_of
from ipc.framing import encode_frame
from ipc.messages import Generate, LoadAdapter, ReloadAdapter, Stats
from tests.conftest import FORMATS, GREEDY_MARGIN, greedy_steps, shared_worker
from tests.lora_files import lora_pairs, targets_of, use_only, write_mlx, write_peft
from worker.lora.residency import Entry, Version, choose_victim

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 tolerances of the CPU path")


@pytest.fixture(scope="module")
def worker(tiny_model):
    yield from shared_worker(tiny_model, "--prefix-cache-bytes", "0")


_rid = iter(range(1, 1_000_000))


def request(prompt: int, lora, max_tokens: int = ADAPTER_TOKENS) -> Generate:
    rid = next(_rid)
    return Generate(rid=rid, id_json=str(rid), prompt=ADAPTER_PROMPTS[prompt], temperature=0.0, repetition_penalty=1.0, max_tokens=max_tokens, lora=lora)


def texts_of(w, reqs) -> list[str]:
    events = w.send_together(reqs)
    return [text_of(events[r.rid]) for r in reqs]


def stats(w) -> dict:
    w.send(Stats())
    event = w.next_event()
    assert event["ev"] == "worker_stats", event
    return event


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_of_different_adapters_in_one_batch_match_merged_models(worker, files, references, fmt):
    texts, margin = references
    x, y = files["x", fmt], files["y", fmt]
    rows = [(0, x, "x"), (1, y, "y"), (2, None, None), (1, x, "x"), (3, y, "y")]
    got = texts_of(worker, [request(p, lora) for p, lora, _ in rows])
    assert got == [texts[name, p] for p, _, name in rows]
    assert margin > GREEDY_MARGIN


def test_a_row_without_adapter_in_a_mixed_batch_equals_the_base_alone(worker, files, greedy_margins):
    alone = texts_of(worker, [request(2, None)])[0]
    mixed = texts_of(worker, [request(0, files["x", "peft"]), request(2, None), request(1, files["y", "mlx"])])
    assert mixed[1] == alone
    assert min(greedy_margins([ADAPTER_PROMPTS[2]], ADAPTER_TOKENS)) > GREEDY_MARGIN


def test_a_request_for_a_broken_adapter_gets_one_error_and_the_others_run(worker, files, references, tmp_path):
    texts, _ = references
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    bad, good, bad_too = request(0, str(broken)), request(0, files["x", "peft"]), request(1, str(broken))
    events = worker.send_together([bad, good, bad_too])
    for r in (bad, bad_too):
        assert [e["ev"] for e in events[r.rid]] == ["error"]
        error = events[r.rid][0]
        assert error["code"] == "adapter_error" and str(broken) in error["msg"], error
    assert text_of(events[good.rid]) == texts["x", 0]
    assert any(e["ev"] == "adapter_error" and e["lora"] == str(broken) for e in worker.adapter_events)


def test_least_recently_used_adapter_is_evicted_and_read_again_on_next_use(tiny_model, files, live, references, tmp_path):
    """And read from the pool's last good copy when its file broke meanwhile."""
    texts, _ = references
    x, y, x_again = str(live["x"]), str(live["y"]), files["x", "mlx"]
    w = WorkerProc(tiny_model, "--max-adapters", "2", "--prefix-cache-bytes", "0", "--adapter-copies", str(tmp_path / "copies"))
    try:
        w.wait_ready()

        def loaded() -> list[str]:
            events, w.adapter_events[:] = list(w.adapter_events), []
            assert all(e["ev"] == "adapter_loaded" for e in events), events
            return [e["lora"] for e in events]

        def resident() -> list[str]:
            return sorted(a["lora"] for a in stats(w)["adapters"])

        assert texts_of(w, [request(0, x), request(1, y)]) == [texts["x", 0], texts["y", 1]]
        assert sorted(loaded()) == sorted([x, y]) and resident() == sorted([x, y])
        texts_of(w, [request(1, y)])  # y is now the most recently used
        assert texts_of(w, [request(0, x_again)]) == [texts["x", 0]]
        assert loaded() == [x_again] and resident() == sorted([y, x_again])
        assert texts_of(w, [request(0, x)]) == [texts["x", 0]]
        assert loaded() == [x] and resident() == sorted([x_again, x])
        # An explicit load counts as a use too, and is answered at once when resident.
        w.send(LoadAdapter(path=x_again))
        assert w.next_event()["lora"] == x_again and loaded() == []
        w.send(LoadAdapter(path=y))
        event = w.next_event()
        assert event["ev"] == "adapter_loaded" and event["lora"] == y
        assert resident() == sorted([x_again, y])
        # x, evicted, is broken on disk: the copy kept when it was read stands in.
        (live["x"] / "adapter_model.safetensors").write_bytes(b"broken")
        sha = hashlib.sha256((Path(files["x", "peft"]) / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert texts_of(w, [request(0, x)]) == [texts["x", 0]]
        said, loaded_event = w.adapter_events
        assert said["ev"] == "adapter_error" and said["lora"] == x and f"using the last good copy of it (sha256 {sha})" in said["msg"], said
        assert loaded_event["ev"] == "adapter_loaded" and loaded_event["lora"] == x and loaded_event["sha256"] == sha
    finally:
        assert w.close() == 0


def test_a_read_waits_for_room_and_later_requests_do_not_overtake_it(tiny_model, files, references):
    """With room for one adapter, held by a running row: y's read waits
    until that row ends, and a later request for x waits behind y."""
    texts, _ = references
    x, y = files["x", "peft"], files["y", "peft"]
    w = WorkerProc(tiny_model, "--max-adapters", "1", "--prefix-cache-bytes", "0")
    try:
        w.wait_ready()
        long_x = request(0, x, max_tokens=ADAPTER_LONG)
        w.send(long_x)
        assert w.next_event()["ev"] == "adapter_loaded"
        first = w.next_event()
        assert first["id"] == long_x.rid
        for_y, x_again = request(1, y), request(0, x)
        w.send_raw(encode_frame(for_y) + encode_frame(x_again))
        seen, loads, pending = [first], [], {long_x.rid, for_y.rid, x_again.rid}
        while pending:
            event = w.next_event()
            if "id" not in event:
                loads.append(event["lora"])
                continue
            seen.append(event)
            if is_terminal(event):
                pending.discard(event["id"])
        ids = [e["id"] for e in seen]
        ends = {rid: len(ids) - 1 - ids[::-1].index(rid) for rid in pending | {long_x.rid, for_y.rid}}
        assert ends[long_x.rid] < ids.index(for_y.rid) and ends[for_y.rid] < ids.index(x_again.rid)
        assert loads == [y, x]
        by_id = {rid: [e for e in seen if e["id"] == rid] for rid in (long_x.rid, for_y.rid, x_again.rid)}
        assert text_of(by_id[long_x.rid]) == texts["x", 0, ADAPTER_LONG]
        assert text_of(by_id[for_y.rid]) == texts["y", 1] and text_of(by_id[x_again.rid]) == texts["x", 0]
    finally:
        assert w.close() == 0


@pytest.fixture
def live(tmp_path, files):
    """Copies of x and y (PEFT) at paths the test rewrites."""
    return {name: shutil.copytree(files[name, "peft"], tmp_path / name) for name in ("x", "y")}


def wait_adapter_event(w, events: dict, lora: str) -> dict:
    """Reads lines (request lines into `events` by id) up to the next adapter event for `lora`."""
    while True:
        event = w.next_event()
        if "id" in event:
            events.setdefault(event["id"], []).append(event)
        elif event["ev"].startswith("adapter_") and event["lora"] == lora:
            return event


def test_reloading_one_adapter_leaves_running_rows_on_their_versions(worker, live, references):
    """Rows of y, and a row of x started before x's file changed, decode on
    unchanged while x is read again; rows started after get the new x."""
    texts, margin = references
    x, y = str(live["x"]), str(live["y"])
    assert texts_of(worker, [request(0, x), request(1, y)]) == [texts["x", 0], texts["y", 1]]
    long_x, long_y = request(0, x, max_tokens=ADAPTER_LONG), request(1, y, max_tokens=ADAPTER_LONG)
    worker.send_raw(encode_frame(long_x) + encode_frame(long_y))
    events: dict = {}
    while not all(events.get(r.rid) for r in (long_x, long_y)):
        event = worker.next_event()
        events.setdefault(event["id"], []).append(event)
    # x's file now holds y's update: rows started from here on compute y.
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(live["y"] / name, live["x"] / name)
    # A request sent right after the reload waits for it.
    fresh = request(1, x)
    worker.send_raw(encode_frame(ReloadAdapter(path=x)) + encode_frame(fresh))
    loaded = wait_adapter_event(worker, events, x)
    assert loaded["ev"] == "adapter_loaded"
    assert not any(terminal_in(events[r.rid]) for r in (long_x, long_y)), "the long rows were still running"
    assert fresh.rid not in events
    for rid, evs in worker.collect_by_id([long_x.rid, long_y.rid, fresh.rid]).items():
        events.setdefault(rid, []).extend(evs)
    assert text_of(events[long_x.rid]) == texts["x", 0, ADAPTER_LONG]
    assert text_of(events[long_y.rid]) == texts["y", 1, ADAPTER_LONG]
    assert text_of(events[fresh.rid]) == texts["y", 1]
    assert margin > GREEDY_MARGIN


def terminal_in(events: list[dict]) -> bool:
    return any(e["ev"] == "error" or e.get("done") for e in events)


def test_a_corrupt_replacement_keeps_that_adapters_version_and_spares_the_others(worker, live, references):
    texts, _ = references
    x, y = str(live["x"]), str(live["y"])
    assert texts_of(worker, [request(0, x), request(1, y)]) == [texts["x", 0], texts["y", 1]]
    before = {a["lora"]: a["sha256"] for a in stats(worker)["adapters"]}
    weights = live["x"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    worker.send(ReloadAdapter(path=x))
    error = worker.next_event()
    assert error["ev"] == "adapter_error" and error["lora"] == x and error["model"] == "tiny"
    assert "truncated" in error["msg"] and "keeping the version loaded before" in error["msg"], error
    assert texts_of(worker, [request(0, x), request(1, y)]) == [texts["x", 0], texts["y", 1]]
    after = {a["lora"]: a["sha256"] for a in stats(worker)["adapters"]}
    assert after[x] == before[x] and after[y] == before[y]


def test_two_adapters_on_a_4bit_base(tiny_q4_model, tmp_path):
    """Each row's text is its adapter's alone (computed here on the same
    4-bit layers), the base row the base's."""
    from worker.lora.formats import read_adapter
    from worker.lora.layers import LoRASlots
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    targets = targets_of(tiny_q4_model)
    paths = {
        "x": str(write_peft(tmp_path / "x", lora_pairs(targets, rank=4, seed=43), r=4, alpha=8.0)),
        "y": str(write_mlx(tmp_path / "y.safetensors", lora_pairs(targets, groups=("mlp",), rank=8, seed=44), alpha=16.0)),
        None: None,
    }
    loaded = load(tiny_q4_model)
    codec = TextCodec(tiny_q4_model, loaded.config)
    slots = LoRASlots(loaded.model)
    expected, margins = [], []
    for i, name in enumerate(("x", "y", None)):
        use_only(slots, read_adapter(Path(paths[name]), slots.targets) if name else None)
        ids, m = greedy_steps(loaded.model, codec, ADAPTER_PROMPTS[i], ADAPTER_TOKENS)
        expected.append(codec.decode(ids))
        margins += m
    assert len(set(expected)) == 3
    w = WorkerProc(tiny_q4_model, "--prefix-cache-bytes", "0")
    try:
        assert w.wait_ready()["format"] == "q4"
        assert texts_of(w, [request(i, paths[name]) for i, name in enumerate(("x", "y", None))]) == expected
    finally:
        assert w.close() == 0
    assert min(margins) > GREEDY_MARGIN, min(margins)


# -- the eviction rule, on its own ------------------------------------------------


def entry(path: str, last_used: int, rows: int = 0, resident: bool = True, pending: bool = False) -> Entry:
    e = Entry(path, last_used=last_used)
    if resident:
        e.current = Version(slot=0, path=path, sha256="", config_sha256=None, key="", format="peft", modules=1, nbytes=1, rows=rows)
    if pending:
        e.pending.append(1)
    return e


def test_the_victim_is_the_least_recently_used_adapter_no_row_or_message_holds():
    entries = [entry("a", 5), entry("b", 2, rows=1), entry("c", 3), entry("d", 1, pending=True), entry("e", 0, resident=False)]
    assert choose_victim(entries, keep="z").path == "c"
    assert choose_victim(entries, keep="c").path == "a"
    assert choose_victim([entry("b", 2, rows=1), entry("d", 1, pending=True)], keep="z") is None
