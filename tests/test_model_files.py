"""Hostile files in a model dir: a config.json of a gigabyte, weights that
are a FIFO, a device or a directory. Each is refused before it is read, with
a cause that names the file, and with exit code 78 so the pool does not retry."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from harness.procs import ROOT, child_env
from ipc.files import MAX_CONFIG_BYTES, FileRefused, check_regular, read_capped
from ipc.worker_events import EX_CONFIG
from supervisor import local_models

GIB = 1 << 30


def copy_model(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in skip:
            shutil.copy(entry, dst / entry.name)
    return dst


def huge_config(tiny_model: Path, tmp_path: Path) -> Path:
    """The model with a sparse 1 GiB config.json: no disk used, but a whole
    read would take a gigabyte of memory and more to parse."""
    model = copy_model(tiny_model, tmp_path / "huge-config", skip=("config.json",))
    with open(model / "config.json", "wb") as f:
        f.truncate(GIB)
    return model


def fifo_weights(tiny_model: Path, tmp_path: Path) -> Path:
    model = copy_model(tiny_model, tmp_path / "fifo-weights", skip=("model.safetensors",))
    os.mkfifo(model / "model.safetensors")
    return model


def pool_config(tmp_path: Path, name: str, model: Path) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[[models]]\nname = "{name}"\npath = "{model}"\npreload = true\n')
    return str(path)


class TestReadCapped:
    def test_a_small_regular_file_is_read(self, tmp_path):
        (tmp_path / "c.json").write_bytes(b'{"a": 1}')
        assert read_capped(tmp_path / "c.json") == b'{"a": 1}'

    def test_a_file_over_the_cap_is_refused_by_its_size(self, tmp_path):
        path = tmp_path / "big.json"
        with open(path, "wb") as f:
            f.truncate(MAX_CONFIG_BYTES + 1)
        with pytest.raises(FileRefused, match=f"{MAX_CONFIG_BYTES + 1} bytes; the limit is {MAX_CONFIG_BYTES} bytes"):
            read_capped(path)
        (tmp_path / "edge.json").write_bytes(b"x" * 10)
        assert len(read_capped(tmp_path / "edge.json", limit=10)) == 10
        with pytest.raises(FileRefused):
            read_capped(tmp_path / "edge.json", limit=9)

    def test_fifos_directories_and_devices_are_refused_without_blocking(self, tmp_path):
        os.mkfifo(tmp_path / "fifo")
        (tmp_path / "dir").mkdir()
        for path, kind in ((tmp_path / "fifo", "a FIFO"), (tmp_path / "dir", "a directory"), (Path("/dev/zero"), "a device")):
            with pytest.raises(FileRefused, match=f"{path} is {kind}, not a regular file"):
                read_capped(path)
            with pytest.raises(FileRefused):
                check_regular(path)

    def test_a_missing_file_is_an_os_error(self, tmp_path):
        with pytest.raises(FileNotFoundError):
            read_capped(tmp_path / "none.json")


def run_worker_measured(model: Path) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in KiB) of a worker started on `model`,
    measured from a parent of its own, which waits for no other child."""
    probe = textwrap.dedent(
        """
        import resource, subprocess, sys, tempfile
        with tempfile.TemporaryFile() as err:
            # stdin stays open: at its end the worker would exit 0 at once.
            worker = subprocess.Popen([sys.executable, "-m", "worker", "--model", sys.argv[1]], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=err)
            try:
                code = worker.wait(timeout=120)
            finally:
                worker.kill()
                worker.stdin.close()
            err.seek(0)
            sys.stderr.buffer.write(err.read())
        print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        """
    )
    out = subprocess.run([sys.executable, "-c", probe, str(model)], capture_output=True, env=child_env(), cwd=ROOT, timeout=180)
    code, peak_kib = out.stdout.split()
    return int(code), out.stderr.decode(errors="replace"), int(peak_kib)


