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
    from worker.runtime.cpu_backend import load_openblas, thin_products_forwarded
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
    print(json.dumps({"prompt": prompt.tolist(), "step": step.tolist(), "forwarded": forwarded}))
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
# transposition, with padded leading dimensions, against float64 numpy; and
# mlx's own one-row and one-column products, counted.
FORWARD_PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    import numpy as np
    from worker.runtime.cpu_backend import load_openblas, thin_products_forwarded, sgemm_provider
    load_openblas()
    import mlx.core as mx

    forwarded = thin_products_forwarded()
    out = {"provider": sgemm_provider(), "forwarded": forwarded}
    if forwarded is not None:
        fn = ctypes.CDLL(None).cblas_sgemm
        rng = np.random.default_rng(1)
        worst = 0.0
        for m, n, k in ((1, 40, 24), (24, 1, 40), (1, 1, 33), (2, 40, 24), (3, 5, 7), (5, 6, 9)):
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
                        assert np.array_equal(c[:, n:], c0[:, n:], equal_nan=True), "wrote past the row"
        out["worst_rel"] = worst
        before = thin_products_forwarded()
        w = mx.array(rng.standard_normal((48, 32)).astype(np.float32))
        x = mx.array(rng.standard_normal((1, 32)).astype(np.float32))
        mx.eval(x @ w.T)
        out["one_row"] = thin_products_forwarded() - before
        mx.eval(mx.concatenate([x, x, x]) @ w.T)
        out["three_rows"] = thin_products_forwarded() - before - out["one_row"]
        mx.eval(mx.concatenate([x, x, x, x]) @ w.T)
        out["four_rows"] = thin_products_forwarded() - before - out["one_row"] - out["three_rows"]
        # Row by row, a row of a thin product is the row alone, bit for bit.
        rows = mx.array(rng.standard_normal((3, 32)).astype(np.float32))
        alone = mx.concatenate([rows[i : i + 1] @ w.T for i in range(3)])
        out["rows_as_alone"] = bool(mx.array_equal(rows @ w.T, alone).item())
    print(json.dumps(out))
    """
)


def test_thin_products_go_to_sgemv_and_stay_exact(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    on = probe(FORWARD_PROBE, **env)
    assert "gemv-forward-" in on["provider"] and str(tmp_path) in on["provider"]
    assert on["worst_rel"] < 1e-5
    assert on["one_row"] == 1 and on["three_rows"] == 1 and on["four_rows"] == 0
    assert on["rows_as_alone"]
    off = probe(FORWARD_PROBE, LATTICE_CPU_GEMV="off", **env)
    assert off["forwarded"] is None and "openblas" in off["provider"]


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
    assert "gemv-forward-" in again["provider"] and again["one_row"] == 1
    assert probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))["provider"] == built
    # A sound library of another kind under its name (here the C maths
    # library) never enters the global scope: refused, built again.
    with open("/proc/self/maps") as f:
        libm = next(line.split()[-1] for line in f if "/libm.so" in line or "/libm-" in line)
    shutil.copyfile(libm, built)
    other = probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))
    assert "gemv-forward-" in other["provider"] and other["one_row"] == 1
    assert sorted(p.name for p in (tmp_path / "lattice-pool" / "cpu-blas").iterdir()) == [Path(built).name]
    assert probe(FORWARD_PROBE, XDG_CACHE_HOME=str(tmp_path))["provider"] == built


def test_a_decode_step_through_sgemv_gives_the_logits_of_sgemm(tiny_model):
    on = probe(LOGITS_PROBE, str(tiny_model), "float32")
    off = probe(LOGITS_PROBE, str(tiny_model), "float32", LATTICE_CPU_GEMV="off")
    assert on["forwarded"] > 0 and off["forwarded"] == 0
    a, b = np.array(on["step"]), np.array(off["step"])
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
    assert b"BLAS: " in w.stderr and b"openblas" in w.stderr and b"products of up to 3 rows through its sgemv" in w.stderr
