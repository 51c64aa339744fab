"""Store throughput: model-frame K/V tiles -> cache records, in GB/s of fp16/bf16 input (K and V).

Times ``store_tiles`` (the prepare kernel into a workspace, then Sinkhorn + RTN + pack + write in
one encode launch), ``commit_tiles``
(tiles already prepared in the pool) and the reference store for scale, from CUDA graphs. Before
reporting, the Triton records are compared with the reference's on a slice of the same input;
a code more than one step off, or more than 3% of codes off by one, stops the run.

    PYTHONPATH=. python benchmarks/bench_store.py --out store.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks._common import TOL, copy_bandwidth, environment, time_graph
from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.kernels import store as S


def check(got: torch.Tensor, want: torch.Tensor, cfg: KVarNConfig, what: str) -> float:
    gk, gv = R.unpack_record(got, cfg)
    wk, wv = R.unpack_record(want, cfg)
    worst = 0.0
    for a, b in ((gk.codes, wk.codes), (gv.codes, wv.codes)):
        d = (a.int() - b.int()).abs()
        frac = float((d > 0).float().mean())
        if int(d.max()) > 1 or frac > TOL.CODE_MISMATCH_MAX:
            raise SystemExit(f"REFUSING TO REPORT: {what}: codes off by {int(d.max())}, {frac:.4f} differ")
        worst = max(worst, frac)
    return worst


SEQ_TILES = 16
"""Tiles per sequence in the per-sequence smoothing rows (a 2K-token prompt at 128-token tiles)."""


def bench(
    preset: str,
    d: int,
    dtype: torch.dtype,
    n_tiles: int,
    hkv: int,
    iters: int,
    smooth: bool | str = False,
    num_warps=None,
    max_regs=None,
) -> dict:
    """Time one configuration; ``num_warps`` and ``max_regs`` of the encode kernel (``None``: its default).

    ``smooth``: ``False``, ``True`` / ``"tile"`` (a vector per tile) or ``"sequence"`` (one per
    sequence of ``SEQ_TILES`` tiles, the first tile of each in the same call).
    """
    scope = "tile" if smooth is True else smooth
    extra = {"smooth_keys": True, "smooth_scope": scope} if scope else {}
    cfg = KVarNConfig.from_preset(preset, head_dim=d, sinkhorn_iters=iters, **extra)
    g = cfg.group_size
    k = (torch.randn(n_tiles, g, hkv, d, device="cuda") * torch.rand(1, 1, hkv, d, device="cuda") * 4).to(dtype)
    v = torch.randn(n_tiles, g, hkv, d, device="cuda").to(dtype)
    blocks = (torch.randperm(n_tiles, device="cuda") + 1).to(torch.int32)
    src = None
    if cfg.seq_smooth:
        src = blocks.reshape(-1, SEQ_TILES)[:, :1].expand(-1, SEQ_TILES).reshape(-1).contiguous()
    cache = torch.zeros(n_tiles + 1, hkv, cfg.record_bytes, dtype=torch.uint8, device="cuda")
    knobs = {"num_warps": num_warps, "max_regs": max_regs}
    S.store_tiles(k, v, blocks, cache, cfg, src, **knobs)
    n_chk = min(n_tiles, 64)
    want = torch.zeros_like(cache)
    R.store_tiles(k[:n_chk], v[:n_chk], blocks[:n_chk], want, cfg, None if src is None else src[:n_chk])
    ids = blocks[:n_chk].long()
    mism = check(cache[ids], want[ids], cfg, f"store_tiles {preset} d={d}")
    in_bytes = 2 * k.numel() * k.element_size()
    t_store = time_graph(lambda: S.store_tiles(k, v, blocks, cache, cfg, src, **knobs))
    pool_k = R.prepare(k, dtype)
    pool_v = R.prepare(v, dtype)
    slots = torch.arange(n_tiles, device="cuda", dtype=torch.int32)
    t_commit = time_graph(lambda: S.commit_tiles(pool_k, pool_v, slots, blocks, cache, cfg, src, **knobs))
    n_ref = min(n_tiles, 256)
    ref_src = None if src is None else src[:n_ref]
    t_ref = (
        time_graph(lambda: R.store_tiles(k[:n_ref], v[:n_ref], blocks[:n_ref], want, cfg, ref_src)) * n_tiles / n_ref
    )
    return {
        "preset": preset,
        "d": d,
        "dtype": str(dtype).replace("torch.", ""),
        "tiles": n_tiles,
        "hkv": hkv,
        "iters": iters,
        "smooth_keys": scope or False,
        "input_GB": in_bytes / 1e9,
        "store_us": t_store,
        "store_GBps": in_bytes / t_store / 1e3,
        "commit_GBps": in_bytes / t_commit / 1e3,
        "reference_GBps": in_bytes / t_ref / 1e3,
        "code_mismatch": mism,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="store.json")
    ap.add_argument(
        "--sweep",
        default="kvarn_k4v2_g128:128:4:0:0,kvarn_k4v2_g128:128:8:0:0,kvarn_k4v2_g128:128:8:128:0",
        help="encode launches to time before the table (fp16, 8 iterations): preset:D:num_warps:max_regs:smooth "
        "(max_regs 0: no cap; smooth 0: none, 1: per tile, 2: per sequence), comma-separated",
    )
    ap.add_argument("--cases", default="", help="only the table rows whose index is listed (comma-separated)")
    args = ap.parse_args()
    env = environment()
    copy_bw = copy_bandwidth()
    print(f"{env} copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    cases = [
        ("kvarn_k4v2_g128", 128, torch.float16, 1024, 8, 8),
        ("kvarn_k4v2_g128", 128, torch.bfloat16, 1024, 8, 8),
        ("kvarn_k4v2_g128", 128, torch.float16, 1024, 8, 16),
        ("kvarn_k4v2_g128", 64, torch.float16, 2048, 8, 8),
        ("kvarn_k4v2_g128", 256, torch.float16, 512, 8, 8),
        ("kvarn_k4v2_g64", 128, torch.float16, 2048, 8, 8),
        ("kvarn_k4v4_g128", 128, torch.float16, 1024, 8, 8),
        ("kvarn_k2v2_g128", 128, torch.float16, 1024, 8, 8),
        ("kvarn_k4v2_g128", 128, torch.float16, 1024, 8, 8, True),
        ("kvarn_k2v2_g128", 128, torch.float16, 1024, 8, 8, True),
        ("kvarn_k4v2_g128", 128, torch.float16, 1024, 8, 8, "sequence"),
        ("kvarn_k2v2_g128", 128, torch.float16, 1024, 8, 8, "sequence"),
    ]
    sweep = []
    for spec in args.sweep.split(",") if args.sweep else []:
        preset, d, warps, regs, smooth = spec.split(":")
        knobs = dict(num_warps=int(warps), max_regs=int(regs) or None)
        r = bench(
            preset,
            int(d),
            torch.float16,
            1024 * 128 // int(d),
            8,
            8,
            smooth={"1": "tile", "2": "sequence"}.get(smooth, False),
            **knobs,
        )
        sweep.append({**knobs, **r})
        print(
            f"sweep {preset} D={d} smooth={smooth} num_warps={warps} max_regs={regs}: "
            f"store {r['store_GBps']:.0f} GB/s, commit {r['commit_GBps']:.0f} GB/s",
            flush=True,
        )
    rows = []
    print(
        "| preset | D | dtype | iters | smooth | input GB | store_tiles GB/s | commit_tiles GB/s | reference GB/s "
        "| code mismatch |"
    )
    keep = {int(i) for i in args.cases.split(",")} if args.cases else set(range(len(cases)))
    for c in (c for i, c in enumerate(cases) if i in keep):
        r = bench(*c)
        rows.append(r)
        print(
            f"| {r['preset']} | {r['d']} | {r['dtype']} | {r['iters']} | {r['smooth_keys']} | {r['input_GB']:.2f} | "
            f"{r['store_GBps']:.0f} | {r['commit_GBps']:.0f} | {r['reference_GBps']:.1f} | {r['code_mismatch']:.5f} |",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"env": env, "copy_GBps": copy_bw, "sweep": sweep, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
