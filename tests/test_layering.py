"""The package's floors, read from every module's imports (top-level and lazy ones alike).

Ground floor up: ``config`` -> ``reference`` and ``kernels`` side by side (neither imports the
other) -> ``ops`` (the one dispatch point) -> ``paged`` and the public API -> ``integration`` ->
evaluation and the CLI. Imports only point down or stay inside their own floor's package; no
module imports in a circle; only ``ops`` (and the reference itself) imports ``kvarn.reference``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvarn"

FLOORS = {
    "config": 0,
    "reference": 1,
    "kernels": 1,
    "ops": 2,
    "paged": 3,
    "api": 3,
    "integration": 4,
    "app": 5,
}


def _module(path: Path) -> str:
    parts = ["kvarn", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _group(module: str) -> str:
    parts = module.split(".")
    if module == "kvarn":
        return "api"
    head = parts[1]
    if head in ("config", "reference", "kernels", "ops", "paged", "api", "integration"):
        return head
    return "app"  # eval, cli, demo, data


MODULES = {_module(p) for p in ROOT.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every ``kvarn`` module ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: kvarn uses absolute imports"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)  # ``from pkg import submodule`` loads the submodule
    return {m for m in found if m in MODULES and m != _module(path)}


GRAPH = {_module(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    group = _group(module)
    for target in GRAPH[module]:
        other = _group(target)
        assert other == group or FLOORS[other] < FLOORS[group], f"{module} ({group}) imports {target} ({other})"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_only_ops_reaches_the_reference(module):
    if _group(module) in ("reference", "ops"):
        return
    reached = {t for t in GRAPH[module] if _group(t) == "reference"}
    assert not reached, f"{module} imports {sorted(reached)}; go through kvarn.ops"


def test_no_import_circles():
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target] if target in path else [module, target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in GRAPH:
        if module not in state:
            visit(module, [module])
