"""The prefix cache's disk tier: snapshots that outlive the worker and the
pool, checked before use, bounded, and keyed by model and adapter content."""

import json
import os
import time

import pytest

from harness.engine import engine_for, run
from harness.prefix_files import FIRST, SECOND, disk_after_first, files, path_of, shortest_file, snapshot_layers, wait_files
from harness.procs import said, wait_for
from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Generate
from ipc.paths import pool_cache_dir

_rid = iter(range(1, 1_000_000))


def ask(w, prompt: str, **kw) -> tuple[str, dict]:
    w.send(Generate(rid=next(_rid), prompt=prompt, temperature=0.0, max_tokens=16, **kw))
    events = w.collect()
    return text_of(events), terminal(events)


@pytest.fixture(scope="module")
def plain_answers(tiny_model):
    """What the model says to each prompt with no prefix cache at all."""
    w = WorkerProc(tiny_model, "--prefix-cache-bytes", "0")
    try:
        w.wait_ready()
        return {p: ask(w, p)[0] for p in (FIRST, SECOND)}
    finally:
        assert w.close() == 0


def test_a_prefix_on_disk_is_used_after_a_pool_restart(tiny_model, tmp_path, spawn_pool, plain_answers):
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    root = pool_cache_dir(env) / "prefix"
    pool = spawn_pool("--config", str(config), env=env)
    request = {"model": "tiny", "temperature": 0, "max_tokens": 16}
    first = pool.generate({**request, "id": "a", "prompt": FIRST})
    assert "cached_tokens" not in first
    # The system prompt's snapshot, and the one where the reply began.
    wait_files(root, 2)
    assert pool.close() == 0

    pool = spawn_pool("--config", str(config), env=env)
    done = pool.generate({**request, "id": "b", "prompt": SECOND})
    # Resumed from the system prompt's snapshot read back from disk: only
    # the new question is prefilled, and the text is the cold run's.
    assert done["cached_tokens"] > 0.8 * done["prompt_tokens"]
    assert pool.text("b") == plain_answers[SECOND]
    assert said(pool.stderr, b"prefix cache on disk: 2 entries")
    assert said(pool.stderr, b"the 2 most recently used files ")
    assert said(pool.stderr, b"piece cache: the text of 2 stored prefix(es) tokenized")
    assert pool.close() == 0


