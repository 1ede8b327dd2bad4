"""The CPU path: OpenBLAS really serves mlx's float32 matmuls, results hold."""

import json
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.procs import ROOT, child_env
from harness.worker import WorkerProc


def _mlx_on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() != mx.cpu


pytestmark = [
    pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="OpenBLAS is wired up for Linux x86-64"),
    # mlx-cuda computes on the GPU and ships no reference BLAS to replace.
    pytest.mark.skipif(_mlx_on_gpu(), reason="MLX runs on a GPU here: the CPU backend is not used"),
]

# Multiplies through mlx, then through the expected library's own cblas_sgemm
# with the arguments mlx passes: bitwise equality says which one mlx called.
SGEMM_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    import numpy as np
    from worker.runtime.cpu_backend import _dist_file, load_openblas, sgemm_provider
    loaded = load_openblas()
    import mlx.core as mx

    rng = np.random.default_rng(0)
    m, k, n = 64, 1000, 48
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b))

    def direct(path):
        c = np.zeros((m, n), np.float32)
        fn = ctypes.CDLL(path).cblas_sgemm
        fn(101, 111, 111, m, n, k, ctypes.c_float(1.0), a.ctypes.data_as(ctypes.c_void_p), k,
           b.ctypes.data_as(ctypes.c_void_p), n, ctypes.c_float(0.0), c.ctypes.data_as(ctypes.c_void_p), n)
        return c

    expected = direct(loaded or str(_dist_file("mlx-cpu", "libblas*.so*")))
    print(json.dumps({
        "loaded": loaded, "provider": sgemm_provider(), "same_as_direct": bool((got == expected).all()),
        "bits": got.tobytes().hex(), "close": bool(np.allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)),
    }))
    """
)


def probe(code: str, *args: str, **env: str):
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=child_env(**env), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def test_openblas_serves_mlx_float32_matmuls():
    fast = probe(SGEMM_PROBE)
    # libmlx's cblas_sgemm is the one-row forwarding library, which hands
    # this 64-row product to OpenBLAS's own sgemm: the same bits.
    assert fast["loaded"] and "gemv-forward-" in fast["provider"]
    assert fast["same_as_direct"] and fast["close"]
    alone = probe(SGEMM_PROBE, LATTICE_CPU_GEMV="off")
    assert "openblas" in alone["provider"] and alone["bits"] == fast["bits"]
    bundled = probe(SGEMM_PROBE, LATTICE_CPU_BLAS="bundled")
    assert bundled["loaded"] is None and bundled["provider"] is None
    assert bundled["same_as_direct"] and bundled["close"]
    # Two libraries really ran: they round differently.
    assert fast["bits"] != bundled["bits"]


LOGITS_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from worker.runtime.cpu_backend import load_openblas, thin_kernel_products, thin_products_forwarded
    load_openblas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    path = Path(sys.argv[1])
    loaded = load(path, cpu_float32=sys.argv[2] == "float32")
    ids = TextCodec(path, loaded.config).encode(
        "<|im_start|>user\\nTell me about the river and the mill.<|im_end|>\\n<|im_start|>assistant\\n")
    cache = make_prompt_cache(loaded.model)
    prompt = loaded.model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(prompt)
    # Then a decode step: one row, every matmul a thin product.
    before = thin_products_forwarded() or 0
    step = loaded.model(mx.array([[ids[-1]]]), cache=cache)[0, -1].astype(mx.float32)
    mx.eval(step)
    forwarded = (thin_products_forwarded() or 0) - before
    # Then 4 tokens at once (a speculative verify's shape): the thin kernel's.
    before = thin_kernel_products() or 0
    block = loaded.model(mx.array([ids[-4:]]), cache=cache)[0].astype(mx.float32)
    mx.eval(block)
    in_kernel = (thin_kernel_products() or 0) - before
    print(json.dumps({"prompt": prompt.tolist(), "step": step.tolist(), "block": block.tolist(), "forwarded": forwarded, "in_kernel": in_kernel}))
    """
)


@pytest.mark.parametrize("model", ["tiny_model", "tiny_q4_model"])
def test_float32_path_keeps_the_results(model, request):
    path = str(request.getfixturevalue(model))
    fast = np.array(probe(LOGITS_PROBE, path, "float32")["prompt"])
    reference_blas = np.array(probe(LOGITS_PROBE, path, "float32", LATTICE_CPU_BLAS="bundled")["prompt"])
    stored = np.array(probe(LOGITS_PROBE, path, "stored")["prompt"])

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(fast, reference_blas) < 1e-5
    # As stored means bf16 activations: float32 differs by bf16 rounding only.
    assert rel(fast, stored) < 3e-2


