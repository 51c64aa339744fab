"""Shape of the kernel layer's source: small functions, one source for the record layout."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kvarn" / "kernels"
MAX_FUNCTION_LINES = 120
LAYOUT_FIELDS = ("K_CODES", "V_CODES", "K_SCALE", "K_ZERO", "K_TOK", "V_SCALE", "V_ZERO", "V_CHAN", "K_BITS", "V_BITS")


def _sources():
    return sorted(KERNELS.glob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_no_kernel_function_is_long(path):
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_layout_reaches_kernels_only_through_record_layout(path):
    """Only ``record_layout`` reads ``cfg.offsets``; no kernel takes a layout field as its own parameter."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "offsets":
            assert path.name == "_common.py", f"{path.name}:{node.lineno} reads .offsets; use record_layout(cfg)"
        if isinstance(node, ast.FunctionDef):
            params = {a.arg for a in node.args.args}
            assert not params & set(LAYOUT_FIELDS), f"{path.name}: {node.name} takes {params & set(LAYOUT_FIELDS)}"
        if isinstance(node, ast.keyword) and node.arg in LAYOUT_FIELDS and path.name != "_common.py":
            raise AssertionError(f"{path.name}:{node.lineno} passes {node.arg}=; pass LAYOUT=record_layout(cfg)")


def _jit_decorator(node: ast.FunctionDef) -> ast.expr | None:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return dec
    return None


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_step_counts_are_not_specialized(path):
    """A kernel that takes a per-step count (``STEP_COUNTS``: batch, split and row counts) is jitted with
    ``do_not_specialize=STEP_COUNTS``, so vLLM's changing steps reuse one compiled variant."""
    from kvarn.kernels._common import STEP_COUNTS

    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef) or (dec := _jit_decorator(node)) is None:
            continue
        counts = {a.arg for a in node.args.args} & set(STEP_COUNTS)
        if not counts or not node.name.endswith("_kernel"):  # helpers inline into their kernel
            continue
        given = {k.arg: k.value for k in dec.keywords} if isinstance(dec, ast.Call) else {}
        value = given.get("do_not_specialize")
        assert isinstance(value, ast.Name) and value.id == "STEP_COUNTS", (
            f"{path.name}: {node.name} takes {sorted(counts)} but is not jitted with do_not_specialize=STEP_COUNTS"
        )


def test_every_step_count_names_a_kernel_parameter():
    """``STEP_COUNTS`` names parameters (Triton ignores names a kernel does not take: a typo would be silent)."""
    from kvarn.kernels._common import STEP_COUNTS

    taken = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and _jit_decorator(node):
                taken |= {a.arg for a in node.args.args}
    assert set(STEP_COUNTS) <= taken, set(STEP_COUNTS) - taken