def test_truncated_or_corrupt_files_are_dropped_never_used(tiny_model, tmp_path, plain_answers):
    w = WorkerProc(tiny_model, "--prefix-disk-dir", str(tmp_path))
    try:
        w.wait_ready()
        ask(w, FIRST)
        made = wait_files(tmp_path, 2)
    finally:
        w.proc.kill()  # a crash: files are renamed into place whole, or not at all
        assert w.close() == -9
    assert not list(tmp_path.rglob("*.tmp"))
    # The larger file ends where the reply began; the smaller one is the
    # system prompt's, which the second prompt would resume from.
    system, turn = sorted(made, key=lambda p: p.stat().st_size)
    data = bytearray(system.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in its state
    system.write_bytes(bytes(data))
    with open(turn, "r+b") as f:
        f.truncate(turn.stat().st_size - 4096)
    w = WorkerProc(tiny_model, "--prefix-disk-dir", str(tmp_path))
    try:
        w.wait_ready()
        # A short file is seen at start.
        wait_for(lambda: not turn.exists(), timeout=30, message="the truncated file to go")
        text, done = ask(w, SECOND)
        # The corrupt one is found when read: the request runs cold.
        assert "cached_tokens" not in done and text == plain_answers[SECOND]
        assert said(w.stderr, b"truncated") and said(w.stderr, b"checksum does not match")
        # The cold run made that snapshot again, and wrote a sound file.
        wait_for(lambda: system.exists() and system.read_bytes() != bytes(data), timeout=30, message="the snapshot written again")
    finally:
        assert w.close() == 0


def test_files_with_hostile_headers_are_never_used(tiny_model, tmp_path, caplog):
    """A file is input from disk, and one made to pass its checksums (the
    header's recomputed) may still lie: a header nested past json's
    recursion limit or shapes that do not match the bytes are dropped when
    found; a layout that points past the arrays or is not the model's is
    refused when read. None stops the tier, and the sound file still serves."""
    disk, system, path, raw, parts = shortest_file(tiny_model, tmp_path)
    header, meta = parts.header, parts.meta

    def rewrite(tensors: dict | None = None, tree: object = None, body: bytes | None = None) -> None:
        path.write_bytes(parts.made(tensors, body, **({} if tree is None else {"tree": tree})))

    cache = engine_for(tiny_model).prefix_cache
    for broken in ({"body": b"[" * 200_000 + b"]" * 200_000}, {"tensors": {**header, "a0": {**header["a0"], "shape": [7, *header["a0"]["shape"]]}}}):
        rewrite(**broken)
        disk._scan()
        assert not path.exists() and system.name not in disk._index
        path.write_bytes(raw)
        disk._scan()
    tree = meta["tree"]
    # A linear-attention layer's state where an attention layer's keys and
    # values belong, and back (two layers of one kind swapped would pass:
    # the checks guard against damage and against what would break the
    # engine, not against a file made to mislead).
    kv = next(i for i, layer in enumerate(tree) if isinstance(layer, dict))
    swapped = list(tree)
    swapped[0], swapped[kv] = tree[kv], tree[0]
    for broken_tree in ([999, *tree[1:]], swapped, tree[:-1]):
        rewrite(tree=broken_tree)
        loaded = disk.load_now(disk._index[system.name])
        restored = loaded.layers() if loaded is not None else None
        assert restored is None or not cache.insert_read(None, system.tokens, *restored)
    assert len(cache) == 0
    path.write_bytes(raw)
    restored = disk.load_now(disk._index[system.name]).layers()
    assert cache.insert_read(None, system.tokens, *restored) and len(cache) == 1


def test_a_file_replaced_after_its_check_is_not_used(tmp_path, caplog):
    """The check and mlx's read are two reads: a file that another one
    replaced in between (other tokens under its name) is refused when read."""
    import numpy as np

    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    for start in (0, 1000):
        disk.write(None, np.arange(start, start + 50), snapshot_layers(start, 50))
    assert disk.flush(30)
    first, other = sorted(disk._index.values(), key=lambda e: int(e.tokens[0]))
    loaded = disk.load_now(first)
    (disk.dir / first.name).write_bytes((disk.dir / other.name).read_bytes())
    assert loaded.layers() is None
    assert "could not be read after its check" in caplog.text
    (disk.dir / first.name).unlink()
    assert loaded.layers() is None  # gone: the same answer


def test_mlx_reads_a_requests_file_beside_its_check_and_its_arrays_serve_only_that_file(tmp_path):
    """read_beside starts mlx's read before the check ends; `parts` takes its
    arrays only for the very file the check passed (same inode, size and
    modification time), else reads the file itself."""
    import mlx.core as mx
    import numpy as np

    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_loaded import Beside

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    layers = snapshot_layers(0, 50)
    disk.write(None, np.arange(50), layers)
    assert disk.flush(30)
    [entry] = disk._index.values()
    beside = disk.read_beside(entry)
    loaded = disk.load_now(entry)
    assert beside is not None and beside.identity == loaded.identity
    back, _ = loaded.layers(beside)
    assert mx.array_equal(back[0][0], layers[0][0]).item() and mx.array_equal(back[1][0], layers[1][0]).item()
    # The arrays read beside are what `parts` returns: zeros in their place come back.
    zeros = Beside(loaded.identity, {name: mx.zeros_like(a) for name, a in beside.found.items()} | {"tokens": beside.found["tokens"]})
    back, _ = loaded.layers(zeros)
    assert not mx.any(back[0][0]).item()
    # The same bytes under a new inode (another worker's write renamed over
    # it) are another file: read again, the zeros not taken.
    path = disk.dir / entry.name
    (tmp_path / "copy").write_bytes(path.read_bytes())
    os.replace(tmp_path / "copy", path)
    loaded = disk.load_now(entry)
    assert loaded.identity != zeros.identity
    back, _ = loaded.layers(zeros)
    assert mx.array_equal(back[0][0], layers[0][0]).item()
    # A header that is not one: nothing read beside (the check reports and removes it).
    path.write_bytes(b"\xff" * 64)
    assert disk.read_beside(entry) is None


def test_on_a_gpu_the_disk_writes_copies(tmp_path, monkeypatch):
    """Reading an array's bytes on the host moves a CUDA buffer into managed
    memory for good; the write must read copies, so that the memory tier's
    own arrays stay on the device. The copies hold the same values, and
    their queue has a smaller bound. A file reads back the same values."""
    import mlx.core as mx
    import numpy as np

    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    for on_device in (False, True):
        disk = PrefixDisk(tmp_path / str(on_device), "model", budget=1 << 30, max_pending_bytes=8 << 30, on_device=on_device)
        assert disk.max_pending_bytes == (prefix_disk.COPIES_PENDING_BYTES if on_device else 8 << 30)
        written: list = []
        real = disk._store
        monkeypatch.setattr(disk, "_store", lambda name, adapter, tokens, tree, arrays: written.extend(arrays) or real(name, adapter, tokens, tree, arrays))
        layers = snapshot_layers(3, 40)
        held = [layers[0][0], layers[0][1], layers[1][0]]
        disk.write(None, np.arange(40), layers)
        assert disk.flush(30) and len(written) == 3
        assert any(a is b for a, b in zip(written, held)) != on_device
        for a, b in zip(written, held):
            assert mx.array_equal(a, b)
        entry = next(iter(disk._index.values()))
        read, _ = disk.load_now(entry).layers()
        assert mx.array_equal(read[0][0], held[0]) and mx.array_equal(read[1][0], held[2])


def test_writes_wait_while_the_engine_holds_them(tmp_path):
    """The engine holds writes back while a first token is pending
    (`writes_wait_until`); they go once it lets go, or once the time it
    named has passed."""
    import time

    import numpy as np

    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    disk.writes_wait_until = time.monotonic() + 60
    disk.write(None, np.arange(40), snapshot_layers(5, 40))
    assert not disk.flush(0.3) and len(disk) == 0
    disk.writes_wait_until = 0.0
    assert disk.flush(30) and len(disk) == 1
    disk.writes_wait_until = time.monotonic() + 0.2  # a bound that runs out
    disk.write(None, np.arange(50), snapshot_layers(6, 50))
    assert disk.flush(30) and len(disk) == 2


def test_the_scheduler_holds_writes_until_the_first_token(tiny_model, tmp_path, monkeypatch):
    """A snapshot stored while the prompt is read (at a message start) is
    written once the request's first token is out, not beside it (within
    the hold's bound, made long here: a loaded machine reads slowly)."""
    from worker.cache.prefix_disk import PrefixDisk
    from worker.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "WRITES_HELD_AT_MOST_S", 600.0)
    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    engine = engine_for(tiny_model, prefix_disk=disk)
    engine.submit(Generate(rid=1, prompt=FIRST, temperature=0.0, max_tokens=8), 0.0)
    queued_early = False
    while engine.has_work:
        engine.step()
        if disk._writes.unfinished_tasks and engine.generator.first_token_pending:
            assert not disk.flush(0.3) and len(disk) == 0
            queued_early = True
    assert queued_early
    assert disk.flush(30) and len(disk) >= 1


