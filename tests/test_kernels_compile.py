"""The Triton kernels compile for the H100/H200 (sm_90) here, with Triton's bundled ptxas and no GPU.

The interpreter tests run the kernels' arithmetic on the CPU but never compile them, so what only a
compile finds (a module global read in a kernel that is not a ``tl.constexpr``, a variable whose
type differs between the branches of a runtime ``if``, two returns of a function with two types, a
layout the backend rejects) would otherwise surface only on the GPU machine. One launch of each kernel
family, with the constexpr switches the launchers set for it; the compile must produce a cubin.

The compiles run in a child process (this file as a script): ``conftest.py`` sets ``TRITON_INTERPRET=1``
without CUDA and ``interpreted.py`` (the interpreter tests' helper) redefines the kernels as interpreted
functions when pytest imports it, and neither can be compiled.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = {"smooth_keys": True, "smooth_scope": "sequence"}
WSL = {"WINDOW": 128, "HAS_SINK_LOGITS": True}

DECODE = {
    # id: preset config, D, tokens_m, fold, fused_q, extra constexprs
    "default": ("kvarn_k4v2_g128", 128, True, True, True, {"HAS_SINK": True}),
    "prologue": ("kvarn_k2v2_g128", 64, False, False, False, {}),
    "multi_query": ("kvarn_k4v2_g64", 64, False, False, True, {"MULTI_Q": True, "BLOCK_Q": 4}),
    "multi_query_kv": ("kvarn_k4v2_g64", 64, False, False, True, {"MULTI_Q": True, "BLOCK_Q": 4, "HAS_KV": True}),
    "seq_smooth_prologue": (("kvarn_k4v2_g128", SEQ), 64, True, True, False, {"SMOOTH_Q": True, "LATE_Q": True}),
    "seq_smooth_fused": (("kvarn_k2v2_g128", SEQ), 64, False, False, True, {"LATE_Q": True, "HAS_SINK": True}),
    # prompt chunks of sequence-smoothed configs: the model-frame queries back from the prologue's rotated ones
    # (a two-typed _query_rows once failed here on the GPU and in this compile alike)
    "seq_smooth_multi_query": (
        ("kvarn_k4v2_g128", SEQ),
        128,
        False,
        False,
        False,
        {"MULTI_Q": True, "BLOCK_Q": 4, "BLOCK_M": 16, "SMOOTH_Q": True},
    ),
    "per_tile_smooth": (("kvarn_k4v2_g64", {"smooth_keys": True}), 64, False, False, True, {}),
    "stack_tiles": ("kvarn_k4v2_g64", 128, True, True, True, {"STACK": True, "HAS_SINK": True}),
    "stack_tiles_k2v2": ("kvarn_k2v2_g128", 64, True, False, True, {"STACK": True}),
    # 2 warps under the register cap (decode_shape_default's launches)
    "two_warps_d64": ("kvarn_k4v2_g128", 64, True, False, True, {"num_warps": 2}),
    "two_warps_g64": ("kvarn_k4v2_g64", 128, True, True, True, {"num_warps": 2}),
    "two_warps_d128": ("kvarn_k4v2_g128", 128, True, True, True, {"num_warps": 2}),
    "two_warps_k2v2": ("kvarn_k2v2_g128", 128, True, True, True, {"num_warps": 2}),
    # 1 warp, 255 registers (decode_shape_default's launches at D = 128 with long block tables)
    "one_warp_d128": ("kvarn_k4v2_g128", 128, True, True, True, {"num_warps": 1, "HAS_SINK": True}),
    "one_warp_g64": ("kvarn_k4v4_g64", 128, True, True, False, {"num_warps": 1, "TAIL_ROWS": 13, "HAS_KV": True}),
    # FLAGS = (SPLIT, MERGE, ROTATE, OUT_BF16, INV_SQRT_D): the epilogue's partials, and one split
    "no_merge": ("kvarn_k4v2_g128", 128, True, True, True, {"FLAGS": (True, False, True, False, 128**-0.5)}),
    "one_split": ("kvarn_k4v2_g128", 128, False, False, True, {"FLAGS": (False, True, True, True, 128**-0.5)}),
    # own tiles kept as rows of the cache's blocks (tails in vLLM's blocks: 27 rows a block, 5 blocks)
    "block_rows": ("kvarn_k4v2_g128", 128, True, True, True, {"TAIL_ROWS": 27}),
    "block_rows_g64": ("kvarn_k4v2_g64", 128, True, True, True, {"TAIL_ROWS": 13, "STACK": True}),
    # sliding windows (WINDOW keys) and learned sink logits, in each launch shape the rules pick
    "window_sink_logits": ("kvarn_k4v2_g128", 128, True, True, True, {"HAS_SINK": True, **WSL}),
    "window_one_warp": ("kvarn_k4v2_g128", 128, True, True, True, {"num_warps": 1, "HAS_SINK": True, **WSL}),
    "window_two_warps_d64": ("kvarn_k4v2_g128", 64, True, False, True, {"num_warps": 2, "WINDOW": 100}),
    "window_stack": ("kvarn_k4v2_g64", 128, True, True, True, {"STACK": True, **WSL}),
    "window_rows_prologue": ("kvarn_k2v2_g128", 64, False, False, False, {"WINDOW": 1, "HAS_SINK_LOGITS": True}),
    "window_multi_query_kv": (
        "kvarn_k4v2_g64",
        64,
        False,
        False,
        True,
        {"MULTI_Q": True, "BLOCK_Q": 4, "HAS_KV": True, "HAS_SINK": True, **WSL},
    ),
    "window_seq_smooth_prologue": (
        ("kvarn_k4v2_g128", SEQ),
        64,
        True,
        True,
        False,
        {"SMOOTH_Q": True, "LATE_Q": True, **WSL},
    ),
    "window_block_rows": ("kvarn_k4v2_g128", 128, True, True, True, {"TAIL_ROWS": 27, **WSL}),
    "window_no_merge": (
        "kvarn_k4v2_g128",
        128,
        True,
        True,
        True,
        {"FLAGS": (True, False, True, False, 128**-0.5), **WSL},
    ),
    "window_one_split": (
        "kvarn_k4v2_g128",
        128,
        False,
        False,
        True,
        {"FLAGS": (False, True, True, True, 128**-0.5), **WSL},
    ),
}
EDGE = {
    # id: kernel, preset, D, constexprs (LAYOUT added): the prologue and epilogue launches of window / sink-logit calls
    "prologue_seq_smooth_window": (
        "_prologue_kernel",
        ("kvarn_k4v2_g128", SEQ),
        128,
        {"BLOCK_H": 16, "ROTATE": True, "IN_BF16": True, "FACTOR": 0.1275, "GQ": 4, "SMOOTH": True, "WINDOW": 128},
    ),
    "epilogue_sink_logits": (
        "_epilogue_kernel",
        "kvarn_k4v2_g128",
        128,
        {
            "BLOCK_H": 32,
            "SPLIT": True,
            "ROTATE": True,
            "OUT_BF16": True,
            "INV_SQRT_D": 128**-0.5,
            "HAS_SINK_LOGITS": True,
        },
    ),
}
EDGE_PTRS = {"query": "*bf16", "q_out": "*fp32", "q_out_s": "*fp32", "cache": "*u8", "block_table": "*i32"}
EDGE_PTRS |= {
    "seq_lens": "*i32",
    "part": "*fp32",
    "ws_m": "*fp32",
    "ws_l": "*fp32",
    "out": "*bf16",
    "sink_logits": "*bf16",
}
STORE = {
    # id: preset config, SMOOTH_PHASE (None: no smooth_src)
    "plain": ("kvarn_k4v2_g64", None),
    "seq_smooth_phase0": (("kvarn_k4v2_g64", SEQ), 0),
    "seq_smooth_phase1": (("kvarn_k2v2_g128", SEQ), 1),
}

PAGES = {
    # id: kernel, preset, D, num_warps, constexprs (LAYOUT and INV_SQRT_D added)
    "records_sink": ("_record_pages_kernel", "kvarn_k4v2_g128", 128, 8, {"HAS_SINK": True, "ROTATE": True}),
    "records_d256": ("_record_pages_kernel", "kvarn_k4v2_g64", 256, 8, {"HAS_SINK": False, "ROTATE": True}),
    "rows_from_model": ("_row_pages_kernel", "kvarn_k4v2_g128", 128, 4, {"FROM_MODEL": True, "HAS_SLOTS": False}),
    "rows_from_pool": ("_row_pages_kernel", "kvarn_k4v2_g64", 64, 4, {"FROM_MODEL": False, "HAS_SLOTS": True}),
    "write_tail_d256": ("_prepare_kernel", "kvarn_k4v2_g64", 256, 4, {"ROTATE": True, "SLOT_ROWS": 64}),  # tail.py
    "write_tail_block_rows": ("_prepare_kernel", "kvarn_k4v2_g128", 128, 4, {"ROTATE": True, "SLOT_ROWS": 27}),
    "gather_tail_tiles": ("_gather_tiles_kernel", "kvarn_k4v2_g128", 128, 4, {"G": 128, "D": 128, "R": 27, "ROWS": 32}),
}
PAGE_PTRS = {"cache": "*u8", "block_table": "*i32", "rows": "*i64", "tiles": "*i64", "sink_slots": "*i64"}
PAGE_PTRS |= {"slots": "*i64", "dst": "*i64", "mapping": "*i64", "tables": "*i32"} | {
    n: "*bf16" for n in ("k", "v", "k_pages", "v_pages", "tail_k", "tail_v", "rows_k", "rows_v")
}

pytestmark = pytest.mark.slow  # about 2 minutes on 2 cores, 4 on one: each compile runs ptxas


def _cfg(preset, d: int):
    from kvarn.config import KVarNConfig

    name, over = (preset, {}) if isinstance(preset, str) else preset
    return KVarNConfig.from_preset(name, head_dim=d, **over)


def _compile_pages(kernel_name: str, preset: str, d: int, num_warps: int, extra: dict):
    """One launch of a :mod:`kvarn.kernels.pages` kernel (or a :mod:`kvarn.kernels.tail` kernel, whose pool form
    they share; bf16 pages and pool), compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvarn.kernels import pages, tail
    from kvarn.kernels._common import inv_sqrt, record_layout

    kernel = getattr(pages, kernel_name, None) or getattr(tail, kernel_name)
    cfg = _cfg(preset, d)
    const = dict(LAYOUT=record_layout(cfg), INV_SQRT_D=inv_sqrt(d), ROWS=64, IN_BF16=True, POOL_BF16=True)
    const |= dict(PAGE_BF16=True) | extra
    const = {n: v for n, v in const.items() if n in kernel.arg_names}
    sig = {n: "constexpr" if n in const else PAGE_PTRS.get(n, "i32") for n in kernel.arg_names}
    opts = {"num_warps": num_warps, "num_stages": 1}
    return triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)


