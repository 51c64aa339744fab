"""Where a decode launch's time goes, program by program: ``%globaltimer`` stamps of the attention kernel.

Runs a decode shape under :func:`kvarn.kernels.attention.decode_timeline` (replayed from a CUDA graph, the
stamps of the last replay read back) and summarizes them: when the programs start, how long each takes to
know its units, to walk its record tiles and to finish (partial, merge, output), grouped by the order the
hardware dispatches them (``dispatch = block + blocks x (kv_head + Hkv x split)``, x fastest) in rounds of one
program an SM, and the kernel's span against the replay's time. The plain launch is checked against the
reference before it is timed (``bench_decode.bench_shape``), the stamped replay's output after it.

    PYTHONPATH=. python benchmarks/timeline_decode.py --out timeline.json
    PYTHONPATH=. python benchmarks/timeline_decode.py --shape kvarn_k4v2_g128 64 32768 --splits 0
"""

from __future__ import annotations

import argparse
import json

import torch

from kvarn.kernels import attention_decode as AD

ENTRY, UNITS, RECORDS, FP, DONE, SM = (c.value for c in (AD.TIMELINE_ENTRY, AD.TIMELINE_UNITS, AD.TIMELINE_RECORDS,
    AD.TIMELINE_FP, AD.TIMELINE_DONE, AD.TIMELINE_SM))  # fmt: skip
"""The stamp columns (:func:`kvarn.kernels.attention.decode_timeline`)."""
DEFAULT_SHAPES = [
    (p, b, 32768, 0) for p, b in (("kvarn_k4v2_g128", 16), ("kvarn_k4v2_g128", 64), ("kvarn_k4v2_g128", 1))
]
"""``(preset, batch, context, splits)`` (32 / 8 heads, D = 128, fp16; splits 0: the default)."""
LAST_PROGRAMS = 8
"""The latest-finishing programs listed one by one (``last``)."""
MAX_SPLITS = 256
"""Stamp rows allotted a (sequence, KV head): more than any launch's splits."""


def _quantiles(x: torch.Tensor) -> list[float]:
    """Min, 10th, 50th, 90th percentile and max of ``x`` (µs), rounded to 0.01."""
    s = x.double().sort().values
    return [round(float(s[round(p * (len(s) - 1))]), 2) for p in (0.0, 0.1, 0.5, 0.9, 1.0)]