def test_device_copies_wait_while_writes_are_held_and_come_a_part_a_step(tmp_path, monkeypatch, caplog):
    """Copying a large snapshot holds the main thread: on a device the copies
    are made only once no first token is pending, at most a part a call,
    and the snapshot is queued when its last copy is made. A worker exiting
    from its reader thread makes none (mlx arrays are made on the main
    thread) and says what it leaves."""
    import threading

    import numpy as np

    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path / "a", "model", budget=1 << 30, on_device=True)
    made: list = []
    monkeypatch.setattr(prefix_disk, "device_copies", lambda arrays, real=prefix_disk.device_copies: made.extend(arrays) or real(arrays))
    disk.writes_wait_until = time.monotonic() + 60
    disk.write(None, np.arange(40), snapshot_layers(3, 40))
    arrays = len(disk.uncopied[0][0][4])
    assert arrays > 1 and not made and len(disk.uncopied) == 1
    disk.make_copies(1)
    assert not made  # still held
    disk.writes_wait_until = 0.0
    for k in range(1, arrays + 1):
        disk.make_copies(1)  # one array a call: the least a call makes
        assert len(made) == k and len(disk.uncopied) == (k < arrays)
    assert disk.flush(30) and len(disk) == 1

    exiting = PrefixDisk(tmp_path / "b", "model", budget=1 << 30, on_device=True)
    exiting.writes_wait_until = time.monotonic() + 60
    exiting.write(None, np.arange(40), snapshot_layers(4, 40))
    made.clear()
    reader = threading.Thread(target=exiting.closing)
    reader.start()
    reader.join(30)
    assert not made and len(exiting) == 0
    assert "exiting with 1 snapshot(s) not written" in caplog.text


def test_on_a_device_no_copy_is_made_before_a_requests_first_token(tiny_model, tmp_path, monkeypatch):
    """The engine steps while copies wait (the worker would otherwise idle
    with them), and makes none while its request waits for its first token."""
    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk
    from worker.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "WRITES_HELD_AT_MOST_S", 600.0)
    disk = PrefixDisk(tmp_path, "model", budget=1 << 30, on_device=True)
    engine = engine_for(tiny_model, prefix_disk=disk)
    pending_at_copy: list[bool] = []
    real = prefix_disk.device_copies
    monkeypatch.setattr(prefix_disk, "device_copies", lambda arrays: pending_at_copy.append(engine.generator.first_token_pending) or real(arrays))
    engine.submit(Generate(rid=1, prompt=FIRST, temperature=0.0, max_tokens=8), 0.0)
    taken_early = False
    while engine.has_work:
        engine.step()
        taken_early |= bool(disk.uncopied) and engine.generator.first_token_pending
    assert taken_early and pending_at_copy and not any(pending_at_copy)
    assert not disk.uncopied and disk.flush(30) and len(disk) >= 1


