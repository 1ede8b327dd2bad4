"""The `lattice-pool` command run as a user runs it, and readers of what
it prints."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.procs import ROOT, child_env

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


def cli(*args, input=None, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        input=input,
        capture_output=True,
        env=child_env(**(env or {})),
        cwd=ROOT,
        timeout=timeout,
    )


def events(stdout: bytes) -> list[dict]:
    lines = stdout.splitlines(keepends=True)
    assert all(line.startswith(b"@@lattice {") and line.endswith(b"}\n") for line in lines), stdout[:500]
    return [json.loads(line[10:]) for line in lines]


def ps_table(stdout: bytes) -> dict:
    """Rows of the ps table by NAME, cut at the header's column starts."""
    header, *lines = stdout.decode().splitlines()
    names = header.split()
    starts = [header.index(n) for n in names]
    bounds = list(zip(starts, starts[1:] + [None]))
    table = [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds)} for line in lines]
    return {row["NAME"]: row for row in table}
