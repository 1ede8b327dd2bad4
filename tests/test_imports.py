"""The packages' import graphs, read from the source with `ast`: no circle
in any of them (TYPE_CHECKING imports count too), and `ipc` is the only
package the supervisor and the worker share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.procs import ROOT

PACKAGES = ("supervisor", "worker", "ipc", "harness")


def modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names, and for `from
    package import name` the submodule it may be."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: {m for m in imported(path) if m in mods and m != name} for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    assert len(graph(package)) > 2
    assert cycles(graph(package)) == []


@pytest.mark.parametrize("package, never", [("supervisor", "worker"), ("worker", "supervisor"), ("ipc", "supervisor"), ("ipc", "worker")])
def test_only_ipc_is_shared(package, never):
    for name, path in modules(package).items():
        assert not {m for m in imported(path) if m.split(".")[0] == never}, f"{name} imports {never}"


def test_spec_imports_nothing_of_the_supervisor():
    """The model's plain values are what every part passes around: they
    depend on no part, so no part depends on the resolver through them."""
    assert not {m for m in imported(ROOT / "supervisor" / "spec.py") if m.split(".")[0] == "supervisor"}


@pytest.mark.parametrize("module", ["supervisor.slot", "supervisor.traffic", "supervisor.job", "supervisor.names"])
@pytest.mark.parametrize("never", ["supervisor.resolve", "supervisor.pool"])
def test_the_slot_does_not_depend_on_the_resolver_or_the_pool(module, never):
    assert never not in imported(modules("supervisor")[module]), f"{module} imports {never}"


def front_ends() -> dict[str, Path]:
    return {
        name: path
        for name, path in modules("supervisor").items()
        if name.startswith("supervisor.httpapi") or name in ("supervisor.chat", "supervisor.cli", "supervisor.attach")
    }


def test_there_are_front_ends():
    assert {"supervisor.attach", "supervisor.chat", "supervisor.cli", "supervisor.httpapi.server"} <= set(front_ends())


@pytest.mark.parametrize("never", ["supervisor.slot", "supervisor.states"])
def test_front_ends_do_not_import_the_pool_insides(never):
    """HTTP, the chat REPL and the CLI ask the pool (Pool.model_state,
    Pool.resolve, ...) rather than reading its workers' slots and states."""
    for name, path in front_ends().items():
        assert never not in imported(path), f"{name} imports {never}"


def attributes(path: Path) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text("utf-8"))) if isinstance(node, ast.Attribute)}


def test_the_attribute_scan_sees_attributes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("x = self.pool.slots.get(key)\n", "utf-8")
    assert {"pool", "slots", "get"} <= attributes(probe)


@pytest.mark.parametrize("never", ["slots", "resolver"])
def test_front_ends_do_not_read_the_pool_insides(never):
    for name, path in front_ends().items():
        assert never not in attributes(path), f"{name} reads .{never}"


def test_tests_share_helpers_through_the_harness_or_the_conftest():
    """A test file imports no other test file: importing one runs its module
    fixtures' imports and ties the two files' failures together."""
    for path in (ROOT / "tests").glob("*.py"):
        assert not {m for m in imported(path) if m.startswith("tests.test_")}, f"{path.name} imports a test file"


# The worker's parts in layers: each may import only the parts before it
# (and itself), so the file list reads bottom-up and a new module has one
# obvious home.
WORKER_LAYERS = ("runtime", "text", "cache", "lora", "engine", "shell", "group", "demo")


def worker_part(module: str) -> str:
    parts = module.split(".")
    return "top" if len(parts) < 2 or parts[1] == "__main__" else parts[1]


def test_the_worker_has_no_flat_modules_but_its_entry_point():
    flat = {name for name, path in modules("worker").items() if name.count(".") == 1 and path.name != "__init__.py"}
    assert flat == {"worker.__main__"}, "new worker modules belong in one of its parts"
    assert {worker_part(name) for name in modules("worker")} - {"top"} == set(WORKER_LAYERS)


@pytest.mark.parametrize("part", WORKER_LAYERS)
def test_each_worker_part_imports_only_the_parts_below_it(part):
    allowed = set(WORKER_LAYERS[: WORKER_LAYERS.index(part) + 1])
    for name, targets in graph("worker").items():
        if worker_part(name) == part:
            upward = {t for t in targets if worker_part(t) not in allowed}
            assert not upward, f"{name} imports {sorted(upward)} above its layer"
