from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from harness.engine import engine_for
from harness.models import TINY_DENSE, build_dense_model
from harness.procs import build_demo_model, install_tag, tagged_processes, wait_for
from harness.prompts import ADAPTER_LONG, ADAPTER_PROMPTS, ADAPTER_TOKENS
from harness.worker import WorkerProc
from tests.lora_files import deltas, lora_pairs, merge_into, targets_of, write_mlx, write_mlx_lm, write_peft
from worker.runtime.kernel_cache import ENV as PTX_ENV, gpu_name, kernel_cache_dir

TAG = install_tag()
_long_lived: set[int] = set()

# How far batching or a compiled step may move a row's logits (float32 on
# CPU). Measured: 0 in this process (mlx's bundled BLAS), as batched and
# fused kernels compute each element as the ops do; the room is for
# compilers that contract multiply-adds. A mask one column short moves a
# lone row's logits by 1.5e-4, a batch's by 6e-2.
LOGIT_TOLERANCE = 2e-5
# How far every greedy choice must win for texts computed in two ways (a
# worker's batch, this process alone) to be compared on any CPU: the
# workers' OpenBLAS moves logits by about 1e-5, its kernels chosen by the
# CPU and the matrix shapes, so this leaves room a thousandfold.
GREEDY_MARGIN = 1e-2


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny")


@pytest.fixture(scope="session")
def tiny_q4_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny-q4", "--q4")


@pytest.fixture(scope="session")
def second_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny-b", "--seed", "1")


@pytest.fixture(scope="session")
def small_model(models_dir) -> Path:
    return build_demo_model(models_dir / "small", "--size", "small")


@pytest.fixture(scope="session")
def dense_model(models_dir, tiny_model) -> Path:
    """A small attention-only Qwen3 (every layer a trimmable KV cache) with the
    demo tokenizer and seeded random weights."""
    return build_dense_model(models_dir / "dense", tiny_model, **TINY_DENSE)


