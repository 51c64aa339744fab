"""Offline SASS of the decode attention kernel: registers, stack and main-loop instruction counts, no GPU.

Compiles ``_attn_kernel`` for sm_90 with an explicit target (Triton's bundled ptxas, nvdisasm and
cuobjdump) and counts the opcodes of the loop with the most ``LOP3`` (the quantized-tile loop).
Counts depend on the local Triton version; compare variants compiled by the same one, and read the
GPU machine's (3.6: ``make gpu-triton``, then this script with ``.venv-gpu-triton/bin/python``), whose
register allocation can differ from CI's 3.9.

    PYTHONPATH=. python benchmarks/sass_decode.py kvarn_k4v2_g128 --d 128 --tokens-m 1 --fold 0 1 [--warps 2] [--waits]

The last figure is :func:`loads_read_in_step` for the record's scale fields: how many of the loop's
plain global loads of a tile's scales are waited for in the step that issued them (0: all read a
step ahead, or prefetched by ``cp.async``).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvarn.config import KVarNConfig
from kvarn.kernels._common import record_layout
from kvarn.kernels.attention_decode import _attn_kernel
from kvarn.kernels.launch_rules import DECODE_MAX_REGS

OPS = ["LOP3", "HADD2", "SHF", "LDG", "LDL", "STL", "BAR", "FFMA", "FMUL", "FADD", "PRMT", "SHFL", "IMAD"]
INTS = [
    "num_seqs",
    "hq",
    "s_iq",
    "s_iqh",
    "s_o",
    "s_oh",
    "s_cb",
    "s_ch",
    "s_bt",
    "p_slot",
    "p_tok",
    "p_head",
    "s_ws",
    "num_splits",
    "min_units",
]


def compile_decode(
    preset: str,
    d: int,
    tokens_m: bool,
    fold: bool,
    fused_q: bool,
    pair: bool,
    gq: int = 4,
    extra: dict | None = None,
    num_warps: int = 4,
):
    """The decode launch of ``bench_decode`` (32 / 8 heads, fp16, splits merged in the kernel), compiled for sm_90.

    ``preset`` may be a config; ``extra`` overrides constexpr arguments (``MULTI_Q``, ``HAS_SINK``,
    ``SMOOTH_Q``, ``LATE_Q``, ...); ``num_warps`` takes its register cap from ``DECODE_MAX_REGS``.
    """
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    ptrs = dict(q="*fp16" if fused_q else "*fp32", q_smooth="*fp32", cache="*u8", part="*fp32", ws_m="*fp32")
    ptrs.update(ws_l="*fp32", tail_k="*fp16", tail_v="*fp16", key="*fp16", value="*fp16", final="*fp16")
    ptrs.update(sink_logits="*fp32")
    names = _attn_kernel.arg_names
    const = dict(GQ=gq, GQP=gq, BLOCK_Q=1, BLOCK_M=max(8 if tokens_m else 16, gq), LAYOUT=record_layout(cfg))
    const.update(MULTI_Q=False, HAS_SINK=False, POOL_BF16=False, USE_ASM=True, IN_BF16=False, FACTOR=0.1275)
    const.update(FUSED_Q=fused_q, PAIR=pair, TOKENS_M=tokens_m, FOLD=fold, MERGE_CH=max(1, 4096 // (gq * d)))
    const["FLAGS"] = (True, True, True, False, d**-0.5)
    unset = inspect.Parameter.empty  # constexprs left out take their defaults (a missing one would be a pointer)
    const.update({p.name: p.default for p in _attn_kernel.params if p.is_constexpr and p.default is not unset})
    const.update(extra or {})
    sig = {n: ptrs.get(n, "i32" if n in INTS else "*i32") for n in names if n not in const}
    sig.update({n: "constexpr" for n in const})
    aligned = set(ptrs) | {"s_cb", "s_ch", "s_iq", "s_o", "p_slot", "p_tok", "p_head", "s_ws"}  # as launches have them
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    opts = {"num_warps": num_warps, "num_stages": 2, "maxnreg": DECODE_MAX_REGS.get((d, num_warps))}
    return triton.compile(ASTSource(_attn_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def sass_and_resources(kernel) -> tuple[str, str]:
    """``nvdisasm`` text and ``cuobjdump -res-usage`` of a compiled kernel's cubin."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    return sass, res.stdout


