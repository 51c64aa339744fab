"""The package's floors, read from every module's imports (top-level and lazy ones alike).

Ground floor up: ``config`` -> ``reference`` and ``kernels`` side by side (neither imports the
other) -> ``ops`` (the one dispatch point) -> ``paged`` and the public API -> ``integration`` ->
evaluation and the CLI. Imports only point down or stay inside their own floor's package; no
module imports in a circle; only ``ops`` (and the reference itself) imports ``kvarn.reference``.
``paged`` stands on ``config`` and ``ops`` alone and imports no serving or modelling library; the
packages split by responsibility keep every module under :data:`MAX_LINES`.
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


PAGED_MAY_IMPORT = {"kvarn.config", "kvarn.ops"}
"""What ``kvarn.paged``'s modules may import besides each other: the adapters above build on it, not it on them."""

MAX_LINES = 600
"""Most lines a module of the packages split by responsibility may have (:data:`SPLIT_PACKAGES`)."""

SPLIT_PACKAGES = ("kvarn.paged", "kvarn.integration.hf")


def _top_level_imports(path: Path) -> set[str]:
    """The top-level package of every import in ``path``, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


PATHS = {_module(p): p for p in ROOT.rglob("*.py")}
PAGED = sorted(m for m in GRAPH if m == "kvarn.paged" or m.startswith("kvarn.paged."))


def test_paged_is_a_package_of_several_modules():
    assert "kvarn.paged" in GRAPH and len(PAGED) > 2, PAGED
    assert PATHS["kvarn.paged"].name == "__init__.py"


@pytest.mark.parametrize("module", PAGED)
def test_paged_imports_only_config_ops_and_itself(module):
    above = {t for t in GRAPH[module] if t not in PAGED_MAY_IMPORT and not t.startswith("kvarn.paged.")}
    assert not above, f"{module} imports {sorted(above)}; kvarn.paged stands on kvarn.config and kvarn.ops only"


@pytest.mark.parametrize("module", PAGED)
def test_paged_imports_neither_vllm_nor_transformers(module):
    reached = _top_level_imports(PATHS[module]) & {"vllm", "transformers"}
    assert not reached, f"{module} imports {sorted(reached)}; the integrations adapt kvarn.paged, not the reverse"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("kvarn.paged.")))
def test_paged_modules_import_their_siblings_not_the_package(module):
    assert "kvarn.paged" not in GRAPH[module], f"{module} imports kvarn.paged; import the sibling module instead"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(SPLIT_PACKAGES)))
def test_split_packages_keep_modules_short(module):
    lines = len(PATHS[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by responsibility (at most {MAX_LINES})"
