"""Decode attention over the paged KVarN cache vs fp16 SDPA (flash) on the same shapes.

For each shape: a synthetic cache (random codes, plausible scales) of ``B`` sequences of ``ctx + 37``
tokens (37 in the fp16 tail), the same shape as fp16 K/V for SDPA, both timed from CUDA graphs
with L2 flushed between replays. Before any number is reported, the kernel is checked against the
reference: on a small cache stored by the reference (per preset, head dim, dtype and GQA), and on
the first sequence of every timed shape. A failed check stops the run.

    PYTHONPATH=. python benchmarks/bench_decode.py --out decode.json [--quick]
    PYTHONPATH=. python benchmarks/bench_decode.py --out intercept.json --intercept kvarn_k4v2_g128 16 8 1
    PYTHONPATH=. python benchmarks/bench_decode.py --out variants.json --variants kvarn_k4v2_g128 16 32768
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks._common import TOL, copy_bandwidth, environment, time_eager, time_graph
from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.kernels import attention as A
from kvarn.kernels import launch_rules
from kvarn.reference.quantize import pool_exponent

TAIL = 37
REL_TOL = TOL.ATTN_REL


def synthetic_cache(cfg: KVarNConfig, batch: int, ctx: int, hkv: int, dtype: torch.dtype, seed: int) -> dict:
    """Random records (codes, scales, centered zero points) and own tiles of ``TAIL`` tokens, ``batch`` x ``ctx``.

    The own tiles hold N(0, 1) rotated values in the pool form (``2^-POOL_EXP`` of them in fp16), so keys of
    records and own tiles are of one scale and a decode's output is an average over the whole context: the
    check then sees the records (with fp16 tails 16x too large it saw mostly the own tile, and missed a bias
    of the value sums that grew with the context).
    """
    g, d = cfg.group_size, cfg.head_dim
    n_full = ctx // g
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = batch * n_full + 1
    cache = torch.empty(num_blocks, hkv, cfg.record_bytes, dtype=torch.uint8, device="cuda").random_(
        0, 256, generator=gen
    )
    off, lens = cfg.offsets, cfg.field_lengths

    def field(name, dt):
        return cache[..., off[name] : off[name] + 2 * lens[name]].view(dt)

    field("k_scale", torch.float16).uniform_(0.02, 0.2, generator=gen)
    k_mid, v_mid = (((1 << bits) - 1) / 2 for bits in (cfg.k_bits, cfg.v_bits))  # centered codes
    field("k_zero", torch.float16).copy_(-k_mid * field("k_scale", torch.float16))
    field("k_tok", torch.bfloat16).uniform_(0.5, 2.0, generator=gen)
    field("v_scale", torch.float16).uniform_(0.1, 0.6, generator=gen)
    field("v_zero", torch.float16).copy_(-v_mid * field("v_scale", torch.float16))
    field("v_chan", torch.bfloat16).uniform_(0.5, 2.0, generator=gen)
    if cfg.smooth_keys:  # plausible smoothing factors (random bytes may be fp8 NaN)
        smooth = cache[..., cfg.offsets["k_smooth"] : cfg.offsets["k_smooth"] + d]
        vals = torch.empty(smooth.shape, device="cuda").uniform_(0.1, 1.0, generator=gen)
        smooth.copy_(vals.to(torch.float8_e4m3fn).view(torch.uint8))
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    block_table = perm.reshape(batch, n_full).to(torch.int32)
    if cfg.seq_smooth:  # every record of a sequence carries its one vector, as the store writes them
        rows = block_table.long()
        smooth[rows] = smooth[rows[:, :1]].expand(-1, n_full, -1, -1).clone()
    pool_scale = 2.0 ** -pool_exponent(dtype, d)
    tail_k = (torch.randn(batch, g, hkv, d, device="cuda", generator=gen) * pool_scale).to(dtype)
    tail_v = (torch.randn(batch, g, hkv, d, device="cuda", generator=gen) * pool_scale).to(dtype)
    return {
        "cache": cache,
        "block_table": block_table,
        "seq_lens": torch.full((batch,), ctx + TAIL, dtype=torch.int32, device="cuda"),
        "tail_k": tail_k,
        "tail_v": tail_v,
        "tail_slots": torch.arange(batch, dtype=torch.int32, device="cuda"),
    }


def stored_cache(cfg: KVarNConfig, lengths: list[int], hkv: int, dtype: torch.dtype, seed: int) -> dict:
    """A small cache written by the reference store (real KVarN records)."""
    g, d = cfg.group_size, cfg.head_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_full = [n // g for n in lengths]
    num_blocks = sum(n_full) + 1
    cache = torch.zeros(num_blocks, hkv, cfg.record_bytes, dtype=torch.uint8, device="cuda")
    block_table = torch.zeros(len(lengths), max(n_full), dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    i = 0
    for b, n in enumerate(n_full):
        ids = perm[i : i + n]
        i += n
        block_table[b, :n] = ids.to(torch.int32)
        k = torch.randn(n, g, hkv, d, device="cuda", generator=gen) * torch.rand(1, 1, hkv, d, device="cuda") * 3
        v = torch.randn(n, g, hkv, d, device="cuda", generator=gen)
        R.store_tiles(k.to(dtype), v.to(dtype), ids, cache, cfg, ids[:1].expand(n) if cfg.seq_smooth else None)
    tail_k = torch.randn(len(lengths), g, hkv, d, device="cuda", generator=gen).to(dtype)
    tail_v = torch.randn(len(lengths), g, hkv, d, device="cuda", generator=gen).to(dtype)
    return {
        "cache": cache,
        "block_table": block_table,
        "seq_lens": torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        "tail_k": tail_k,
        "tail_v": tail_v,
        "tail_slots": torch.arange(len(lengths), dtype=torch.int32, device="cuda"),
    }


def args_of(st: dict, q: torch.Tensor, cfg: KVarNConfig, rows=None) -> tuple:
    sel = slice(None) if rows is None else slice(0, rows)
    return (
        q[sel],
        st["cache"],
        st["block_table"][sel],
        st["seq_lens"][sel],
        st["tail_k"],
        st["tail_v"],
        st["tail_slots"][sel],
        cfg,
    )


def check(out: torch.Tensor, st: dict, q: torch.Tensor, cfg: KVarNConfig, rows: int, what: str) -> float:
    ref = R.paged_attention(*args_of(st, q.float(), cfg, rows))
    got = out[:rows].float()
    if not torch.isfinite(out).all():
        raise SystemExit(f"REFUSING TO REPORT: non-finite kvarn output ({what})")
    err = float((got - ref).abs().max() / ref.abs().max())
    if err > REL_TOL[q.dtype]:
        raise SystemExit(f"REFUSING TO REPORT: kvarn vs reference rel err {err:.2e} > {REL_TOL[q.dtype]} ({what})")
    return err


def sdpa_flash(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)


def smooth_config(preset: str, d: int, smooth: str | None) -> KVarNConfig:
    """``preset`` at head dim ``d`` with key smoothing per ``"tile"``, per ``"sequence"`` or none (``None``)."""
    if smooth is None:
        return KVarNConfig.from_preset(preset, head_dim=d)
    return KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=True, smooth_scope=smooth)


def bench_shape(
    preset,
    d,
    hq,
    hkv,
    batch,
    ctx,
    dtype,
    copy_bw,
    launch: dict,
    sdpa: bool = True,
    smooth: str | None = None,
    eager: bool = False,
) -> dict:
    """Time one shape; ``launch`` holds the attention kernel's ``num_warps`` and ``num_stages``.

    ``eager`` (with ``sdpa``) adds :func:`time_eager`'s host and wall time per call of the same
    kvarn and SDPA calls on the same inputs.
    """
    cfg = smooth_config(preset, d, smooth)
    st = synthetic_cache(cfg, batch, ctx, hkv, dtype, seed=batch * 7 + ctx)
    q = torch.randn(batch, hq, d, device="cuda").to(dtype)
    out = A.paged_attention(*args_of(st, q, cfg), **launch)
    keys = "" if smooth is None else f" keys smoothed per {smooth}"
    err = check(out, st, q, cfg, 1, f"{preset}{keys} d={d} B={batch} ctx={ctx}")
    t_kv = time_graph(lambda: A.paged_attention(*args_of(st, q, cfg), **launch))
    n_full = ctx // cfg.group_size
    kv_bytes = batch * hkv * (n_full * cfg.record_bytes + TAIL * d * 2 * 2)
    if not sdpa:
        return {"kvarn_us": t_kv, "kvarn_GBps": kv_bytes / t_kv / 1e3}
    length = ctx + TAIL
    k16 = torch.randn(batch, hkv, length, d, device="cuda", dtype=dtype)
    v16 = torch.randn_like(k16)
    q4 = q[:, :, None, :]
    sdpa_flash(q4, k16, v16)
    t_sd = time_graph(lambda: sdpa_flash(q4, k16, v16))
    fp16_bytes = 2 * k16.numel() * k16.element_size()
    timings = {}
    if eager:
        args = args_of(st, q, cfg)
        host, wall = time_eager(lambda: A.paged_attention(*args, **launch))
        sd_host, sd_wall = time_eager(lambda: sdpa_flash(q4, k16, v16))
        timings = {"eager_host_us": host, "eager_wall_us": wall}
        timings |= {"sdpa_eager_host_us": sd_host, "sdpa_eager_wall_us": sd_wall}
    return timings | {
        "preset": preset,
        "d": d,
        "hq": hq,
        "hkv": hkv,
        "batch": batch,
        "ctx": ctx,
        "dtype": str(dtype).replace("torch.", ""),
        "smooth_keys": smooth,
        "kvarn_us": t_kv,
        "sdpa_us": t_sd,
        "speedup": t_sd / t_kv,
        "kvarn_GBps": kv_bytes / t_kv / 1e3,
        "kvarn_pct_copy": 100 * kv_bytes / t_kv / 1e3 / copy_bw,
        "sdpa_GBps": fp16_bytes / t_sd / 1e3,
        "check_rel_err": err,
        "splits": launch_rules.default_splits(cfg, batch * hkv, n_full + 1, False, q.device),
    }


EAGER_SHAPES = [
    ("kvarn_k4v2_g128", 1, 1024),
    ("kvarn_k4v2_g128", 8, 1024),
    ("kvarn_k4v2_g128", 1, 4096),
    ("kvarn_k4v2_g128", 1, 32768),
    ("kvarn_k4v2_g128", 16, 32768),
    ("kvarn_k2v2_g128", 1, 4096),
    ("kvarn_k4v2_g64", 1, 4096),
]
"""``--eager`` shapes (preset, batch, context; D = 128, 32/8 heads, fp16): where the host's share shows."""


