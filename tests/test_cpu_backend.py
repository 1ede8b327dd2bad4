"""The CPU path: OpenBLAS really serves mlx's float32 matmuls, results hold."""

import json
import platform
import subprocess
import sys
import textwrap

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
    assert fast["loaded"] and "openblas" in fast["provider"]
    assert fast["same_as_direct"] and fast["close"]
    bundled = probe(SGEMM_PROBE, LATTICE_CPU_BLAS="bundled")
    assert bundled["loaded"] is None and bundled["provider"] is None
    assert bundled["same_as_direct"] and bundled["close"]
    # Two libraries really ran: they round differently.
    assert fast["bits"] != bundled["bits"]


LOGITS_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from worker.runtime.cpu_backend import load_openblas
    load_openblas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    path = Path(sys.argv[1])
    loaded = load(path, cpu_float32=sys.argv[2] == "float32")
    ids = TextCodec(path, loaded.config).encode(
        "<|im_start|>user\\nTell me about the river and the mill.<|im_end|>\\n<|im_start|>assistant\\n")
    logits = loaded.model(mx.array(ids)[None], cache=make_prompt_cache(loaded.model))
    print(json.dumps(logits[0].astype(mx.float32).tolist()))
    """
)


@pytest.mark.parametrize("model", ["tiny_model", "tiny_q4_model"])
def test_float32_path_keeps_the_results(model, request):
    path = str(request.getfixturevalue(model))
    fast = np.array(probe(LOGITS_PROBE, path, "float32"))
    reference_blas = np.array(probe(LOGITS_PROBE, path, "float32", LATTICE_CPU_BLAS="bundled"))
    stored = np.array(probe(LOGITS_PROBE, path, "stored"))

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(fast, reference_blas) < 1e-5
    # As stored means bf16 activations: float32 differs by bf16 rounding only.
    assert rel(fast, stored) < 3e-2


def test_worker_maps_openblas(tiny_model):
    w = WorkerProc(tiny_model)
    try:
        w.wait_ready()
        with open(f"/proc/{w.pid}/maps") as f:
            maps = f.read()
        assert "libopenblas" in maps
    finally:
        assert w.close() == 0
    assert b"BLAS: " in w.stderr and b"openblas" in w.stderr