def test_a_1gib_config_json_is_refused_before_it_is_read(tiny_model, tmp_path):
    """It was read whole: 2.1 GB of worker RSS before the worker gave up."""
    model = huge_config(tiny_model, tmp_path)
    code, stderr, peak_kib = run_worker_measured(model)
    assert code == EX_CONFIG, stderr
    assert f"config.json is {GIB} bytes; the limit is {MAX_CONFIG_BYTES} bytes" in stderr
    # The interpreter with mlx imported takes a few hundred MiB; reading the
    # file would have taken a GiB more.
    assert peak_kib < 768 * 1024, f"worker peaked at {peak_kib} KiB"


def test_a_pool_fails_a_1gib_config_json_at_once(tiny_model, tmp_path, spawn_pool):
    pool = spawn_pool("--config", pool_config(tmp_path, "huge", huge_config(tiny_model, tmp_path)))
    failed = pool.wait_ev("failed", model="huge")
    assert "code 78" in failed["reason"] and "the limit is 16777216 bytes" in failed["reason"]
    assert pool.close() == 0
    assert not [e for e in pool.events if e["ev"] == "restarting"]


def test_a_fifo_as_weights_fails_at_once_naming_the_file(tiny_model, tmp_path, spawn_pool):
    """mlx blocked opening it until the watchdog killed the worker, five
    times over 66 s, with the stall named as the cause."""
    model = fifo_weights(tiny_model, tmp_path)
    pool = spawn_pool("--config", pool_config(tmp_path, "fifo", model))
    failed = pool.wait_ev("failed", model="fifo")
    assert "code 78" in failed["reason"]
    assert f"weight file {model / 'model.safetensors'} is a FIFO, not a regular file" in failed["reason"]
    pool.send({"model": "fifo", "id": "r", "prompt": "hello"})
    assert pool.terminal("r")["code"] == "model_failed"
    assert pool.close() == 0
    assert not [e for e in pool.events if e["ev"] == "restarting"]
    assert pool.stderr.count(b"worker started") == 1


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_directory_and_device_weights_are_refused_too(tiny_model, tmp_path, kind):
    model = copy_model(tiny_model, tmp_path / kind, skip=("model.safetensors",))
    if kind == "directory":
        (model / "model.safetensors").mkdir()
    else:
        (model / "model.safetensors").symlink_to("/dev/zero")
    code, stderr, _ = run_worker_measured(model)
    assert code == EX_CONFIG and f"is a {kind}, not a regular file" in stderr, stderr


def test_list_reads_neither_a_fifo_nor_a_huge_config(tiny_model, tmp_path):
    """`lattice-pool list` reads each model's config.json and weight headers
    in the supervisor's process: a FIFO would block it, a huge config fill it."""
    results = {}
    for model in (fifo_weights(tiny_model, tmp_path), huge_config(tiny_model, tmp_path)):
        reader = threading.Thread(target=lambda m=model: results.__setitem__(m.name, local_models.model_format(m)), daemon=True)
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), f"model_format blocked on {model}"
    assert results == {"fifo-weights": "?", "huge-config": "?"}
    assert local_models.model_format(tiny_model) == "bf16"


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("tokenizer_config.json", "[" * 100_000 + "]" * 100_000, "nests too deeply"),
        ("tokenizer_config.json", "[1, 2]", "not a JSON object"),
        ("config.json", "[" * 100_000 + "]" * 100_000, "nests too deeply"),
    ],
)
def test_hostile_json_in_a_model_dir_is_a_bad_dir_not_a_crash(tiny_model, tmp_path, name, text, words):
    """A config or tokenizer config that nests past Python's parser, or is
    no object, is refused with the file named, never a RecursionError."""
    from worker.runtime.loader import ModelDirError, read_config
    from worker.text.tokenizer import TextCodec, TokenizerError

    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    (copy / name).write_text(text)
    with pytest.raises((ModelDirError, TokenizerError), match=words):
        TextCodec(copy, read_config(copy))