def eager_main(out_path: str, env: dict, copy_bw: float) -> None:
    """Eager ``paged_attention`` calls against graph replays and eager flash SDPA (target: <= 35 µs host a call).

    Each shape is first checked against the reference (``bench_shape``); then ``time_eager`` gives the
    host time per call (the Python and launch work of the calling thread) and the wall time per call
    of 200 back-to-back calls, for kvarn and for SDPA.
    """
    rows = []
    print("| preset | B | ctx | graph us | eager host us | eager wall us | SDPA graph us | SDPA eager wall us |")
    for preset, batch, ctx in EAGER_SHAPES:
        r = bench_shape(preset, 128, 32, 8, batch, ctx, torch.float16, copy_bw, {}, eager=True)
        rows.append(r)
        torch.cuda.empty_cache()
        print(
            f"| {preset} | {batch} | {ctx} | {r['kvarn_us']:.1f} | {r['eager_host_us']:.1f} | "
            f"{r['eager_wall_us']:.1f} | {r['sdpa_us']:.1f} | {r['sdpa_eager_wall_us']:.1f} |",
            flush=True,
        )
        with open(out_path, "w") as f:
            json.dump({"env": env, "copy_GBps": copy_bw, "eager": rows}, f, indent=1)


RULE_SHAPES = [
    *[("kvarn_k4v2_g64", 128, b, c) for b, c in ((8, 4096), (2, 32768), (16, 4096), (4, 4096), (1, 32768))],
    *[("kvarn_k4v2_g64", 128, b, c) for b, c in ((1, 1024), (1, 2048), (64, 1024))],
    ("kvarn_k4v2_g64", 128, 16, 32768),
    ("kvarn_k4v4_g64", 128, 16, 32768),
    ("kvarn_k4v4_g64", 128, 8, 4096),
    *[("kvarn_k4v2_g128", 256, b, c) for b, c in ((1, 4096), (8, 4096), (16, 32768))],
    *[("kvarn_k4v2_g128", 64, b, c) for b, c in ((1, 4096), (8, 4096), (16, 32768))],
    *[("kvarn_k4v2_g128", 128, b, c) for b, c in ((1, 1024), (8, 1024), (1, 2048), (8, 2048), (64, 2048))],
    *[("kvarn_k4v2_g128", 128, b, c) for b, c in ((1, 4096), (16, 32768), (64, 32768))],
    *[(p, 128, b, 32768) for p in ("kvarn_k4v2_g128", "kvarn_k4v4_g128") for b in (2, 3, 4)],
    ("kvarn_k2v2_g128", 128, 16, 32768),
    ("kvarn_k4v4_g128", 128, 16, 32768),
]
"""``--rules`` shapes (preset, D, batch, context; 32/8 heads, fp16): where ``decode_shape_default`` and the split
rules change the launch (1, 2 or 4 warps, stacked tiles), where ``fuse_query_rotation`` keeps or drops the prologue
(2-4 / 32K), and their neighbours."""
GRID_SHAPES = [
    (p, d, b, c)
    for p, d in [
        ("kvarn_k4v2_g128", 128),
        ("kvarn_k2v2_g128", 128),
        ("kvarn_k4v4_g128", 128),
        ("kvarn_k4v2_g64", 128),
        ("kvarn_k4v4_g64", 128),
        ("kvarn_k4v2_g128", 64),
        ("kvarn_k4v2_g128", 256),
    ]
    for c in (1024, 4096, 32768, 131072)
    for b in (1, 4, 16, 64)
    if b * c <= 16 * 131072
]
"""``--grid`` shapes: presets and head dims x batch x context (32/8 heads, fp16), batch x context up to 2M tokens."""


