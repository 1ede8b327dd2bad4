"""The worker's own build of MLX-format model dirs against mlx-lm's full
loader: the same modules, parameters and config, and a worker that never
imports transformers for them. Other forms still go to mlx-lm."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from harness.procs import ROOT, child_env
from worker.runtime import loader


def _tree(model):
    return {name: value for name, value in tree_flatten(model.parameters())}


def _module_types(model):
    return {name: type(module).__name__ for name, module in model.named_modules()}


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_q4_model", "dense_model"])
def test_the_native_build_equals_mlx_lm_s_load(fixture, request):
    from mlx_lm.utils import load_model

    path = request.getfixturevalue(fixture)
    built = loader._build_native(path, loader.read_config(path))
    assert built is not None, "an MLX-format dir of a known architecture is built natively"
    native, native_config = built
    reference, reference_config = load_model(path, lazy=True)
    assert _module_types(native) == _module_types(reference)
    mine, theirs = _tree(native), _tree(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype, name
        assert mx.array_equal(mine[name], theirs[name]).item(), name
    assert native_config == reference_config


def test_a_quantized_dir_has_quantized_layers(tiny_q4_model):
    model, _ = loader._build_native(tiny_q4_model, loader.read_config(tiny_q4_model))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


def test_other_forms_go_to_mlx_lm(tiny_model, tmp_path):
    """A per-layer quantization table, a Hugging Face quantization config, an
    architecture outside the list: None here, and open_lazy still loads
    what mlx-lm can."""
    config = loader.read_config(tiny_model)
    for extra in (
        {"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp": False}},
        {"quantization_config": {"quant_method": "awq"}},
        {"model_type": "mistral"},
    ):
        assert loader._build_native(tiny_model, config | extra) is None, extra
    # A dir whose weights the native build cannot take (a missing tensor
    # fails its strict load) is still answered by mlx-lm's loader, whose
    # error names the directory.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    weights.pop(next(iter(sorted(weights))))
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(loader.ModelDirError, match="cannot load"):
        loader.open_lazy(broken)


def test_generation_config_s_eos_reaches_the_config(tiny_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert loader.open_lazy(copy).config["eos_token_id"] == [1, 2]


def test_loading_a_model_in_the_worker_never_imports_transformers(tiny_model):
    """What keeps a worker's start short: mlx-lm's package __init__ (and the
    transformers it imports) runs only when one of its names is asked for."""
    code = textwrap.dedent(
        f"""
        import sys
        from worker.runtime.loader import load
        load(__import__("pathlib").Path({str(tiny_model)!r}))
        assert "transformers" not in sys.modules, "transformers imported"
        from mlx_lm import stream_generate  # the package's names are still there
        assert callable(stream_generate) and "transformers" in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
