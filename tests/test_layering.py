"""The package's floors, read from every module's imports (top-level and lazy ones alike).

Ground floor up: ``config`` -> ``reference`` and ``kernels`` side by side (neither imports the
other) -> ``ops`` (the one dispatch point) -> ``paged`` and the public API -> ``integration`` ->
evaluation and the CLI. Imports only point down or stay inside their own floor's package; no
module imports in a circle; only ``ops`` (and the reference itself) imports ``kvarn.reference``.
``paged`` stands on ``config`` and ``ops`` alone and imports no serving or modelling library; every
module stays under :data:`MAX_LINES`.
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
"""Most lines a module of kvarn may have: past that it holds more than one responsibility."""


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


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_modules_stay_short(module):
    lines = len(PATHS[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines; split it by responsibility (at most {MAX_LINES})"


def _flat(targets):
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            yield from _flat(t.elts)
        else:
            yield t


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _loads_a_module(node: ast.AST) -> bool:
    """Whether ``node`` reaches a module by name: ``sys.modules`` or ``importlib.import_module``."""
    return any(
        isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and (n.value.id, n.attr) in (("sys", "modules"), ("importlib", "import_module"))
        for n in ast.walk(node)
    )


def _vllm_patches(path: Path) -> set[tuple[int, str]]:
    """``(line, enclosing function)`` of every statement in ``path`` that patches vLLM, read from the AST.

    A name is vLLM's if an ``import`` of ``vllm`` binds it, or it is assigned (``=``, ``for``, ``with``,
    ``:=``) from an expression that holds such a name or loads a module by name (any scope: a name is
    taken as vLLM's everywhere in the file once it is anywhere). A patch is an assignment, ``del``,
    ``setattr`` or ``delattr`` onto an attribute or item of a vLLM name, or a function (``def``, ``lambda``,
    ``classmethod(...)``, ``staticmethod(...)``) set as an attribute of anything but ``self`` or ``cls``
    (a method put on an instance or a class, whatever it was reached through).
    """
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    vllm = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            vllm |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            vllm |= {a.asname or a.name for a in node.names}
    bindings = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bindings.append((list(_flat(targets)), node.value))
        elif isinstance(node, ast.NamedExpr):
            bindings.append(([node.target], node.value))
        elif isinstance(node, (ast.For, ast.comprehension)):
            bindings.append((list(_flat([node.target])), node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bindings.append((list(_flat([node.optional_vars])), node.context_expr))
    grew = True
    while grew:
        grew = False
        for targets, value in bindings:
            names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
            if names & vllm or _loads_a_module(value):
                new = {t.id for t in targets if isinstance(t, ast.Name)} - vllm
                vllm |= new
                grew = grew or bool(new)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def is_function(value) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in functions
        return isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("classmethod", "staticmethod")

    def vllms(target) -> bool:
        return _root(target) in vllm or _loads_a_module(target)

    def where(node) -> str:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return "<module>"

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args:
            value = node.args[2] if len(node.args) > 2 else None
            if vllms(node.args[0]) or (value is not None and is_function(value)):
                found.add((node.lineno, where(node)))
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            continue
        value = getattr(node, "value", None)
        for t in _flat(targets):
            if not isinstance(t, (ast.Attribute, ast.Subscript)):
                continue
            put_method = isinstance(t, ast.Attribute) and _root(t) not in ("self", "cls") and is_function(value)
            if vllms(t) or put_method:
                found.add((node.lineno, where(node)))
    return found


HOOKS = ROOT / "integration" / "vllm" / "hooks"


def test_only_the_hooks_module_patches_vllm():
    """Every patch of vLLM is installed from the package ``kvarn.integration.vllm.hooks``: no other module of kvarn
    assigns onto what it reached through a vLLM import, or puts a function onto an object (:func:`_vllm_patches`)."""
    elsewhere = {
        str(p.relative_to(ROOT)): sorted(f)
        for p in sorted(ROOT.rglob("*.py"))
        if HOOKS not in p.parents and (f := _vllm_patches(p))
    }
    assert not elsewhere, f"vLLM patched outside kvarn/integration/vllm/hooks/: {elsewhere}"
    # the rule sees the patches it is there for: each hook's own
    patching = {fn for p in sorted(HOOKS.glob("*.py")) for _, fn in _vllm_patches(p)}
    hooks = {
        "_widen_cache_dtype_literal",
        "install_spec_hook",
        "install_runner_hook",
        "install_scheduler_hook",
        "_mixed_dispatch",
        "_wrap",
        "_unwrap",
        "install_release_hook",
        "install_block_pool_hook",
        "install_registry_hook",
        "install_block_table_hook",
        "_kvarn_attention_pages",
        "install_zeroing_hook",
    }
    assert hooks <= patching, f"the rule misses the patches of {sorted(hooks - patching)}"
