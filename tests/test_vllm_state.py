"""What a process keeps: one :class:`~kvarn.integration.vllm.state.ServingState`, and no module state beside it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvarn" / "integration" / "vllm"

CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakSet"}
CONTAINERS |= {"WeakKeyDictionary", "WeakValueDictionary"}


def _module_state(path: Path) -> list[str]:
    """Mutable containers bound at the top level of ``path`` (in ``if``/``try`` blocks too), and ``global``
    rebinding inside its functions."""
    tree = ast.parse(path.read_text())
    found = []
    top = list(tree.body)
    while top:
        node = top.pop()
        if isinstance(node, (ast.If, ast.Try)):
            top += [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            top += node.body
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
            if isinstance(value, ast.Call):
                func = value.func
                mutable = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in CONTAINERS
            names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            if mutable and names != ["__all__"]:
                found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    found += [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_the_process_state_is_one_object():
    """vLLM builds configs, backends and runners more than once a process; what outlives them is
    ``state.serving``'s alone, not a module global of some other module."""
    elsewhere = {p.name: s for p in sorted(PACKAGE.glob("*.py")) if p.name != "state.py" if (s := _module_state(p))}
    assert not elsewhere, f"module state outside kvarn/integration/vllm/state.py: {elsewhere}"
    tree = ast.parse((PACKAGE / "state.py").read_text())
    assert _module_state(PACKAGE / "state.py") == []  # its one instance is a ServingState, not a container
    instances = [
        n.targets[0].id
        for n in tree.body
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Call)
        and getattr(n.value.func, "id", "") == "ServingState"
    ]
    assert instances == ["serving"]


def test_each_state_starts_with_its_own_containers():
    from kvarn.integration.vllm.state import ServingState, serving

    fresh = ServingState()
    assert fresh.sink_book is not serving.sink_book and fresh.tail_block_steps is not serving.tail_block_steps
    assert fresh.registration == {"registered": False, "enabled": False, "mode": None, "error": None}
    assert fresh.registration is not ServingState().registration