# The forwarding library's cblas_sgemm called directly, row-major, every
# transposition, with padded leading dimensions, against float64 numpy (the
# thin kernel's shapes among them: 2 to 16 rows, k and n not multiples of
# its blocks); and mlx's own products of several sizes, counted.
FORWARD_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    import numpy as np
    from worker.runtime.cpu_backend import load_openblas, thin_kernel_products, thin_products_forwarded, thin_routes, sgemm_provider
    load_openblas()
    import mlx.core as mx

    forwarded = thin_products_forwarded()
    out = {"provider": sgemm_provider(), "forwarded": forwarded, "kernel": thin_kernel_products(), "routes": thin_routes()}
    if forwarded is not None:
        fn = ctypes.CDLL(None).cblas_sgemm
        rng = np.random.default_rng(1)
        worst = 0.0
        shapes = ((1, 40, 24), (24, 1, 40), (1, 1, 33), (2, 40, 24), (3, 5, 7), (5, 6, 9), (4, 41, 64), (13, 7, 35), (16, 2, 8), (17, 6, 9))
        # 4 x 1000 x 1100: enough multiply-adds for the kernel to split the
        # product among threads where OpenBLAS has several.
        for m, n, k in shapes + ((4, 1000, 1100),):
            for ta in (111, 112):
                for tb in (111, 112):
                    for beta in (0.0, 0.5):
                        a = rng.standard_normal((k, m) if ta == 112 else (m, k)).astype(np.float32)
                        b = rng.standard_normal((n, k) if tb == 112 else (k, n)).astype(np.float32)
                        pad = 3  # leading dimensions wider than the rows
                        ap = np.zeros((a.shape[0], a.shape[1] + pad), np.float32); ap[:, : a.shape[1]] = a
                        bp = np.zeros((b.shape[0], b.shape[1] + pad), np.float32); bp[:, : b.shape[1]] = b
                        c0 = rng.standard_normal((m, n + pad)).astype(np.float32)
                        if beta == 0.0:
                            c0[:] = np.nan  # unread when beta is 0
                        c = c0.copy()
                        fn(101, ta, tb, m, n, k, ctypes.c_float(1.5), ap.ctypes.data_as(ctypes.c_void_p), ap.shape[1],
                           bp.ctypes.data_as(ctypes.c_void_p), bp.shape[1], ctypes.c_float(beta), c.ctypes.data_as(ctypes.c_void_p), c.shape[1])
                        opa = a.T if ta == 112 else a
                        opb = b.T if tb == 112 else b
                        want = 1.5 * opa.astype(np.float64) @ opb + (beta * c0[:, :n] if beta else 0)
                        worst = max(worst, float(np.max(np.abs(c[:, :n] - want)) / np.max(np.abs(want))))
                        if (m, ta, tb, beta) == (4, 111, 112, 0.0):
                            out["split_bits"] = c[:, :n].tobytes().hex()
                        assert np.array_equal(c[:, n:], c0[:, n:], equal_nan=True), "wrote past the row"
        out["worst_rel"] = worst
        w = mx.array(rng.standard_normal((48, 40)).astype(np.float32))
        for rows in (1, 3, 4, 16, 17):
            x = mx.array(rng.standard_normal((rows, 40)).astype(np.float32))
            before, kernel_before = thin_products_forwarded(), thin_kernel_products()
            mx.eval(x @ w.T)
            out[f"rows_{rows}"] = [thin_products_forwarded() - before, None if kernel_before is None else thin_kernel_products() - kernel_before]
        # Rows of a product through sgemv a row at a time are the rows alone,
        # and rows through the kernel are the same rows in any other such
        # product, bit for bit.
        rows = mx.array(rng.standard_normal((16, 40)).astype(np.float32))
        alone = mx.concatenate([rows[i : i + 1] @ w.T for i in range(3)])
        out["rows_as_alone"] = bool(mx.array_equal(rows[:3] @ w.T, alone).item())
        pairs = mx.concatenate([rows[i : i + 2] @ w.T for i in range(0, 16, 2)])
        out["rows_as_in_pairs"] = bool(mx.array_equal(rows @ w.T, pairs).item())
    print(json.dumps(out))
    """
)


def _has_avx2_fma() -> bool:
    """Whether this CPU can run the thin kernel."""
    return {"avx2", "fma"} <= set(Path("/proc/cpuinfo").read_text().split())


def test_thin_products_skip_sgemm_and_stay_exact(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    on = probe(FORWARD_PROBE, OPENBLAS_NUM_THREADS="1", **env)
    assert "gemv-forward-" in on["provider"] and str(tmp_path) in on["provider"]
    assert on["worst_rel"] < 1e-5
    # [forwarded, through the kernel] for mlx's products of 1 to 17 rows.
    avx2 = _has_avx2_fma()
    assert on["rows_1"] == [1, 0 if avx2 else None]
    if avx2:
        assert on["rows_3"] == on["rows_4"] == on["rows_16"] == [1, 1] and on["rows_17"] == [0, 0]
        assert "through the thin kernel" in on["routes"] and on["rows_as_in_pairs"]
        # With 2 OpenBLAS threads: up to 4 rows, a large product split
        # between two threads to the same bits.
        split = probe(FORWARD_PROBE, OPENBLAS_NUM_THREADS="2", **env)
        assert split["worst_rel"] < 1e-5 and split["split_bits"] == on["split_bits"]
        assert split["rows_4"] == [1, 1] and split["rows_16"] == [0, 0]
        assert "2 to 4 rows" in split["routes"]
    # Without the kernel: sgemv a row at a time up to 3 rows, sgemm beyond.
    without = probe(FORWARD_PROBE, LATTICE_CPU_GEMV="sgemv", **env)
    assert without["kernel"] is None and without["worst_rel"] < 1e-5
    assert without["rows_3"] == [1, None] and without["rows_4"] == [0, None]
    assert without["rows_as_alone"] and without["routes"] == "; products of up to 3 rows through its sgemv"
    off = probe(FORWARD_PROBE, LATTICE_CPU_GEMV="off", **env)
    assert off["forwarded"] is None and off["kernel"] is None and "openblas" in off["provider"]


def test_without_a_compiler_or_with_a_damaged_library_sgemm_serves_every_product(tmp_path):
    fresh = tmp_path / "fresh"
    none = probe(FORWARD_PROBE, CC="/bin/false", XDG_CACHE_HOME=str(fresh))
    assert none["forwarded"] is None and "openblas" in none["provider"]
    assert not list(fresh.rglob("*.so")) and not list(fresh.rglob("*.tmp"))
    # Built once, then damaged on disk: opened, refused, built again.
    built = probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))["provider"]
    with open(built, "r+b") as f:
        f.write(b"not a library")
    again = probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))
    assert "gemv-forward-" in again["provider"] and again["rows_1"][0] == 1
    assert probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))["provider"] == built
    # A sound library of another kind under its name (here the C maths
    # library) never enters the global scope: refused, built again.
    with open("/proc/self/maps") as f:
        libm = next(line.split()[-1] for line in f if "/libm.so" in line or "/libm-" in line)
    shutil.copyfile(libm, built)
    other = probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))
    assert "gemv-forward-" in other["provider"] and other["rows_1"][0] == 1
    assert sorted(p.name for p in (tmp_path / "lattice-pool" / "cpu-blas").iterdir()) == [Path(built).name]
    assert probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))["provider"] == built


def test_thin_products_give_the_logits_of_sgemm(tiny_model):
    on = probe(LOGITS_PROBE, str(tiny_model), "float32")
    off = probe(LOGITS_PROBE, str(tiny_model), "float32", LATTICE_CPU_GEMV="off")
    assert on["forwarded"] > 0 and off["forwarded"] == 0 and off["in_kernel"] == 0
    if _has_avx2_fma():
        assert on["in_kernel"] > 0
    for part in ("step", "block"):
        a, b = np.array(on[part]), np.array(off[part])
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5


def test_worker_maps_openblas(tiny_model):
    w = WorkerProc(tiny_model)
    try:
        w.wait_ready()
        with open(f"/proc/{w.pid}/maps") as f:
            maps = f.read()
        assert "libopenblas" in maps
    finally:
        assert w.close() == 0
    assert b"BLAS: " in w.stderr and b"openblas" in w.stderr and b"one-row products through its sgemv" in w.stderr
