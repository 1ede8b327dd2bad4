"""max_batch = "auto": the sizing rule (pure arithmetic, no device needed)
and what a worker and the pool say they chose."""

import re

import pytest

from worker.runtime.batch_size import (
    CPU_MAX,
    FREE_SHARE,
    GPU_MAX,
    SIZING_TOKENS,
    auto_max_batch,
    batch_cache_bytes,
    default_batch_memory,
    gpu_memory,
    rows_memory_at_most,
)

GIB = 1024**3
# Qwen3-8B in bf16: 36 layers x (keys + values) x 8 heads x 128 x 2 bytes a token.
QWEN3_8B_TOKEN = 36 * 2 * 8 * 128 * 2


def test_gpu_rows_are_the_cache_memory_over_one_rows_cache():
    # An H200 after an 8B model's weights: 125 GiB free, a 35 GiB guard.
    size = auto_max_batch(processor="cuda", free_bytes=125 * GIB, guard_bytes=35 * GIB, row_fixed_bytes=0, row_token_bytes=QWEN3_8B_TOKEN, context=40960)
    assert size.rows == 35 * GIB // (QWEN3_8B_TOKEN * SIZING_TOKENS) == 62
    assert size.why.startswith("auto: 62:") and "35.0 GiB" in size.why and "4096 tokens" in size.why


def test_free_memory_bounds_it_below_the_guard():
    size = auto_max_batch(processor="cuda", free_bytes=8 * GIB, guard_bytes=35 * GIB, row_fixed_bytes=0, row_token_bytes=QWEN3_8B_TOKEN, context=40960)
    assert size.rows == int(8 * GIB * FREE_SHARE) // (QWEN3_8B_TOKEN * SIZING_TOKENS)


def test_rows_stay_within_bounds():
    small = {"free_bytes": 100 * GIB, "guard_bytes": 30 * GIB, "row_fixed_bytes": 1 << 20, "row_token_bytes": 1024, "context": 32768}
    assert auto_max_batch(processor="cuda", **small).rows == GPU_MAX
    assert auto_max_batch(processor="metal", **small).rows == GPU_MAX
    assert "the cuda cap" in auto_max_batch(processor="cuda", **small).why
    assert auto_max_batch(processor="cpu", **small).rows == CPU_MAX
    # Memory for less than one row still gives one: the memory guard then
    # admits a row alone, whatever its size.
    for free in (0, -5, GIB):
        assert auto_max_batch(processor="cuda", free_bytes=free, guard_bytes=GIB, row_fixed_bytes=0, row_token_bytes=QWEN3_8B_TOKEN, context=None).rows == 1
    # A CPU short of memory takes fewer than its cap.
    assert auto_max_batch(processor="cpu", free_bytes=4 * GIB, guard_bytes=GIB, row_fixed_bytes=0, row_token_bytes=QWEN3_8B_TOKEN, context=None).rows == 1


def test_a_short_context_sizes_rows_by_the_context():
    size = auto_max_batch(processor="cuda", free_bytes=100 * GIB, guard_bytes=GIB, row_fixed_bytes=0, row_token_bytes=1 << 20, context=512)
    assert size.rows == GIB // ((1 << 20) * 512) == 2
    assert "512 tokens" in size.why


def test_the_most_rows_take_is_the_guard_or_max_batch_rows_at_the_context():
    # Caches are padded to the longest row, in 256-token steps.
    assert batch_cache_bytes(3, 257, row_fixed_bytes=10, row_token_bytes=2) == 3 * (10 + 512 * 2)
    eight_b = {"row_fixed_bytes": 0, "row_token_bytes": QWEN3_8B_TOKEN}
    # Qwen3-8B's 40k context: 62 rows would take more than the 35 GiB guard.
    assert rows_memory_at_most(batch_memory=35 * GIB, max_batch=62, context=40960, **eight_b) == 35 * GIB
    # 4 rows at 40k: 22.5 GiB, below the guard.
    assert rows_memory_at_most(batch_memory=35 * GIB, max_batch=4, context=40960, **eight_b) == 4 * 40960 * QWEN3_8B_TOKEN
    # No stated context: rows of SIZING_TOKENS.
    assert rows_memory_at_most(batch_memory=35 * GIB, max_batch=4, context=None, **eight_b) == 4 * SIZING_TOKENS * QWEN3_8B_TOKEN


