"""Offline SASS of the store's encode kernel: registers, stack, spills and instruction counts, no GPU.

Compiles ``_encode_kernel`` for sm_90 with an explicit target (Triton's bundled ptxas, nvdisasm and
cuobjdump), as ``commit_tiles`` launches it (fp16 pool, source and destination index lists), and
counts the whole kernel's SASS opcodes. Counts depend on the local Triton version; compare variants
compiled by the same one, and read the GPU machine's (3.6: ``make gpu-triton``, then this script with
``.venv-gpu-triton/bin/python``), whose register allocation can differ from CI's 3.9.

    PYTHONPATH=. python benchmarks/sass_store.py kvarn_k4v2_g128 kvarn_k2v2_g128 --warps 4 8
"""

from __future__ import annotations

import argparse
import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.sass_decode import sass_and_resources
from kvarn.config import KVarNConfig
from kvarn.kernels._common import inv_sqrt, record_layout
from kvarn.kernels.encode import _encode_kernel

OPS = [
    "FFMA",
    "FMUL",
    "FADD",
    "FMNMX",
    "FSETP",
    "FSEL",
    "FRND",
    "MUFU",
    "SHFL",
    "BAR",
    "LDS",
    "STS",
    "LDL",
    "STL",
    "CALL",
]
INTS = {"s_tile", "s_tok", "s_head", "d_block", "d_head"}


def compile_encode(
    cfg: KVarNConfig, num_warps: int, maxnreg: int | None = None, kernel=None, extra: dict | None = None
):
    """The ``commit_tiles`` launch of ``cfg``'s encode kernel (fp16 pool), compiled for sm_90.

    ``extra`` overrides constexpr arguments (``HAS_SMOOTH_SRC``, ``SMOOTH_PHASE``, ...).
    """
    kernel = _encode_kernel if kernel is None else kernel
    names = kernel.arg_names
    const = dict(HAS_SRC_IDX=True, HAS_DST_IDX=True, IS_BF16=False, LAYOUT=record_layout(cfg))
    const.update(HAS_SMOOTH_SRC=False, SMOOTH_PHASE=1)  # as store._launch_encode_phase without smooth_src
    const.update(ITERS=cfg.sinkhorn_iters, INV_SQRT_D=inv_sqrt(cfg.head_dim))
    k_clip, v_clip = cfg.k_clip or (1, 1), cfg.v_clip or (1, 1)
    const.update(K_CLIP_UNIT=k_clip[0], K_CLIP_COUNT=k_clip[1], V_CLIP_UNIT=v_clip[0], V_CLIP_COUNT=v_clip[1])
    const.update(extra or {})
    const = {n: v for n, v in const.items() if n in names}
    ptrs = dict(k_src="*fp16", v_src="*fp16", src_idx="*i32", dst="*u8", dst_idx="*i32", smooth_src="*i32")
    sig = {n: ptrs.get(n, "i32") for n in names if n not in const}
    sig.update({n: "constexpr" for n in const})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("k_src", "v_src", "dst", *INTS)}
    opts = {"num_warps": num_warps, "num_stages": 1, "maxnreg": maxnreg}
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def counts(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins = re.sub(r"^@!?U?P\w+\s+", "", m.group(1))
            ops[ins.split()[0].split(".")[0]] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--smooth", type=int, default=0)
    ap.add_argument("--clip", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--dump", default="", help="write each kernel's SASS to DUMP-<preset>-<warps>.sass")
    args = ap.parse_args()
    for preset in args.presets:
        cfg = KVarNConfig.from_preset(preset, head_dim=args.d, smooth_keys=bool(args.smooth), clip=bool(args.clip))
        for w in args.warps:
            kernel = compile_encode(cfg, w, args.maxnreg)
            sass, res = sass_and_resources(kernel)
            ops = counts(sass)
            if args.dump:
                for ext, text in (("sass", sass), ("ttgir", kernel.asm["ttgir"])):
                    with open(f"{args.dump}-{preset}-{w}.{ext}", "w") as f:
                        f.write(text)
            usage = re.findall(r"REG:\d+ STACK:\d+", res)
            shown = " ".join(f"{op} {ops[op]}" for op in OPS)
            head = f"{preset} D={args.d} smooth={args.smooth} warps={w} maxnreg={args.maxnreg} {usage}"
            print(f"{head} total {sum(ops.values())}: {shown}")


if __name__ == "__main__":
    main()