def table_main(out_path: str, env: dict, copy_bw: float, shapes: list, name: str) -> None:
    """The default launches of ``shapes`` against SDPA, each with the split count, warps and stacking it took.

    What was launched is read from the launcher's call of ``_launch_attention`` (the graph capture's),
    so the table names the rules' choices as they ran, not as this script would recompute them.
    """
    seen = {}
    launch = A._launch_attention

    def spy(grid, *args):
        seen.update(splits=grid[2], warps=args[-1]["num_warps"], stack=args[-1]["STACK"], fused=args[-1]["FUSED_Q"])
        return launch(grid, *args)

    A._launch_attention = spy
    rows = []
    print("| preset | D | B | ctx | kvarn us | SDPA us | vs SDPA | % copy BW | splits | warps | stacked | fused q |")
    try:
        for preset, d, batch, ctx in shapes:
            r = bench_shape(preset, d, 32, 8, batch, ctx, torch.float16, copy_bw, {})
            r.update(seen)
            rows.append(r)
            torch.cuda.empty_cache()
            print(
                f"| {preset} | {d} | {batch} | {ctx} | {r['kvarn_us']:.1f} | {r['sdpa_us']:.1f} | "
                f"{r['speedup']:.2f}x | {r['kvarn_pct_copy']:.0f}% | {r['splits']} | {r['warps']} | {r['stack']} | "
                f"{r['fused']} |",
                flush=True,
            )
            with open(out_path, "w") as f:
                json.dump({"env": env, "copy_GBps": copy_bw, name: rows}, f, indent=1)
    finally:
        A._launch_attention = launch


