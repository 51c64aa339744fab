"""Decode-attention sweep for tuning: default launch vs named variants, SDPA in the same run.

Times a fixed list of shapes with the default launch (as ``bench_decode.py`` does: CUDA-graph
replays, L2 flushed, correctness check against the reference first) and then each variant of
``VARIANTS`` (launch keyword arguments of ``paged_attention``), and reports the registers and
spills of every attention kernel compiled. ``--base`` times only the default rows (for an older
tree). One JSON file per run.

    PYTHONPATH=. python benchmarks/sweep_decode.py --out sweep.json [--base] [--checks] [--warm 16] [--fold]

``--warm N`` compiles every launch first in N processes (Triton's disk cache is shared), so the
device time goes to timing. Run from an older tree's root with this file's path, ``--base`` times
that tree's kernels on the same shapes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks._common import copy_bandwidth, environment
from benchmarks.bench_decode import args_of, bench_shape, correctness_suite, synthetic_cache
from kvarn.config import KVarNConfig
from kvarn.kernels import attention as A

K42, K22, K42G64, K44 = "kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128"
BC = [(1, 1024), (8, 1024), (1, 4096), (1, 32768), (16, 32768), (64, 4096)]
SHAPES = (
    [(K42, 128, b, c) for b, c in [*BC, (8, 4096), (1, 16384), (64, 32768), (1, 131072)]]
    + [(p, 128, b, c) for p in (K22, K42G64) for b, c in BC]
    + [(K44, 128, 16, 32768), (K44, 128, 1, 32768), (K42, 64, 16, 32768), (K42, 256, 16, 32768)]
)
"""``(preset, head_dim, batch, ctx)``, all 32 query / 8 KV heads, fp16."""
VARIANTS = [(p, d, b, c, dict(tokens_m=t)) for p, d, b, c in SHAPES for t in (False, True)] + [
    (K42G64, 128, b, c, dict(tokens_m=True, num_warps=2)) for b, c in [(1, 4096), (1, 32768), (16, 32768), (64, 4096)]
]
"""Launch keyword arguments of ``paged_attention`` timed beside the default (not with ``--base``)."""
QUICK = [(p, 128, 16, 32768) for p in (K42, K22, K42G64, K44)] + [
    (K42, 64, 16, 32768),
    (K42, 256, 16, 32768),
    (K42, 128, 1, 32768),
    (K42G64, 128, 1, 4096),
]
"""``--quick``: these shapes, default and ``tokens_m`` off and on (and the 2-warp ``tokens_m`` for 64-token tiles)."""
RULE = [(K42, 128, b, c) for b, c in [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (8, 32768), (16, 32768)]] + [
    (p, 128, 8, 4096) for p in (K22, K44)
]
"""``--rule``: the shapes that set ``tokens_m_default``, default and ``tokens_m`` off and on."""
FOLD = [(p, 128, 16, 32768) for p in (K42, K22, K42G64, K44)] + [
    (K42, 64, 16, 32768),
    (K42, 256, 16, 32768),
    (K42, 128, 8, 4096),
    (K42, 128, 1, 4096),
    (K42G64, 128, 1, 4096),
    (K44, 128, 1, 32768),
]
"""``--fold``: these shapes, default (codes' offsets folded) and ``fold_offsets=False``."""


def _warm(jobs: list) -> int:
    """Compile the kernels of ``jobs`` (a worker process): one call per shape, as ``bench_shape`` makes it."""
    for preset, d, batch, ctx, launch in jobs:
        cfg = KVarNConfig.from_preset(preset, head_dim=d)
        st = synthetic_cache(cfg, batch, ctx, 8, torch.float16, seed=0)
        q = torch.randn(batch, 32, d, device="cuda").half()
        A.paged_attention(*args_of(st, q, cfg), **launch)
        torch.cuda.synchronize()
    return len(jobs)


def warm(jobs: list, workers: int) -> None:
    """Compile every job's kernels in ``workers`` processes first (they share Triton's disk cache)."""
    ctx = multiprocessing.get_context("spawn")
    chunks = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        done = sum(pool.map(_warm, [c for c in chunks if c]))
    print(f"warmed {done} launches in {workers} processes", flush=True)


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
    ap.add_argument("--compare", help="a --base run's JSON: print both side by side at the end")
    ap.add_argument("--warm", type=int, default=0, help="compile every launch first in this many processes")
    ap.add_argument("--quick", action="store_true", help="the QUICK shapes only, default and tokens_m off / on")
    ap.add_argument("--rule", action="store_true", help="the RULE shapes only, default and tokens_m off / on")
    ap.add_argument("--fold", action="store_true", help="the FOLD shapes only, default and fold_offsets=False")
    ap.add_argument("--warm-only", action="store_true", help="compile (with --warm), time nothing")
    args = ap.parse_args()
    jobs = [(p, d, b, c, {}) for p, d, b, c in SHAPES] + ([] if args.base else VARIANTS)
    if args.quick or args.rule:
        shapes = QUICK if args.quick else RULE
        jobs = [
            (p, d, b, c, launch) for p, d, b, c in shapes for launch in ({}, dict(tokens_m=False), dict(tokens_m=True))
        ]
        jobs += [(p, d, b, c, dict(tokens_m=True, num_warps=2)) for p, d, b, c in shapes if p == K42G64]
    if args.fold:
        jobs = [(p, d, b, c, launch) for p, d, b, c in FOLD for launch in ({}, dict(fold_offsets=False))]
    if args.warm:
        t0 = time.time()
        warm(jobs, args.warm)
        print(f"warm-up compile {time.time() - t0:.1f} s", flush=True)
    if args.warm_only:
        return
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
    if args.compare:
        compare(args.compare, rows)


def compare(base_json: str, rows: list[dict]) -> None:
    """Print a --base run's rows beside this run's (same shapes), the variants after."""
    with open(base_json) as f:
        base = {(r["preset"], r["d"], r["batch"], r["ctx"]): r for r in json.load(f)["rows"]}
    print("| preset | D | B | ctx | before us | after us | SDPA us (before/after run) | before | after |")
    for r in rows:
        key = (r["preset"], r["d"], r["batch"], r["ctx"])
        b = base.get(key)
        if r["launch"] or b is None:
            continue
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {b['kvarn_us']:.1f} | {r['kvarn_us']:.1f} | "
            f"{b['sdpa_us']:.1f}/{r['sdpa_us']:.1f} | {b['speedup']:.2f}x | {r['speedup']:.2f}x |"
        )
    for r in rows:
        if r["launch"]:
            print(f"variant {r['preset']} B={r['batch']} ctx={r['ctx']} {r['launch']}: {r['kvarn_us']:.1f} us")


if __name__ == "__main__":
    main()
