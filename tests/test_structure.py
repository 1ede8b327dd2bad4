"""Rooms stay small: no class of the pool's packages holds 30 or more
methods (mlx-lm's largest classes have 16). A class that outgrows the bound
is split along its own sections into parts that report back through small
protocols (supervisor.slot is the model)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "worker", "ipc")
MAX_METHODS = 29


def method_counts() -> dict[str, int]:
    counts = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                    counts[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = methods
    return counts


def test_no_class_has_30_or_more_methods():
    counts = method_counts()
    assert "supervisor/slot.py:WorkerSlot" in counts and "supervisor/pool.py:Pool" in counts  # the walk found the code
    too_big = {name: n for name, n in counts.items() if n > MAX_METHODS}
    assert not too_big, f"classes with more than {MAX_METHODS} methods; split them along their sections: {too_big}"


def test_a_status_row_carries_every_memory_figure():
    """The memory figures are declared once (ipc.worker_events.MemoryFigures);
    a status row lists them for its key order and copies them all."""
    from ipc.worker_events import MemoryFigures, RankFigures, WorkerStats
    from supervisor.status import StatusRow

    fields = set(MemoryFigures.__struct_fields__)
    assert fields <= set(StatusRow.__struct_fields__)
    assert issubclass(RankFigures, MemoryFigures) and issubclass(WorkerStats, MemoryFigures)