def test_gpu_memory_reads_metal_and_cuda_device_info():
    # As mlx 0.32 reports them on an M-series Mac and on an H200.
    assert gpu_memory({"memory_size": 68719476736, "architecture": "applegpu_g15d"}) == 64 * GIB
    assert gpu_memory({"total_memory": 150754820096, "free_memory": 149557477376, "architecture": "sm_90"}) == 150754820096
    assert gpu_memory({"architecture": "x"}) is None


@pytest.mark.parametrize(("args", "rows", "why"), [((), CPU_MAX, "auto: "), (("--max-batch", "3"), 3, "configured")])
def test_the_workers_ready_line_says_what_it_chose(tiny_model, args, rows, why):
    from harness.procs import wait_for
    from harness.worker import WorkerProc

    worker = WorkerProc(tiny_model, *args)
    try:
        ready = worker.wait_ready()
        assert ready["max_batch"] == rows and ready["max_batch_why"].startswith(why)
        assert ready["prefix_cache_bytes"] == 512 * 1024 * 1024  # the CPU's default
        # The log line comes before the ready line, but over stderr, which
        # another thread reads.
        wait_for(lambda: f"max_batch={rows} (" in worker.stderr.decode(), 30, message="the ready log line")
    finally:
        assert worker.close() == 0


def test_memory_held_elsewhere_leaves_a_worker_less_and_none_still_serves_one_row(tiny_model):
    """On a CPU the guard's default is a quarter of the RAM and at most three
    quarters of what is unused; the pool's other workers' memory is not
    unused."""
    import psutil

    from harness.procs import wait_for
    from harness.worker import WorkerProc

    def ready_line(worker: WorkerProc) -> dict[str, int]:
        line = wait_for(lambda: next((x for x in worker.stderr.decode().splitlines() if " ready: " in x), None), 30, message="the ready log line")
        return {k: int(v) for k, v in re.findall(r"(batch_memory|memory_held_elsewhere)=(\d+)", line)}

    total = psutil.virtual_memory().total
    prefix = 512 * 1024 * 1024  # the CPU's default prefix cache
    # 1 GiB left beside the prefix cache's budget: a guard of about 0.75 GiB.
    worker = WorkerProc(tiny_model, "--memory-held-elsewhere", str(total - prefix - GIB))
    try:
        ready = worker.wait_ready()
        figures = ready_line(worker)
        assert figures["memory_held_elsewhere"] == total - prefix - GIB
        assert 0.5 * GIB < figures["batch_memory"] <= 0.75 * GIB
        assert ready["rows_memory_bytes"] <= figures["batch_memory"]
    finally:
        assert worker.close() == 0
    # Nothing left: no guard, one row at a time, and requests are still served.
    worker = WorkerProc(tiny_model, "--memory-held-elsewhere", str(total))
    try:
        ready = worker.wait_ready()
        assert ready_line(worker)["batch_memory"] == 0 and ready["rows_memory_bytes"] == 0
        assert ready["max_batch"] == 1 and ready["max_batch_why"].startswith("auto: 1:")
        assert worker.generate(prompt="<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", max_tokens=3)["done"]
    finally:
        assert worker.close() == 0


def test_status_says_what_auto_chose(tiny_model, spawn_pool, tmp_path):
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "m"\npath = "{tiny_model}"\npreload = true\n')
    pool = spawn_pool("--config", str(config), "--no-control-socket")
    pool.wait_ev("ready", model="m")
    pool.send({"op": "status"})
    row = pool.wait_ev("status")["models"][0]
    assert row["max_batch"] == CPU_MAX and row["max_batch_why"].startswith("auto: 8, the cpu cap")
    assert row["prefix_cache_bytes"] == 512 * 1024 * 1024
    assert 0 < row["rows_memory_bytes"] < 256 * 1024**2  # 8 rows at the tiny model's context
    assert pool.close() == 0