def test_a_copy_that_fails_leaves_the_snapshot_unwritten_and_the_request_alone(tmp_path, monkeypatch, caplog):
    import numpy as np

    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30, on_device=True)

    def out_of_memory(*arrays):
        raise RuntimeError("out of memory")

    layers = snapshot_layers(4, 40)
    monkeypatch.setattr(prefix_disk.mx, "eval", out_of_memory)
    disk.write(None, np.arange(40), layers)
    monkeypatch.undo()
    assert disk.flush(30) and len(disk) == 0 and disk._pending_bytes == 0
    assert "is not written: no copy for the disk (out of memory)" in caplog.text
    disk.write(None, np.arange(40), snapshot_layers(4, 40))
    assert disk.flush(30) and len(disk) == 1


def test_a_read_back_makes_its_arrays_a_part_a_step(tiny_model, tmp_path, monkeypatch):
    """A file read back beside running rows is made a few arrays per step,
    so no step waits for a whole file's arrays."""
    from worker.cache import prefix_disk
    from worker.engine import scheduler as scheduler_module

    monkeypatch.setattr(prefix_disk, "READ_BACK_QUIET_S", 0.0)
    monkeypatch.setattr(scheduler_module, "READ_BACK_STEP_BYTES", 16 << 10)
    disk = disk_after_first(tiny_model, tmp_path)
    system = min(disk._index.values(), key=lambda e: e.size)
    assert system.size > 4 * (16 << 10)
    reader = engine_for(tiny_model, prefix_disk=disk)
    rehearsed = []
    rehearse = reader.prefix_cache.rehearse
    monkeypatch.setattr(reader.prefix_cache, "rehearse", lambda: rehearsed.append(len(reader.prefix_cache)) or rehearse())
    assert disk.read(system, read_back=True)
    wait_for(lambda: disk._results.qsize(), timeout=30, message="the read-back's check")
    reader.step()  # as the worker's loop does when the disk thread wakes it
    steps = 1
    while reader.has_work:
        reader.step()
        steps += 1
        assert steps < 1000
    assert steps > 4 and len(reader.prefix_cache) == 1
    assert rehearsed == [1]  # once, with the file in the memory tier
    _, done = run(reader, prompt=SECOND)
    assert done["cached_tokens"] > 0


def test_read_backs_before_ready_end_in_memory_rehearsed_within_their_time(tiny_model, tmp_path, monkeypatch):
    """A starting worker reads its files back before `ready` (no quiet wait:
    no request can come yet): each in the memory tier and a hit rehearsed,
    so a question asked at once finds its prefix in memory. With no time
    left the rest goes on after `ready`, as before."""
    from worker.__main__ import read_back

    disk = disk_after_first(tiny_model, tmp_path)
    reader = engine_for(tiny_model, prefix_disk=disk)
    rehearsed = []
    rehearse = reader.prefix_cache.rehearse
    monkeypatch.setattr(reader.prefix_cache, "rehearse", lambda: rehearsed.append(len(reader.prefix_cache)) or rehearse())
    entries = list(disk._index.values())
    for entry in entries:
        assert disk.read(entry, read_back=True)
    assert read_back(reader, disk, time.monotonic() + 60)
    assert len(reader.prefix_cache) == len(entries) and rehearsed == [len(entries)]
    assert not disk.reading and not reader.has_work
    _, done = run(reader, prompt=SECOND)
    assert done["cached_tokens"] > 0

    late = engine_for(tiny_model, prefix_disk=disk)
    for entry in entries:
        assert disk.read(entry, read_back=True)
    assert not read_back(late, disk, time.monotonic())  # no time: nothing waited for
    deadline = time.monotonic() + 60
    while disk.reading or late.has_work or len(late.prefix_cache) < len(entries):
        assert time.monotonic() < deadline, "the read-backs after ready"
        late.step()