def summarize(stamps: torch.Tensor, grid: tuple[int, int, int], n_sms: int) -> dict:
    """Summary of one launch's stamps ``[rows, 8]`` (int64 ns; rows ``(block * Hkv + kv_head) * splits + split``).

    ``grid = (blocks, Hkv, splits)``. Programs without units (no ``RECORDS``
    stamp) count in the start and span only. ``fp_us``: the full-precision units (sink, own tile) after
    the records; ``finish_us``: partial, merge and output after those. ``last``: the ``LAST_PROGRAMS``
    programs that finished last, one by one. Rounds: the ``n_sms`` programs dispatched ``r``-th
    (``dispatch // n_sms``); ``per_round`` gives each round's programs, mean record walk and latest
    finish (µs from the first entry).
    """
    blocks, hkv, splits = grid
    n = blocks * hkv * splits
    if stamps.shape[0] < n:
        raise ValueError(f"{stamps.shape[0]} stamp rows for a grid of {n} programs")
    t = stamps[:n].to(torch.int64)
    if bool((t[:, ENTRY] == 0).any()):
        raise ValueError("a program of the grid left no entry stamp: the launch did not run stamped")
    t0 = t[:, ENTRY].min()
    us = (t[:, :SM] - t0).double() / 1e3
    walked = t[:, RECORDS] > 0
    done = t[:, DONE] > 0
    row = torch.arange(n)
    split, kvh, block = row % splits, (row // splits) % hkv, row // (splits * hkv)
    dispatch = block + blocks * (kvh + hkv * split)
    rounds = dispatch // n_sms
    walk = us[:, RECORDS] - us[:, UNITS]
    fp = us[:, FP] - us[:, RECORDS]
    per_round = []
    for r in range(int(rounds.max()) + 1):
        sel = (rounds == r) & walked
        if bool(sel.any()):
            last = round(float(us[sel & done, DONE].max()), 2) if bool((sel & done).any()) else None
            per_round.append(
                {
                    "round": r,
                    "programs": int(sel.sum()),
                    "walk_us": round(float(walk[sel].mean()), 2),
                    "last_done_us": last,
                }
            )
    out = {
        "programs": n,
        "walked": int(walked.sum()),
        "sms": int(t[:, SM].unique().numel()),
        "start_us": _quantiles(us[:, ENTRY]),
        "units_known_us": _quantiles(us[:, UNITS] - us[:, ENTRY]),
        "span_us": round(float(us[done, DONE].max()), 2) if bool(done.any()) else None,
        "per_round": per_round,
    }
    if bool(walked.any()):
        out["walk_us"] = _quantiles(walk[walked])
        out["fp_us"] = _quantiles(fp[walked & done])
        out["finish_us"] = _quantiles((us[:, DONE] - us[:, FP])[walked & done])
        out["done_us"] = _quantiles(us[walked & done, DONE])
        last = torch.nonzero(walked & done).flatten()
        last = last[us[last, DONE].argsort(descending=True)[:LAST_PROGRAMS]]
        out["last"] = [
            {
                "split": int(split[i]),
                "round": int(rounds[i]),
                "walk_us": round(float(walk[i]), 2),
                "fp_us": round(float(fp[i]), 2),
                "finish_us": round(float(us[i, DONE] - us[i, FP]), 2),
                "done_us": round(float(us[i, DONE]), 2),
            }
            for i in last.tolist()
        ]
    return out


def run_shape(preset: str, batch: int, ctx: int, splits: int, copy_bw: float) -> dict:
    from benchmarks._common import capture_graph, time_graph
    from benchmarks.bench_decode import args_of, bench_shape, check, synthetic_cache
    from kvarn.config import KVarNConfig
    from kvarn.kernels import attention as A

    hq, hkv, d = 32, 8, 128
    launch = {"num_splits": splits} if splits else {}
    plain = bench_shape(preset, d, hq, hkv, batch, ctx, torch.float16, copy_bw, launch, sdpa=False)  # checked
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    st = synthetic_cache(cfg, batch, ctx, hkv, torch.float16, seed=batch * 7 + ctx)
    q = torch.randn(batch, hq, d, device="cuda").half()
    buf = torch.zeros(batch * hkv * MAX_SPLITS, 8, dtype=torch.int64, device="cuda")  # rows past the grid stay 0
    with A.decode_timeline(buf):
        stamped_us = time_graph(lambda: A.paged_attention(*args_of(st, q, cfg), **launch))
        graph, out = capture_graph(lambda: A.paged_attention(*args_of(st, q, cfg), **launch))
        buf.zero_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    check(out, st, q, cfg, 1, f"stamped {preset} B={batch} ctx={ctx}")  # the stamped launch computes the same
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stamps = buf.cpu()
    n_splits = int((stamps[:, ENTRY] > 0).sum()) // (batch * hkv)  # the launch's own split count
    if n_splits == 0:
        raise SystemExit(f"REFUSING TO REPORT: no program stamped ({preset} B={batch} ctx={ctx})")
    summary = summarize(stamps, (batch, hkv, n_splits), sms)
    return {"preset": preset, "batch": batch, "ctx": ctx, "splits": n_splits, "graph_us": plain["kvarn_us"]} | {
        "graph_us_stamped": stamped_us,
        **summary,
    }


def main() -> None:
    from benchmarks._common import copy_bandwidth, environment

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="timeline.json")
    ap.add_argument("--shape", nargs=3, metavar=("PRESET", "BATCH", "CTX"), help="one shape instead of the defaults")
    ap.add_argument("--splits", type=int, default=0, help="with --shape: forced splits (0: the default)")
    args = ap.parse_args()
    shapes = DEFAULT_SHAPES
    if args.shape:
        shapes = [(args.shape[0], int(args.shape[1]), int(args.shape[2]), args.splits)]
    env = environment()
    copy_bw = copy_bandwidth()
    print(f"{env} copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    rows = []
    for shape in shapes:
        r = run_shape(*shape, copy_bw)
        rows.append(r)
        with open(args.out, "w") as f:
            json.dump({"env": env, "copy_GBps": copy_bw, "rows": rows}, f, indent=1)
        print(
            f"{r['preset']} {r['batch']} / {r['ctx']}, {r['splits']} splits: replay {r['graph_us']:.1f} µs "
            f"(stamped {r['graph_us_stamped']:.1f}), span {r['span_us']} µs; record walk (min/p10/p50/p90/max) "
            f"{r.get('walk_us')}, full-precision units {r.get('fp_us')}, finish {r.get('finish_us')}, done "
            f"{r.get('done_us')}",
            flush=True,
        )
        for p in r.get("last", []):
            print(f"  late: {p}")
        print("| round | programs | mean walk µs | last done µs |")
        print("|---:|---:|---:|---:|")
        for p in r["per_round"]:
            print(f"| {p['round']} | {p['programs']} | {p['walk_us']} | {p['last_done_us']} |")


if __name__ == "__main__":
    main()
