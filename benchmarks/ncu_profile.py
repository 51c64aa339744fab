"""Where a kernel's warps wait: Nsight Compute's stall samples for the decode attention and store kernels.

Two parts, so the process Nsight Compute profiles is the plain workload. On a CUDA machine with the
toolkit's ``ncu`` (``--clock-control none`` leaves the GPU's clocks as they are)::

    ncu --clock-control none --kernel-name regex:_attn_kernel --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -f -o dec \\
        python3 benchmarks/ncu_profile.py decode kvarn_k4v2_g128 --d 128 --batch 16 --ctx 32768
    ncu -i dec.ncu-rep --page source --print-source sass --csv > dec.csv
    python3 benchmarks/ncu_profile.py summarize dec.csv [--json dec.json]

(``store kvarn_k4v2_g128`` with ``--kernel-name regex:_encode_kernel --launch-skip 1`` for the store.)
``decode`` and ``store`` run their kernel a few times on synthetic data (the first calls compile);
``summarize`` needs neither torch nor a GPU: it reads the per-instruction export, takes the hottest
loop (the instructions sharing the execution count that holds the most stall samples) and prints
its share of the samples by stall reason and by opcode, and its most-sampled instructions with
their leading reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_source_csv(path: str | Path) -> list[dict]:
    """The rows of ``ncu --page source --print-source sass --csv``: per instruction its address, SASS text,
    execution count, stall samples and samples per reason (``stall_*`` columns, the issued ones only)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r)
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[start + 1 :]:
        if len(r) < len(header):
            continue
        out.append(
            {
                "address": r[col["Address"]],
                "sass": r[col["Source"]].strip(),
                "executed": int(r[col[EXECUTED]] or 0),
                "samples": int(r[col[SAMPLES]] or 0),
                "reasons": {h[len("stall_") :]: int(r[col[h]] or 0) for h in reasons},
            }
        )
    return out


def opcode(sass: str) -> str:
    """``@!P0 LDG.E.128 R4, ...`` -> ``LDG``."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summarize(rows: list[dict], top: int = 20) -> dict:
    """The hottest loop of :func:`read_source_csv`'s rows: its instructions, its share of the kernel's stall
    samples, those samples' split by reason and by opcode (fractions of the loop's), and its ``top``
    most-sampled instructions."""
    total = sum(r["samples"] for r in rows)
    by_count = collections.defaultdict(list)
    for r in rows:
        if r["executed"] > 0:
            by_count[r["executed"]].append(r)
    if not by_count:
        raise ValueError("the export has no executed instructions (was the kernel profiled?)")
    executed, loop = max(by_count.items(), key=lambda kv: sum(r["samples"] for r in kv[1]))
    samples = sum(r["samples"] for r in loop)
    reasons, ops, op_count = collections.Counter(), collections.Counter(), collections.Counter()
    for r in loop:
        reasons.update(r["reasons"])
        ops[opcode(r["sass"])] += r["samples"]
        op_count[opcode(r["sass"])] += 1
    share = 1.0 / max(samples, 1)
    hot = sorted(loop, key=lambda r: -r["samples"])[:top]
    return {
        "kernel_samples": total,
        "loop_executed": executed,
        "loop_instructions": len(loop),
        "loop_samples": samples,
        "loop_share": samples / max(total, 1),
        "reasons": {k: v * share for k, v in reasons.most_common() if v},
        "opcodes": {k: {"share": v * share, "count": op_count[k]} for k, v in ops.most_common()},
        "top": [
            {
                "address": r["address"],
                "sass": r["sass"],
                "share": r["samples"] * share,
                "reasons": dict(sorted(((k, v) for k, v in r["reasons"].items() if v), key=lambda kv: -kv[1])[:3]),
            }
            for r in hot
        ],
    }


def print_summary(s: dict) -> None:
    print(
        f"hottest loop: {s['loop_instructions']} instructions executed {s['loop_executed']} times each, "
        f"{100 * s['loop_share']:.1f}% of {s['kernel_samples']} stall samples"
    )
    print("by reason: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["reasons"].items()))
    ops = list(s["opcodes"].items())[:20]
    print("by opcode (count): " + ", ".join(f"{k} {100 * v['share']:.1f}% ({v['count']})" for k, v in ops))
    for t in s["top"]:
        why = ", ".join(f"{k} {v}" for k, v in t["reasons"].items())
        print(f"  {t['address'][-6:]} {100 * t['share']:5.1f}%  {t['sass'][:64]:64s} {why}")


def run_decode(args) -> None:
    import torch

    from benchmarks.bench_decode import args_of, synthetic_cache
    from kvarn.config import KVarNConfig
    from kvarn.kernels import attention

    cfg = KVarNConfig.from_preset(args.preset, head_dim=args.d)
    st = synthetic_cache(cfg, args.batch, args.ctx, args.hkv, torch.float16, seed=1)
    q = torch.randn(args.batch, args.hq, args.d, device="cuda").half()
    for _ in range(args.calls):
        attention.paged_attention(*args_of(st, q, cfg))
    torch.cuda.synchronize()


def run_store(args) -> None:
    import torch

    from kvarn.config import KVarNConfig
    from kvarn.kernels import store

    cfg = KVarNConfig.from_preset(args.preset, head_dim=args.d)
    n, hkv, g, d = args.tiles, args.hkv, cfg.group_size, args.d
    k = (torch.randn(n, g, hkv, d, device="cuda") * torch.rand(1, 1, hkv, d, device="cuda") * 4).half()
    v = torch.randn(n, g, hkv, d, device="cuda").half()
    blocks = (torch.randperm(n, device="cuda") + 1).to(torch.int32)
    cache = torch.zeros(n + 1, hkv, cfg.record_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(args.calls):
        store.store_tiles(k, v, blocks, cache, cfg)
    torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    work = argparse.ArgumentParser(add_help=False)  # what the two workloads share
    work.add_argument("preset")
    work.add_argument("--d", type=int, default=128)
    work.add_argument("--hkv", type=int, default=8)
    work.add_argument("--calls", type=int, default=5, help="calls (the first ones compile)")
    dec = sub.add_parser("decode", parents=[work], help="decode attention calls (default launch) for ncu")
    dec.add_argument("--batch", type=int, default=16)
    dec.add_argument("--ctx", type=int, default=32768)
    dec.add_argument("--hq", type=int, default=32)
    sto = sub.add_parser("store", parents=[work], help="store_tiles calls for ncu")
    sto.add_argument("--tiles", type=int, default=1024)
    summ = sub.add_parser("summarize", help="the hottest loop of an ncu source-page CSV export")
    summ.add_argument("csv")
    summ.add_argument("--top", type=int, default=20)
    summ.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.what == "summarize":
        s = summarize(read_source_csv(args.csv), args.top)
        print_summary(s)
        if args.json:
            Path(args.json).write_text(json.dumps(s, indent=1))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        (run_decode if args.what == "decode" else run_store)(args)


if __name__ == "__main__":
    main()