def test_a_hit_is_rehearsed_only_once_no_request_runs(tiny_model, tmp_path, monkeypatch):
    """Read-backs made into arrays while a request is in the worker leave
    the rehearsal for after it, so it holds up no step of a request."""
    from worker.cache import prefix_disk

    monkeypatch.setattr(prefix_disk, "READ_BACK_QUIET_S", 0.0)
    disk = disk_after_first(tiny_model, tmp_path)
    reader = engine_for(tiny_model, prefix_disk=disk)
    rehearsed = []
    rehearse = reader.prefix_cache.rehearse
    monkeypatch.setattr(reader.prefix_cache, "rehearse", lambda: rehearsed.append(reader.busy) or rehearse())
    entries = list(disk._index.values())
    for entry in entries:
        assert disk.read(entry, read_back=True)
    reader.submit(Generate(rid=0, prompt="An unrelated question about rivers.", temperature=0.0, max_tokens=4), 0.0)
    deadline = time.monotonic() + 60
    # The scheduler's own handling of disk results, run while the request waits.
    while disk.reading or reader._restoring or len(reader.prefix_cache) < len(entries):
        assert time.monotonic() < deadline, "the read-backs"
        reader._disk_results()
    assert reader.busy and rehearsed == []
    reader.drain()
    while reader.has_work:
        assert time.monotonic() < deadline, "the rehearsal"
        reader.step()
    assert rehearsed == [False]


def test_a_rehearsed_hit_leaves_its_copy_s_buffers_in_mlx_s_cache(tiny_model, tmp_path):
    """The rehearsal makes the live cache a hit on the longest snapshot
    makes, so a restarted worker's first hit gets its buffers back from
    mlx's cache rather than from memory never touched."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    disk = disk_after_first(tiny_model, tmp_path)
    reader = engine_for(tiny_model, prefix_disk=disk)
    assert reader.prefix_cache.rehearse() == 0  # nothing held
    entries = list(disk._index.values())
    for entry in entries:
        assert disk.read(entry, read_back=True)
    deadline = time.monotonic() + 60
    while disk.reading or reader.has_work or len(reader.prefix_cache) < len(entries):
        assert time.monotonic() < deadline, "the read-backs"
        reader.step()  # as the worker's loop does when the disk thread wakes it
    held = list(reader.prefix_cache._entries.values())
    longest = max(held, key=lambda e: len(e.tokens))
    capacity = -(-(len(longest.tokens) + 1) // KVCache.step) * KVCache.step
    kinds = make_prompt_cache(reader.prefix_cache.model)
    kv = [saved for c, saved in zip(kinds, longest.layers) if isinstance(c, KVCache)]
    copy_bytes = sum(2 * k.shape[0] * k.shape[1] * capacity * k.shape[3] * k.itemsize for k, _ in kv)
    mx.clear_cache()
    assert reader.prefix_cache.rehearse() == len(longest.tokens)
    assert kv and mx.get_cache_memory() >= copy_bytes
    assert list(reader.prefix_cache._entries.values()) == held


def test_another_models_files_are_in_another_directory(tiny_model, second_model, tmp_path):
    """Lookups read the model key's directory alone, and the key follows the
    weights' content (and the dtype and quantization a worker runs with)."""
    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_file import model_key
    from worker.runtime.loader import load

    one, other = load(tiny_model), load(second_model)
    keys = {
        model_key(tiny_model, "bf16 kv", one.model),
        model_key(second_model, "bf16 kv", other.model),
        model_key(tiny_model, "bf16 kv8g32", one.model),
    }
    assert len(keys) == 3
    assert model_key(tiny_model, "bf16 kv", one.model) in keys
    dirs = {PrefixDisk(tmp_path, key, 1 << 20).dir for key in keys}
    assert len(dirs) == 3


# -- in-process: the store itself -------------------------------------------------


def test_files_round_trip_exactly_and_the_bound_evicts_least_recently_used(tmp_path):
    import mlx.core as mx
    import numpy as np

    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    layers = snapshot_layers(0, 300)
    tokens = np.arange(300)
    disk.write(None, tokens, layers)
    assert disk.flush(30)
    one = disk.used
    assert len(disk) == 1 and one > 0
    found = disk.candidates(np.arange(400), lambda have, want: len(have))
    assert list(found) == [None] and found[None][0] == 300
    disk.read(found[None][1])
    wait_for(lambda: disk._results.qsize(), timeout=30, message="the read")
    [(entry, loaded)] = disk.results()
    back, nbytes = loaded.layers()
    assert back[0][0].dtype == mx.bfloat16 and back[1][1] is None and back[2] is None
    assert isinstance(back[0], tuple) and isinstance(back[1], list)
    for a, b in ((back[0][0], layers[0][0]), (back[0][1], layers[0][1]), (back[1][0], layers[1][0])):
        assert a.shape == b.shape and mx.array_equal(a, b).item()

    # Room for two files: the least recently used one goes.
    disk.budget = 2 * one + one // 2
    disk.write(None, np.arange(1000, 1300), snapshot_layers(1, 300))
    assert disk.flush(30)
    now = time.time()
    os.utime(path_of(disk, tokens), (now - 20, now - 20))
    os.utime(path_of(disk, np.arange(1000, 1300)), (now - 10, now - 10))
    disk._index = {}
    disk._scan()  # what a restart sees: the order comes from the files' times
    disk.touch(None, tokens)  # a hit on the older one
    disk.write(None, np.arange(2000, 2300), snapshot_layers(2, 300))
    assert disk.flush(30)
    assert {int(e.tokens[0]) for e in disk._index.values()} == {0, 2000}
    assert disk.used <= disk.budget and len(files(tmp_path)) == 2

    # The same tokens under another adapter are another entry.
    assert set(disk.candidates(np.arange(300), lambda have, want: len(have))) == {None}
    disk.write("adapter-sha", tokens, layers)
    assert disk.flush(30)
    assert set(disk.candidates(np.arange(300), lambda have, want: len(have))) == {None, "adapter-sha"}