def loop_instructions(sass: str) -> list[str]:
    """The instructions (predicates kept) of the backward-branch loop with the most ``LOP3``: the quantized tiles."""
    labels, instrs, loops = {}, [], []
    for line in sass.splitlines():
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(1).strip())
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append(instrs[labels[m.group(1)] : i + 1])
    return max(loops, key=lambda body: sum(x.lstrip("@!UP0123456789T ").startswith("LOP3") for x in body))


def _unpredicated(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins)


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of :func:`loop_instructions`."""
    return collections.Counter(_unpredicated(x).split()[0].split(".")[0] for x in loop_instructions(sass))


def loads_read_in_step(body: list[str], min_offset: int = 0) -> list[tuple[str, str]]:
    """Plain global loads (``LDG``, not ``cp.async``) of a loop ``body`` whose value an instruction after
    them in the same pass reads: ``(load, reader)`` pairs, so each is a global round trip the step
    waits for. Only loads whose immediate address offset is at least ``min_offset`` count (a record's
    scale fields start at ``LAYOUT.K_SCALE``; block ids are read at offset 0). A load read only after
    the back-edge (in the next step) is prefetched and not listed."""
    out = []
    for i, ins in enumerate(body):
        words = _unpredicated(ins).split(None, 1)
        op = words[0]
        if not op.startswith("LDG.") or len(words) < 2:
            continue
        dst, addr = [a.strip() for a in words[1].split(",", 1)]
        offset = re.search(r"\+(-?0x[0-9a-f]+|\d+)\]", addr)
        if (int(offset.group(1), 0) if offset else 0) < min_offset:
            continue
        width = {"64": 2, "128": 4}.get(op.split(".")[-1], 1)
        live = {int(dst[1:]) + k for k in range(width)}
        for later in body[i + 1 :]:
            parts = _unpredicated(later).split(None, 1)
            if len(parts) < 2:
                continue
            lop, args = parts
            ops = [a.strip() for a in args.split(",")]
            writes = (
                not lop.startswith(("ST", "RED", "BRA", "BAR", "LDGSTS")) and re.fullmatch(r"R\d+", ops[0]) is not None
            )
            srcs = ops[1:] if writes or lop.startswith(("HMMA", "HGMMA")) else ops
            if any(re.search(rf"\bR{r}\b", s) for s in srcs for r in live):
                out.append((ins, later))
                break
            if writes:
                live.discard(int(ops[0][1:]))
                if not live:
                    break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tokens-m", type=int, default=1)
    ap.add_argument("--fused-q", type=int, default=0)
    ap.add_argument("--pair", type=int, default=0)
    ap.add_argument("--fold", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--waits", action="store_true", help="list the loop's scale loads read in their own step")
    args = ap.parse_args()
    layout = record_layout(KVarNConfig.from_preset(args.preset, head_dim=args.d))
    for fold in args.fold:
        k = compile_decode(
            args.preset,
            args.d,
            bool(args.tokens_m),
            bool(fold),
            bool(args.fused_q),
            bool(args.pair),
            num_warps=args.warps,
        )
        sass, res = sass_and_resources(k)
        loop = main_loop(sass)
        usage = re.findall(r"REG:\d+ STACK:\d+", res)
        counts = " ".join(f"{op} {loop[op]}" for op in OPS)
        waited = loads_read_in_step(loop_instructions(sass), layout.K_SCALE)
        print(
            f"{args.preset} D={args.d} tokens_m={args.tokens_m} fold={fold} warps={args.warps} {usage} "
            f"loop {sum(loop.values())}: {counts}; scale loads read in their own step {len(waited)}"
        )
        for load, reader in waited if args.waits else ():
            print(f"    {load}  ->  {reader}")


if __name__ == "__main__":
    main()