def greedy_steps(model, codec, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Up to n greedy tokens of `model` (in this process) after `prompt`,
    ending at an end-of-sequence id (not included), and at each step how far
    the chosen logit is above the runner-up."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(codec.encode(prompt))[None], cache=cache)[0, -1]
    ids, margins = [], []
    for _ in range(n):
        top = mx.sort(logits)[-2:].tolist()
        margins.append(top[1] - top[0])
        token = int(mx.argmax(logits).item())
        if token in codec.eos_ids:
            break
        ids.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return ids, margins


def margins_of(model_dir: Path):
    """margins(prompts, n): for each greedy step of each prompt, in this
    process, how far the chosen logit is above the runner-up."""
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    loaded = load(model_dir)
    codec = TextCodec(model_dir, loaded.config)
    return lambda prompts, n: [m for prompt in prompts for m in greedy_steps(loaded.model, codec, prompt, n)[1]]


@pytest.fixture(scope="session")
def greedy_margins(tiny_model):
    return margins_of(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A scheduler of the tiny model in this process, with its prefix cache."""
    return engine_for(tiny_model)


# -- two adapters of the tiny model, in every format, and greedy references ----

FORMATS = ("peft", "mlx", "mlx-lm")
SCALE = 2.0  # every adapter below is written to scale by this


# Two updates: "x" of rank 4 on every linear layer, "y" of rank 8 on the
# attention and MLP layers only (so the stacks pad ranks, and some layers
# hold one adapter of the two).
UPDATES = {"x": dict(rank=4, groups=("attention", "mlp", "linear_attn"), seed=41), "y": dict(rank=8, groups=("attention", "mlp"), seed=42)}


def write_update(fmt: str, out, pairs, rank: int):
    if fmt == "peft":
        return write_peft(out, pairs, r=rank, alpha=SCALE * rank)
    if fmt == "mlx":
        return write_mlx(out.with_suffix(".safetensors"), pairs, alpha=SCALE * rank)
    return write_mlx_lm(out, pairs, rank=rank, scale=SCALE)


@pytest.fixture(scope="module")
def updates(tiny_model):
    targets = targets_of(tiny_model)
    return {name: (lora_pairs(targets, groups=u["groups"], rank=u["rank"], seed=u["seed"]), u["rank"]) for name, u in UPDATES.items()}


@pytest.fixture(scope="module")
def files(updates, tmp_path_factory):
    """Each update in each format: (name, format) -> path."""
    root = tmp_path_factory.mktemp("multi")
    return {(name, fmt): str(write_update(fmt, root / f"{name}-{fmt}", pairs, rank)) for name, (pairs, rank) in updates.items() for fmt in FORMATS}


@pytest.fixture(scope="module")
def references(tiny_model, updates):
    """Greedy texts of the base and of each merged model, by (name, prompt
    index) (and by (name, prompt index, ADAPTER_LONG) for the long rows), with the
    smallest greedy margin of all of them."""
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, load(tiny_model).config)
    texts, margins = {}, []
    for name in (None, *updates):
        model = load(tiny_model).model
        if name is not None:
            pairs, _ = updates[name]
            merge_into(model, deltas(pairs, SCALE))
        for i, prompt in enumerate(ADAPTER_PROMPTS):
            ids, m = greedy_steps(model, codec, prompt, ADAPTER_LONG if i < 2 else ADAPTER_TOKENS)
            texts[name, i] = codec.decode(ids[:ADAPTER_TOKENS])
            texts[name, i, ADAPTER_LONG] = codec.decode(ids)
            margins += m
    assert len({texts[name, 0] for name in (None, *updates)}) == 3, "each adapter must change the text"
    return texts, min(margins)


@pytest.fixture(scope="session", autouse=True)
def private_control_socket(tmp_path_factory):
    """Pools started by tests claim this default control socket, never the
    user's (~/.lattice/pool.sock or $XDG_RUNTIME_DIR's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LATTICE_CONTROL_SOCKET", str(tmp_path_factory.mktemp("run") / "pool.sock"))
        yield


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Pools and workers started by tests keep their caches (the prefix
    cache's files, the demo model) in a directory of their own, never in
    the user's ~/.cache/lattice-pool. Their compiled kernels stay in the
    machine's temp dir, shared by every test process and session: a fresh
    directory would have each session's workers compile every kernel
    again (on an H100 a worker of the tiny model took over 100 s to be
    ready with an empty CUDA kernel directory)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        mp.setenv("LATTICE_CPU_KERNELS", tempfile.gettempdir())
        if mx.cuda.is_available():
            mp.setenv(PTX_ENV, str(kernel_cache_dir({"XDG_CACHE_HOME": tempfile.gettempdir()}, mx.__version__, gpu_name())))
        yield


@pytest.fixture(scope="session", autouse=True)
def gpu_kernels(private_cache_dir, request):
    """On a GPU, one worker of the tiny model is started before any test,
    one test process at a time, so that the kernels every worker needs are
    compiled once, with time to do it, rather than inside the tests'
    deadlines."""
    if not mx.cuda.is_available():
        yield
        return
    lock = Path(os.environ[PTX_ENV]).parent / "warm.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        w = WorkerProc(request.getfixturevalue("tiny_model"))
        try:
            w.wait_ready(timeout=900)
        finally:
            assert w.close() == 0
    yield


# A GPU computes in bf16, where a greedy choice can tie with the runner-up;
# tests that compare texts computed two ways need every choice to win by
# GREEDY_MARGIN, which the CPU's float32 gives.
float32_margins = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="greedy texts compared by margin: float32 on the CPU; a GPU's bf16 logits tie")


@pytest.fixture
def spawn_pool():
    """Starts `lattice-pool serve` processes; kills any a failing test left."""
    from harness.pool import PoolProc

    made = []

    def make(*args, **kwargs):
        pool = PoolProc(*args, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.kill()


def keep_alive_across_tests(pid: int) -> None:
    """Lets a module- or session-scoped fixture own a process across tests."""
    _long_lived.add(pid)


def release(pid: int) -> None:
    _long_lived.discard(pid)


def shared_http_pool(config: Path, model: str, *args: str, env: dict[str, str] | None = None):
    """For a module-scoped fixture: `yield from` it to share one pool (its
    HTTP on port 0, `model` ready) across a module's tests."""
    from harness.http import with_http
    from harness.pool import PoolProc

    pool = PoolProc("--config", str(config), "--http", "0", *args, env=env)
    keep_alive_across_tests(pool.proc.pid)
    pool.wait_ev("ready", model=model)
    yield with_http(pool)
    release(pool.proc.pid)
    assert pool.close() == 0


def shared_worker(model: Path, *args: str):
    """For a module-scoped fixture: `yield from` it to share one ready
    worker process across a module's tests."""
    w = WorkerProc(model, *args)
    keep_alive_across_tests(w.pid)
    w.wait_ready()
    yield w
    release(w.pid)
    assert w.close() == 0


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """No worker, supervisor or fake worker outlives the test that started it."""
    yield

    def leaked():
        return [p for p in tagged_processes(TAG) if p.pid not in _long_lived and not _ancestors(p) & _long_lived]

    try:
        wait_for(lambda: not leaked(), timeout=15, message="test processes to exit")
    except AssertionError:
        left = leaked()
        described = [_describe(p) for p in left]
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
        pytest.fail(f"processes outlived their test: {described}")


def _describe(proc) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())}"
    except Exception:
        return str(proc.pid)


def _ancestors(proc) -> set[int]:
    """Its parent's pid, the grandparent's, ...: a worker of a long-lived
    pool, or a rank such a worker started (docs/scaling.md), lives as long."""
    try:
        return {p.pid for p in proc.parents()}
    except Exception:
        return set()


def pytest_sessionfinish(session, exitstatus):
    left = tagged_processes(TAG)
    for p in left:
        try:
            p.kill()
        except Exception:
            pass
    if left and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nprocesses left at session end: {[p.pid for p in left]}", file=sys.stderr)