def test_a_file_is_read_and_checked_in_chunks(tmp_path, monkeypatch):
    """Each chunk has its own checksum: a file of many chunks reads back
    exactly, and one byte changed in a middle chunk drops the file."""
    import mlx.core as mx
    import numpy as np

    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    monkeypatch.setattr(prefix_disk, "CHUNK", 1024)
    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    layers = snapshot_layers(3, 400)
    tokens = np.arange(400)
    disk.write(None, tokens, layers)
    assert disk.flush(30)
    entry = next(iter(disk._index.values()))
    assert entry.size > 10 * 1024
    back, _ = disk.load_now(entry).layers()
    for a, b in ((back[0][0], layers[0][0]), (back[0][1], layers[0][1]), (back[1][0], layers[1][0])):
        assert mx.array_equal(a, b).item()
    path = path_of(disk, tokens)
    sound = path.read_bytes()
    data = bytearray(sound)
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert disk.load_now(entry) is None
    assert not path.exists() and not len(disk)
    # A digit of the header's layout changed (which array goes where): the
    # header has a checksum of its own.
    at = sound.index(b"tree")
    assert sound[at : at + 40].count(b"[0, 1]") == 1  # the first layer's (keys, values)
    path.write_bytes(sound[:at] + sound[at:].replace(b"[0, 1]", b"[1, 0]", 1))
    disk._scan()
    assert disk.load_now(next(iter(disk._index.values()))) is None
    assert not path.exists()


def test_entries_read_back_are_keyed_by_adapter_content(tiny_model, tmp_path):
    """A snapshot read from disk serves only requests whose adapter has the
    same content (another path with the same bytes included)."""
    import shutil

    from tests.lora_files import lora_pairs, targets_of, write_peft
    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_file import model_key
    from worker.runtime.loader import load

    one = write_peft(tmp_path / "one", lora_pairs(targets_of(tiny_model), seed=31, strength=2.0), r=4, alpha=8.0)
    same = shutil.copytree(one, tmp_path / "same")
    other = write_peft(tmp_path / "other", lora_pairs(targets_of(tiny_model), seed=32, strength=2.0), r=4, alpha=8.0)
    loaded = load(tiny_model)
    key = model_key(tiny_model, loaded.format, loaded.model)
    root = tmp_path / "prefix"
    writer = engine_for(tiny_model, prefix_disk=PrefixDisk(root, key, 1 << 30))
    run(writer, prompt=FIRST, lora=str(one))
    assert writer.prefix_cache.disk.flush(30)
    for lora in (str(other), None):
        # A fresh worker's memory each time: only the disk could serve it.
        reader = engine_for(tiny_model, prefix_disk=PrefixDisk(root, key, 1 << 30))
        _, done = run(reader, prompt=SECOND, lora=lora)
        assert "cached_tokens" not in done
    reader = engine_for(tiny_model, prefix_disk=PrefixDisk(root, key, 1 << 30))
    _, done = run(reader, prompt=SECOND, lora=str(same))
    assert done["cached_tokens"] > 0


def test_long_prompts_are_cut_and_kept_at_checkpoints(engine):
    from worker.cache.prefix_cache import CHECKPOINT, cut_points

    ids = [5] * (2 * CHECKPOINT + 100)
    ids[10] = ids[CHECKPOINT + 7] = 9
    assert cut_points(ids, 9) == [10, CHECKPOINT, CHECKPOINT + 7, 2 * CHECKPOINT]
    assert cut_points(ids[:50], 9) == [10]
    # A hybrid model keeps the first and last message starts and the last
    # checkpoint: a long message edited near its end resumes from there.
    assert not engine.prefix_cache.trimmable
    assert engine.prefix_cache.snapshot_points(len(ids), [10, CHECKPOINT + 7]) == {10, CHECKPOINT + 7, 2 * CHECKPOINT}