def _compile_edge(kernel_name: str, preset, d: int, extra: dict):
    """One launch of the prologue or epilogue kernel (:mod:`kvarn.kernels.attention_prologue`,
    :mod:`kvarn.kernels.attention_epilogue`) with ``extra`` constexprs, compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvarn.kernels import attention_epilogue, attention_prologue
    from kvarn.kernels._common import record_layout

    kernel = getattr(attention_prologue, kernel_name, None) or getattr(attention_epilogue, kernel_name)
    const = dict(LAYOUT=record_layout(_cfg(preset, d))) | extra
    sig = {n: "constexpr" if n in const else EDGE_PTRS.get(n, "i32") for n in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


NAMES = (
    [f"decode/{n}" for n in DECODE]
    + [f"store/{n}" for n in STORE]
    + [f"pages/{n}" for n in PAGES]
    + [f"edge/{n}" for n in EDGE]
)


def _compile(name: str):
    """The compile of case ``name`` (``family/id``)."""
    from benchmarks.sass_decode import compile_decode
    from benchmarks.sass_store import compile_encode

    family, case = name.split("/")
    if family == "decode":
        preset, d, tokens_m, fold, fused_q, extra = DECODE[case]
        extra = dict(extra)
        warps = extra.pop("num_warps", 4)
        return compile_decode(_cfg(preset, d), d, tokens_m, fold, fused_q, pair=False, extra=extra, num_warps=warps)
    if family == "store":
        preset, phase = STORE[case]
        cfg = _cfg(preset, 64)
        extra = {} if phase is None else {"HAS_SMOOTH_SRC": True, "SMOOTH_PHASE": phase}
        return compile_encode(cfg, 8 if cfg.smooth_keys else 4, extra=extra)
    if family == "pages":
        return _compile_pages(*PAGES[case])
    return _compile_edge(*EDGE[case])


def _outcome(name: str) -> str:
    """``"ok"`` (a cubin came out) or the error."""
    try:
        return "ok" if len(_compile(name).asm["cubin"]) > 0 else "empty cubin"
    except Exception as exc:  # reported per case by the tests
        return f"{type(exc).__name__}: {exc}"[-3000:]


def _compile_all() -> dict[str, str]:
    """Each case's outcome, compiled in one process per usable core, at most 8 (each compile is one thread and a
    ptxas run; a process imports Triton, so a large host gains little past a few)."""
    from concurrent.futures import ProcessPoolExecutor

    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(NAMES, pool.map(_outcome, NAMES), strict=True))


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"the compile process failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_for_sm90(compiled, name):
    assert compiled[name] == "ok", compiled[name]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
