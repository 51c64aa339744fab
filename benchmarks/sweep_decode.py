"""Decode-attention sweep for tuning: default launch vs named variants, SDPA in the same run.

Times a fixed list of shapes with the default launch (as ``bench_decode.py`` does: CUDA-graph
replays, L2 flushed, correctness check against the reference first) and then each variant of
``VARIANTS`` (launch keyword arguments of ``paged_attention``), and reports the registers and
spills of every attention kernel compiled. ``--base`` times only the default rows (for an older
tree). One JSON file per run.

    PYTHONPATH=. python benchmarks/sweep_decode.py --out sweep.json [--base] [--checks]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks._common import copy_bandwidth, environment
from benchmarks.bench_decode import bench_shape, correctness_suite
from kvarn.kernels import attention as A

K42, K22, K42G64, K44 = "kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128"
SHAPES = (
    [(K42, 128, b, c) for c, b in [(32768, 16), (1024, 8), (1024, 1), (4096, 1), (4096, 8), (32768, 1)]]
    + [(K42, 128, b, c) for c, b in [(131072, 1), (32768, 64), (4096, 64), (16384, 8)]]
    + [(p, 128, b, c) for p in (K22, K42G64) for c, b in [(32768, 16), (1024, 8), (32768, 1), (4096, 64)]]
    + [(K44, 128, 16, 32768), (K42, 64, 16, 32768), (K42, 256, 16, 32768)]
)
"""``(preset, head_dim, batch, ctx)``, all 32 query / 8 KV heads, fp16."""
VARIANTS = (
    [(p, 128, 16, 32768, dict(num_warps=w, num_stages=s)) for p in (K42, K22, K42G64) for w, s in [(4, 3), (2, 2)]]
    + [(K42, 128, 16, 32768, dict(num_splits=n)) for n in (33, 50)]
    + [
        (K42, 128, 8, 1024, dict(num_splits=9)),
        (K42, 128, 1, 4096, dict(num_splits=33)),
        (K42, 128, 1, 32768, dict(num_splits=128)),
        (K42G64, 128, 8, 1024, dict(num_splits=17)),
        (K42G64, 128, 16, 32768, dict(num_splits=50)),
    ]
)


def compiled_kernels() -> dict:
    """Registers and spills of every compiled attention kernel, keyed by its specialization."""
    out = {}
    for cache in getattr(A._attn_kernel, "device_caches", {}).values():
        for key, k in cache[0].items():
            try:
                out[str(key)[-300:]] = {"n_regs": k.n_regs, "n_spills": k.n_spills, "warps": k.metadata.num_warps}
            except Exception as exc:
                out[str(key)[-300:]] = {"error": repr(exc)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--base", action="store_true", help="default launch only")
    ap.add_argument("--checks", action="store_true", help="run bench_decode's stored-cache checks first")
    args = ap.parse_args()
    env = environment()
    copy_bw = copy_bandwidth()
    print(f"{env} copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    if args.checks:
        correctness_suite(
            [
                (K42, 128, torch.float16, 32, 8),
                (K42, 128, torch.bfloat16, 32, 8),
                (K42, 64, torch.float16, 32, 8),
                (K42, 256, torch.float16, 32, 8),
                (K44, 128, torch.float16, 32, 8),
                (K42G64, 128, torch.float16, 32, 8),
                (K22, 128, torch.float16, 64, 8),
            ]
        )
    rows = []
    jobs = [(p, d, b, c, {}) for p, d, b, c in SHAPES] + ([] if args.base else VARIANTS)
    for preset, d, batch, ctx, launch in jobs:
        r = bench_shape(preset, d, 32, 8, batch, ctx, torch.float16, copy_bw, launch, sdpa=not launch)
        r.update(preset=preset, d=d, batch=batch, ctx=ctx, launch=launch)
        rows.append(r)
        sd = f"{r['sdpa_us']:7.1f} {r['speedup']:.2f}x" if "sdpa_us" in r else ""
        print(f"{preset} D={d} B={batch} ctx={ctx} {launch}: {r['kvarn_us']:7.1f} us {sd}", flush=True)
        torch.cuda.empty_cache()
    kernels = compiled_kernels()
    for key, v in kernels.items():
        print("kernel", v, key[-160:])
    with open(args.out, "w") as f:
        json.dump({"env": env, "copy_GBps": copy_bw, "rows": rows, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