def test_a_request_stops_waiting_for_a_disk_that_hangs(tiny_model, tmp_path, monkeypatch):
    import threading

    from worker.engine import scheduler as scheduler_module

    disk = disk_after_first(tiny_model, tmp_path)
    release = threading.Event()
    hung = disk._load
    # A read that does not come back until the test ends.
    monkeypatch.setattr(disk, "_load", lambda entry, stop=None: release.wait(60) and hung(entry, stop))
    monkeypatch.setattr(scheduler_module, "READ_WAIT_S", 0.5)
    reader = engine_for(tiny_model, prefix_disk=disk)
    try:
        _, done = run(reader, prompt=SECOND)
        assert "cached_tokens" not in done
        assert disk.reading
    finally:
        release.set()


def test_a_requests_read_goes_before_read_backs_and_takes_the_place_of_its_own(tmp_path, monkeypatch):
    """Read-backs at a worker's start wait behind a request's read, even one
    already begun (it stops and is read again later), and a request that
    needs a file still waiting to be read back moves it ahead."""
    import threading

    import numpy as np

    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    for i in range(4):
        disk.write(None, np.arange(i * 1000, i * 1000 + 50), snapshot_layers(i, 50))
    assert disk.flush(30)
    entries = {int(e.tokens[0]) // 1000: e for e in disk._index.values()}
    order = []
    hold = threading.Event()
    original = disk._load

    def load(entry, stop=None):
        order.append(int(entry.tokens[0]) // 1000)
        if len(order) == 1:
            hold.wait(30)  # the first read-back, while the others queue
        return original(entry, stop)

    monkeypatch.setattr(disk, "_load", load)
    for i in (0, 1, 2):
        assert disk.read(entries[i], read_back=True)
    wait_for(lambda: order, timeout=30, message="the first read-back")
    assert disk.read(entries[3])  # a request's own file
    assert not disk.read(entries[2])  # a request's file waiting to be read back
    assert not disk.read(entries[1], read_back=True)  # already waiting
    hold.set()
    wait_for(lambda: disk._results.qsize() == 4, timeout=30, message="the reads")
    # 0 had begun: it stopped for the requests' reads and went first of
    # the read-backs left.
    assert order == [0, 3, 2, 0, 1]
    assert sorted(int(e.tokens[0]) // 1000 for e, loaded in disk.results() if loaded is not None) == [0, 1, 2, 3]
    assert not disk.reading


def test_read_backs_wait_for_quiet_after_a_requests_read(tmp_path):
    """Read-backs start READ_BACK_QUIET_S after they are queued and after a
    request's read, so a request right after a start reads its file alone."""
    import numpy as np

    from worker.cache.prefix_disk import READ_BACK_QUIET_S, PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    for i in range(2):
        disk.write(None, np.arange(i * 1000, i * 1000 + 50), snapshot_layers(i, 50))
    assert disk.flush(30)
    back, asked = sorted(disk._index.values(), key=lambda e: int(e.tokens[0]))
    now = [100.0]
    disk._clock = lambda: now[0]
    assert disk.read(back, read_back=True)
    assert disk._held() == READ_BACK_QUIET_S
    now[0] += READ_BACK_QUIET_S * 0.8
    assert disk._next_read() == (None, True)
    assert disk.read(asked)  # a request's: read at once, and the read-back waits again
    wait_for(lambda: disk._results.qsize() == 1, timeout=30, message="the request's read")
    assert disk._held() == READ_BACK_QUIET_S and [e.name for e in disk._read_backs] == [back.name]
    now[0] += READ_BACK_QUIET_S
    wait_for(lambda: disk._results.qsize() == 2, timeout=30, message="the read-back")
    assert [e.name for e, loaded in disk.results() if loaded is not None] == [asked.name, back.name]


def test_a_request_for_a_file_held_for_read_back_reads_it_at_once(tmp_path, monkeypatch):
    import threading

    import numpy as np

    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    monkeypatch.setattr(prefix_disk, "READ_BACK_QUIET_S", 3600.0)
    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    disk.write(None, np.arange(50), snapshot_layers(0, 50))
    assert disk.flush(30)
    [entry] = disk._index.values()
    held = []

    def now() -> float:
        if threading.current_thread().name == "prefix-disk":
            held.append(True)
        return time.monotonic()

    disk._clock = now
    assert disk.read(entry, read_back=True)
    # The disk thread has seen the read-back held, twice: after its read
    # loop and before it waits out the quiet time.
    wait_for(lambda: len(held) >= 2, timeout=30, message="the disk thread holding the read-back")
    assert not disk.read(entry)  # already queued: it moves ahead, and the disk thread wakes
    wait_for(lambda: disk._results.qsize() == 1, timeout=30, message="the request's read")


def test_a_file_slower_to_read_than_its_tokens_to_compute_is_not_read():
    from worker.cache.disk_rates import slower_than_prefill

    # 312 MB at 0.3 GB/s (1.04 s) against 26,000 tokens at 11,000 tokens/s (2.4 s): read.
    assert not slower_than_prefill(312 << 20, 26_000, 0.3e9, 11_000)
    # 3.8 GB at 0.3 GB/s (12.7 s) against the same tokens at 6,000 tokens/s (4.3 s): computed.
    assert slower_than_prefill(3_800_000_000, 26_000, 0.3e9, 6_000)
    # Either rate unmeasured: read.
    assert not slower_than_prefill(3_800_000_000, 26_000, None, 6_000)
    assert not slower_than_prefill(3_800_000_000, 26_000, 0.3e9, None)


def test_the_scheduler_times_reads_and_prompts_and_skips_a_file_that_would_cost_more(tiny_model, tmp_path, monkeypatch, caplog):
    """Reads and long prompts are timed as they happen; a request whose file
    would take longer to read than its tokens to compute runs without it,
    with a log line, and the same request reads it while either rate is
    unmeasured."""
    import logging

    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_file import model_key
    from worker.engine import scheduler as scheduler_module
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    key = model_key(tiny_model, loaded.format, loaded.model)
    monkeypatch.setattr(scheduler_module, "RATE_MIN_TOKENS", 16)
    writer = engine_for(tiny_model, prefix_disk=PrefixDisk(tmp_path, key, 1 << 30))
    run(writer, prompt=FIRST)
    assert writer.prefix_cache.disk.flush(30)
    assert writer.disk_rates.prefill.value > 0  # a prompt of more than 16 tokens, all computed

    slow = PrefixDisk(tmp_path, key, 1 << 30)
    reader = engine_for(tiny_model, prefix_disk=slow)
    reader.disk_rates.read.add(1, 1)  # a byte a second
    reader.disk_rates.prefill.add(1e6, 1)
    with caplog.at_level(logging.INFO, logger="worker"):
        _, done = run(reader, prompt=SECOND)
    assert "cached_tokens" not in done and not slow.reading
    assert "not read: 0 MB at 0.00 GB/s takes longer than" in caplog.text

    fresh = engine_for(tiny_model, prefix_disk=PrefixDisk(tmp_path, key, 1 << 30))
    assert fresh.disk_rates.read.value is None
    _, done = run(fresh, prompt=SECOND)
    assert done["cached_tokens"] > 0 and fresh.disk_rates.read.value > 0


def test_read_backs_make_their_arrays_after_the_file_a_request_waits_for(tiny_model, tmp_path, monkeypatch):
    """Arrays are made on the main thread: a file read back at start that no
    request waits for is held while a request waits for its own file."""
    import threading

    from ipc.messages import Generate
    from worker.cache import prefix_loaded

    disk = disk_after_first(tiny_model, tmp_path)
    system, turn = sorted(disk._index.values(), key=lambda e: len(e.tokens))
    release = threading.Event()
    original = disk._load

    def load_file(entry, stop=None):
        if entry is system:
            release.wait(60)  # the request's file comes after the read-back
        return original(entry, stop)

    monkeypatch.setattr(disk, "_load", load_file)
    made = []
    parts = prefix_loaded.Loaded.parts

    def tracked(self, step_bytes, beside=None):
        made.append(self.entry.name)  # when its first array is made
        return (yield from parts(self, step_bytes, beside))

    monkeypatch.setattr(prefix_loaded.Loaded, "parts", tracked)
    reader = engine_for(tiny_model, prefix_disk=disk)
    assert disk.read(turn, read_back=True)
    wait_for(lambda: disk._results.qsize(), timeout=30, message="the read-back")
    reader.submit(Generate(rid=1, prompt=SECOND, temperature=0.0, max_tokens=4), 0.0)  # waits for the system prompt's file
    reader.step()
    assert made == [] and not reader.has_work  # the read-back waits; nothing spins
    release.set()
    reader.drain()
    assert made == [system.name, turn.name]
    assert "cached_tokens" in json.loads(reader.lines[-1].splitlines()[-1][len(b"@@lattice ") :])