def test_the_pool_tells_a_worker_what_the_others_hold_or_may_take(tiny_model, spawn_pool, tmp_path):
    import psutil

    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "a"\npath = "{tiny_model}"\npreload = true\n\n[[models]]\nname = "b"\npath = "{tiny_model}"\nmax_batch = 2\n')
    pool = spawn_pool("--config", str(config), "--no-control-socket")
    first = pool.wait_ev("ready", model="a")
    promise = first["weights_bytes"] + first["prefix_cache_bytes"] + first["rows_memory_bytes"]
    # 8 rows at the tiny model's whole context: far below the guard (a quarter of the RAM).
    assert 0 < first["rows_memory_bytes"] < 256 * 1024**2
    pool.send({"op": "load", "model": "b"})
    pool.wait_ev("ready", model="b")
    pool.send({"op": "status"})
    rows = {r["model"]: r for r in pool.wait_ev("status")["models"]}
    argv = psutil.Process(rows["b"]["pid"]).cmdline()
    assert argv[argv.index("--memory-held-elsewhere") + 1] == str(promise)
    assert "--memory-held-elsewhere" not in psutil.Process(rows["a"]["pid"]).cmdline()
    assert pool.close() == 0


def test_a_worker_leaves_its_prefix_cache_budget_out_of_the_rows_memory(tiny_model, monkeypatch):
    """On a GPU the prefix cache fills its budget as it is used: the rows are
    sized from the memory left after it."""

    from harness.engine import engine_for
    from worker.engine import scheduler as scheduler_module

    first = engine_for(tiny_model, max_batch=1)
    row = first.row_fixed_bytes + first.row_token_bytes * SIZING_TOKENS  # the tiny model has no stated context
    room = int(40.5 * row / FREE_SHARE)  # 40 rows of unused memory, below the 1 GiB guard
    monkeypatch.setattr(scheduler_module, "processor", lambda: "cuda")
    monkeypatch.setattr(scheduler_module, "unused_device_memory", lambda held_elsewhere: room - held_elsewhere)
    assert engine_for(tiny_model, max_batch=None, prefix_cache_bytes=0).max_batch == 40
    assert engine_for(tiny_model, max_batch=None, prefix_cache_bytes=int(20 * row / FREE_SHARE)).max_batch == 20


def test_a_max_context_below_the_sizing_tokens_sizes_rows_by_it(tiny_model, monkeypatch):
    """A model limited to a short context (the pool's max_context) never
    holds rows of 4096 tokens: auto sizes its rows at that context."""
    from harness.engine import engine_for
    from worker.engine import scheduler as scheduler_module

    first = engine_for(tiny_model, max_batch=1)
    short = first.row_fixed_bytes + first.row_token_bytes * 512
    monkeypatch.setattr(scheduler_module, "processor", lambda: "cuda")
    monkeypatch.setattr(scheduler_module, "unused_device_memory", lambda held_elsewhere: int(30.5 * short / FREE_SHARE))
    assert engine_for(tiny_model, max_batch=None, prefix_cache_bytes=0, max_context=512).max_batch == 30
    assert engine_for(tiny_model, max_batch=None, prefix_cache_bytes=0).max_batch < 30


def test_the_buffer_cache_is_a_quarter_of_the_batch_memory_and_at_least_a_gibibyte():
    from worker.runtime.memory import buffer_cache_limit

    assert buffer_cache_limit(20 << 30) == 5 << 30
    assert buffer_cache_limit(2 << 30) == 1 << 30
    assert buffer_cache_limit(0) == 1 << 30


def test_bound_buffer_cache_sets_mlx_cache_limit():
    import mlx.core as mx

    from worker.runtime.memory import bound_buffer_cache

    before = mx.set_cache_limit(0)
    try:
        assert bound_buffer_cache(40 << 30) == 10 << 30
        # set_cache_limit answers with the limit it replaces.
        assert mx.set_cache_limit(before) == 10 << 30
    finally:
        mx.set_cache_limit(before)


def test_the_default_batch_memory_is_a_quarter_of_the_device_within_what_others_left():
    # Alone on an H100: a quarter of its 80 GiB.
    assert default_batch_memory(80 * GIB, 78 * GIB, 10 * GIB) == 20 * GIB
    # Beside other workers that left 30 GiB: three quarters of it less the prefix cache.
    assert default_batch_memory(80 * GIB, 30 * GIB, 6 * GIB) == int(24 * GIB * FREE_SHARE)
    # Nothing left: nothing for rows (a lone request still starts).
    assert default_batch_memory(80 * GIB, 2 * GIB, 4 * GIB) == 0


def test_unused_device_memory_on_a_cpu_is_the_machine_less_mlx_buffers_in_use():
    import mlx.core as mx
    import psutil

    from worker.runtime.memory import unused_device_memory

    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU's figure; CUDA's comes from the driver")
    held = mx.ones((1 << 20,))
    mx.eval(held)
    assert unused_device_memory() == psutil.virtual_memory().total - mx.get_active_memory()
