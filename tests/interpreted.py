"""The kernel modules defined under the Triton interpreter, for the interpreter test files (no tests here).

``TRITON_INTERPRET=1`` must be set before Triton is first imported; ``conftest.py`` sets it when no
CUDA device is present (on a GPU machine the interpreter tests skip: ``test_kernels_gpu.py`` covers
them there), and this module reloads the kernel modules if they were defined in compiled mode
anyway. The interpreter runs the portable code paths: the GPU-only inline-asm unpack is covered on
the GPU. ``test_kernels_{attention,store,dequant,common}.py`` import the modules from here.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from kvarn.config import KVarNConfig

KERNEL_MODULES = (
    "kvarn.kernels._common",
    "kvarn.kernels.launch_rules",
    "kvarn.kernels.hadamard",
    "kvarn.kernels.encode",
    "kvarn.kernels.tail",
    "kvarn.kernels.store",
    "kvarn.kernels.dequant",
    "kvarn.kernels.attention_codes",
    "kvarn.kernels.attention_tiles",
    "kvarn.kernels.attention_fp_tiles",
    "kvarn.kernels.attention_epilogue",
    "kvarn.kernels.attention_merge",
    "kvarn.kernels.attention_query",
    "kvarn.kernels.attention_walk",
    "kvarn.kernels.attention_decode",
    "kvarn.kernels.attention_prologue",
    "kvarn.kernels.attention_checks",
    "kvarn.kernels.attention",
)
"""The modules of ``kvarn/kernels`` the tests reach (all but ``pages``, ``test_pages.py``'s), each after the ones
it imports from."""


def _interpreted_kernels():
    """The kernel modules, defined under the interpreter (reloaded if first imported compiled)."""
    mods = {n: importlib.import_module(n) for n in KERNEL_MODULES}
    encode_mod = mods["kvarn.kernels.encode"]
    if type(encode_mod._encode_kernel).__name__ != "InterpretedFunction" and os.environ.get("TRITON_INTERPRET") == "1":
        mods = {n: importlib.reload(sys.modules[n]) for n in KERNEL_MODULES}
    names = ("_common", "store", "dequant", "attention", "launch_rules", "hadamard")
    return [mods[f"kvarn.kernels.{n}"] for n in names]


_common, store, dequant, attention, launch_rules, hadamard = _interpreted_kernels()
INTERPRETED = type(store._encode_kernel).__name__ == "InterpretedFunction"

INTERPRETER_MARKS = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETED, reason="kernels are compiled here (CUDA present); see test_kernels_gpu.py"),
]
"""The ``pytestmark`` of every interpreter test file."""

DTYPES = (torch.float16, torch.bfloat16)


def smooth_cfg(preset: str, d: int) -> KVarNConfig:
    """Key smoothing with one vector per tile (``KVarNConfig(smooth_keys=True)``)."""
    return KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=True)


def seq_cfg(preset: str, d: int) -> KVarNConfig:
    """Key smoothing with one vector per sequence (``smooth_scope="sequence"``)."""
    return KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=True, smooth_scope="sequence")