INTERCEPT_STEPS = (8, 16, 32)
"""``--intercept``: contexts ``k * splits * G`` (plus the 37-token tail), so each split walks ``k + 1`` units."""


def fit_units(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + b * units`` through ``(units, t)`` points: ``(a, b)``, the per-call intercept and the
    time per unit a split walks."""
    n = len(points)
    if n < 2 or len({u for u, _ in points}) < 2:
        raise ValueError("fit_units needs two or more distinct unit counts")
    mu = sum(u for u, _ in points) / n
    mt = sum(t for _, t in points) / n
    b = sum((u - mu) * (t - mt) for u, t in points) / sum((u - mu) ** 2 for u, _ in points)
    return mt - b * mu, b


def intercept_main(out_path: str, env: dict, copy_bw: float, preset: str, batch: int, splits: int, warps: int) -> None:
    """Where a full-grid launch's time goes: the split count and warps fixed, the context grown so the longest split
    walks ``k + 1`` units (``INTERCEPT_STEPS``), and ``t = a + b * units`` fitted (:func:`fit_units`). ``b`` is the
    loop's cost a tile with every program resident (its bandwidth: the records all programs read a step), ``a`` what
    a call costs besides (launches, the programs' set-up, the first tiles' latency, the merge). Each shape is first
    checked against the reference (``bench_shape``). 32 / 8 heads, fp16; ``batch * 8 * splits`` programs should fit
    one wave (8 one-warp programs an SM at D = 128: ``16 8 1`` is 1,024 on 132 SMs), else the fit is not the loop's.
    """
    cfg = KVarNConfig.from_preset(preset, head_dim=128)
    programs = batch * 8 * splits
    wave = 8 * launch_rules._num_sms(torch.cuda.current_device())
    if programs > wave:
        print(f"warning: {programs} programs exceed one wave of 8 an SM ({wave}); b is not the loop's cost alone")
    seen = {}
    launch = A._launch_attention

    def spy(grid, *args):
        seen.update(splits=grid[2], warps=args[-1]["num_warps"], fused=args[-1]["FUSED_Q"])
        return launch(grid, *args)

    A._launch_attention = spy
    params = {"preset": preset, "batch": batch, "splits": splits, "warps": warps, "programs": programs}
    rows = []
    print("| preset | B | ctx | splits | units (longest split) | kvarn us | fused q |")
    try:
        for k in INTERCEPT_STEPS:
            ctx = k * splits * cfg.group_size
            knobs = {"num_splits": splits, "num_warps": warps}
            r = bench_shape(preset, 128, 32, 8, batch, ctx, torch.float16, copy_bw, knobs, sdpa=False)
            r.update(seen, units=k + 1, ctx=ctx)
            rows.append(r)
            print(f"| {preset} | {batch} | {ctx} + {TAIL} | {splits} | {k + 1} | {r['kvarn_us']:.2f} | {r['fused']} |")
            with open(out_path, "w") as f:
                json.dump({"env": env, "copy_GBps": copy_bw, "params": params, "intercept": rows}, f, indent=1)
    finally:
        A._launch_attention = launch
    a, b = fit_units([(r["units"], r["kvarn_us"]) for r in rows])
    loop_gbps = programs * cfg.record_bytes / b / 1e3
    fit = {"intercept_us": a, "unit_us": b, "loop_GBps": loop_gbps, "loop_pct_copy": 100 * loop_gbps / copy_bw}
    print(
        f"t = {a:.1f} us + {b:.3f} us x units; the loop at {loop_gbps:.0f} GB/s ({fit['loop_pct_copy']:.0f}% of copy)"
    )
    with open(out_path, "w") as f:
        json.dump({"env": env, "copy_GBps": copy_bw, "params": params, "intercept": rows, "fit": fit}, f, indent=1)


def correctness_suite(configs, smooth: str | None = None) -> list[dict]:
    out = []
    for preset, d, dtype, hq, hkv in configs:
        cfg = smooth_config(preset, d, smooth)
        g = cfg.group_size
        lengths = [3 * g + 5, 40 * g + g - 1, g, 17 * g + 64]
        st = stored_cache(cfg, lengths, hkv, dtype, seed=d + hq)
        q = torch.randn(len(lengths), hq, d, device="cuda").to(dtype)
        o = A.paged_attention(*args_of(st, q, cfg))
        err = check(o, st, q, cfg, len(lengths), f"stored {preset} d={d} {dtype} {hq}/{hkv}")
        out.append(
            {"preset": preset, "d": d, "dtype": str(dtype), "hq": hq, "hkv": hkv, "smooth": smooth, "rel_err": err}
        )
        print(f"check {preset} d={d} {dtype} {hq}/{hkv} smooth={smooth}: rel err {err:.2e}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode.json")
    ap.add_argument("--quick", action="store_true", help="a handful of shapes only")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="host cost of eager calls: a few shapes, eager (host and wall time per call) beside graph replays",
    )
    ap.add_argument(
        "--smooth", action="store_true", help="key smoothing: a few shapes, smoothed (per tile, per sequence) and not"
    )
    ap.add_argument(
        "--rules", action="store_true", help="the launch rules' shapes (1, 2, 4 warps, stacking): default launches"
    )
    ap.add_argument("--grid", action="store_true", help="presets and head dims x batch x context: default launches")
    ap.add_argument(
        "--intercept",
        nargs=4,
        metavar=("PRESET", "BATCH", "SPLITS", "WARPS"),
        help="fixed splits and warps, growing context: a call's intercept and the loop's cost a tile (D = 128)",
    )
    ap.add_argument(
        "--variants",
        nargs=3,
        metavar=("PRESET", "BATCH", "CONTEXT"),
        help="one shape (D = 128, 32/8 heads): the default launch and each knob flipped, against the reference",
    )
    args = ap.parse_args()
    modes = [m for m in ("smooth", "eager", "rules", "grid", "intercept", "variants") if getattr(args, m)]
    if len(modes) > 1:
        ap.error(f"pick one of --{', --'.join(modes)}")
    if args.intercept and not all(c.isdigit() and int(c) > 0 for c in args.intercept[1:]):
        ap.error("--intercept takes PRESET BATCH SPLITS WARPS, the last three positive integers")
    env = environment()
    if args.variants:
        preset, batch, ctx = args.variants
        variants_main(args.out, env, preset, int(batch), int(ctx))
        return
    copy_bw = copy_bandwidth()
    print(f"{env} copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    if args.smooth:
        smooth_main(args.out, env, copy_bw)
        return
    if args.eager:
        eager_main(args.out, env, copy_bw)
        return
    if args.intercept:
        preset, *counts = args.intercept
        intercept_main(args.out, env, copy_bw, preset, *map(int, counts))
        return
    if args.rules or args.grid:
        name = "rules" if args.rules else "grid"
        table_main(args.out, env, copy_bw, RULE_SHAPES if args.rules else GRID_SHAPES, name)
        return
    checks = correctness_suite(
        [
            ("kvarn_k4v2_g128", 128, torch.float16, 32, 8),
            ("kvarn_k4v2_g128", 128, torch.float16, 64, 8),
            ("kvarn_k4v2_g128", 128, torch.bfloat16, 32, 8),
            ("kvarn_k4v2_g128", 64, torch.float16, 32, 8),
            ("kvarn_k4v2_g128", 256, torch.float16, 32, 8),
            ("kvarn_k4v4_g128", 128, torch.float16, 32, 8),
            ("kvarn_k4v2_g64", 128, torch.float16, 32, 8),
            ("kvarn_k2v2_g128", 128, torch.float16, 32, 8),
        ]
    )
    sweep = []
    best, best_t = None, float("inf")
    for warps, stages in [(None, 2), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3)]:  # None: decode_shape_default's
        launch = {"num_warps": warps, "num_stages": stages}
        t = 0.0
        for batch, ctx in ((16, 32768), (64, 4096)):
            r = bench_shape("kvarn_k4v2_g128", 128, 32, 8, batch, ctx, torch.float16, copy_bw, launch, sdpa=False)
            t += r["kvarn_us"]
            sweep.append({"num_warps": warps, "num_stages": stages, **r})
            print(f"sweep warps={warps} stages={stages} B={batch} ctx={ctx}: {r['kvarn_us']:.1f} us", flush=True)
        if t < best_t:
            best, best_t = (warps, stages), t
    launch = {"num_warps": best[0], "num_stages": best[1]}
    print(f"using num_warps={best[0]} num_stages={best[1]}", flush=True)
    shapes = []
    if args.quick:
        grid = [(1024 * 32, 16), (1024 * 4, 64), (1024, 8)]
        heads = [(32, 8)]
    else:
        grid = [(c, b) for c in (1024, 4096, 16384, 32768, 131072) for b in (1, 8, 16, 32, 64)]
        heads = [(32, 8), (64, 8)]
    for hq, hkv in heads:
        for ctx, batch in grid:
            shapes.append(("kvarn_k4v2_g128", 128, hq, hkv, batch, ctx))
    for preset, d in [
        ("kvarn_k4v2_g128", 64),
        ("kvarn_k4v2_g128", 256),
        ("kvarn_k4v4_g128", 128),
        ("kvarn_k4v2_g64", 128),
        ("kvarn_k2v2_g128", 128),
    ]:
        shapes.append((preset, d, 32, 8, 16, 32768))
    rows = []
    print("| preset | D | Hq/Hkv | B | ctx | kvarn us | SDPA us | speedup | kvarn GB/s | % copy BW | SDPA GB/s |")
    for preset, d, hq, hkv, batch, ctx in shapes:
        r = bench_shape(preset, d, hq, hkv, batch, ctx, torch.float16, copy_bw, launch)
        torch.cuda.empty_cache()
        rows.append(r)
        print(
            f"| {preset} | {d} | {hq}/{hkv} | {batch} | {ctx} | {r['kvarn_us']:.1f} | {r['sdpa_us']:.1f} | "
            f"{r['speedup']:.2f}x | {r['kvarn_GBps']:.0f} | {r['kvarn_pct_copy']:.0f}% | {r['sdpa_GBps']:.0f} |",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(
            {
                "env": env,
                "copy_GBps": copy_bw,
                "checks": checks,
                "launch": {"num_warps": best[0], "num_stages": best[1]},
                "sweep": sweep,
                "rows": rows,
            },
            f,
            indent=1,
        )
    assert all(math.isfinite(r["kvarn_us"]) for r in rows)


KNOB_FLIPS = [
    ("tokens_m", False),
    ("tokens_m", True),
    ("fuse_merge", False),
    ("fuse_query", True),
    ("fuse_query", False),
    ("pair_tiles", False),
    ("stack_tiles", False),
    ("fold_offsets", False),
    ("num_splits", 1),
    ("min_split_tiles", 1),
    ("num_warps", 4),
]
"""``--variants``: the launch knobs set one at a time against the default launch."""


def variants_main(out: str, env: dict, preset: str, batch: int, ctx: int) -> None:
    """``--variants``: one shape's default launch and each knob of :data:`KNOB_FLIPS` against the reference (every
    row, three launches each, which must agree), to find which part of a launch a wrong result comes from. No
    timing."""
    cfg = KVarNConfig.from_preset(preset, head_dim=128)
    st = synthetic_cache(cfg, batch, ctx, 8, torch.float16, seed=batch * 7 + ctx)
    q = torch.randn(batch, 32, 128, device="cuda").to(torch.float16)
    ref = R.paged_attention(*args_of(st, q.float(), cfg))
    rows = []
    for name, value in [("default", None), *KNOB_FLIPS]:
        knobs = {} if value is None else {name: value}
        try:
            outs = [A.paged_attention(*args_of(st, q, cfg), **knobs).float() for _ in range(3)]
        except Exception as e:  # a knob a launch does not take (e.g. stacking off the tokens_m path)
            rows.append({"knobs": knobs, "error": f"{type(e).__name__}: {e}"})
            print(f"{knobs}: {type(e).__name__}: {e}", flush=True)
            continue
        err = ((outs[0] - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))).tolist()
        same = all(torch.equal(outs[0], o) for o in outs[1:])
        rows.append({"knobs": knobs, "max_rel_err": max(err), "rows_over_tol": sum(e > REL_TOL[q.dtype] for e in err)})
        rows[-1]["launches_agree"] = same
        print(f"{knobs or 'default'}: max rel err {max(err):.2e}, rows over tol {rows[-1]['rows_over_tol']}, "
              f"launches agree {same}", flush=True)  # fmt: skip
    with open(out, "w") as f:
        json.dump({"env": env, "preset": preset, "batch": batch, "ctx": ctx, "variants": rows}, f, indent=1)


def smooth_main(out: str, env: dict, copy_bw: float) -> None:
    """``--smooth``: the cost of key smoothing at the default launch: per tile (one query rotation per
    tile) and per sequence (one per program)."""
    presets = [("kvarn_k4v2_g128", 128), ("kvarn_k4v2_g128", 64), ("kvarn_k2v2_g128", 128)]
    checks = []
    for scope in ("tile", "sequence"):
        checks += correctness_suite([(p, d, torch.float16, 32, 8) for p, d in presets], smooth=scope)
    rows = []
    print(
        "| preset | D | B | ctx | kvarn us | per-tile smoothed us | per-sequence smoothed us | SDPA us | speedup | "
        "per-tile speedup | per-sequence speedup |"
    )
    for preset, d, batch, ctx in [
        ("kvarn_k4v2_g128", 128, 16, 32768),
        ("kvarn_k4v2_g128", 128, 64, 4096),
        ("kvarn_k4v2_g128", 128, 8, 1024),
        ("kvarn_k4v2_g128", 64, 16, 32768),
        ("kvarn_k2v2_g128", 128, 16, 32768),
    ]:
        plain = bench_shape(preset, d, 32, 8, batch, ctx, torch.float16, copy_bw, {})
        shape = (preset, d, 32, 8, batch, ctx, torch.float16, copy_bw, {})
        tile = bench_shape(*shape, sdpa=False, smooth="tile")["kvarn_us"]
        seq = bench_shape(*shape, sdpa=False, smooth="sequence")["kvarn_us"]
        torch.cuda.empty_cache()
        rows.append({**plain, "smoothed_us": tile, "seq_smoothed_us": seq})
        sd = plain["sdpa_us"]
        print(
            f"| {preset} | {d} | {batch} | {ctx} | {plain['kvarn_us']:.1f} | {tile:.1f} | {seq:.1f} | {sd:.1f} | "
            f"{plain['speedup']:.2f}x | {sd / tile:.2f}x | {sd / seq:.2f}x |",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump({"env": env, "copy_GBps": copy_bw, "checks": checks, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
