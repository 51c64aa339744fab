"""The kernel oracle: builders and checks that hold the Triton kernels to the reference (no tests here).

``test_kernels_{attention,store,dequant}.py`` run them on the CPU under ``TRITON_INTERPRET=1`` on tiny shapes,
``test_kernels_gpu.py`` on CUDA at full size, ``test_vllm_gpu.py`` through the vLLM backend. The
tolerances they assert, with their derivations, are in ``tolerances.py``.
"""

from __future__ import annotations

import math

import torch
from tolerances import (
    ATTN_COND_FACTOR,
    ATTN_REL,
    CLIP_PICK_MISMATCH_MAX,
    CODE_MISMATCH_MAX,
    COL_REL,
    PREPARE_ULP_FRACTION,
    QUALITY_ABS,
    QUALITY_REL,
    ROW_REL,
    TIE_WINDOW,
)

from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.reference.normalize import sinkhorn
from kvarn.reference.quantize import COL_DTYPE
from kvarn.reference.rtn import choose_qparams
from kvarn.reference.smooth import smooth


def poisoned_empty(*shape, dtype=torch.float32, device=None, **kw):
    """``torch.empty`` that fills floats with NaN and bytes with 0xAB, so unwritten outputs fail loudly.

    Kernels take it as their ``empty=`` allocator.
    """
    t = torch.empty(*shape, dtype=dtype, device=device, **kw)
    return t.fill_(0xAB) if dtype == torch.uint8 else t.fill_(float("nan"))


def make_kv(n: int, g: int, hkv: int, d: int, dtype: torch.dtype, seed: int, kind: str = "mixed") -> tuple:
    """Model-frame tiles ``k, v: [n, G, Hkv, D]``: Gaussian with outlier channels and scale spread."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, g, hkv, d, generator=gen)
    v = torch.randn(n, g, hkv, d, generator=gen)
    if kind == "mixed":
        k = k * (0.2 + 3 * torch.rand(1, 1, hkv, d, generator=gen)) + torch.randn(1, 1, hkv, d, generator=gen)
        k[..., 3] = k[..., 3] * 20 + 5
        v = v * (0.1 + torch.rand(1, g, hkv, 1, generator=gen))
    elif kind == "zero":
        k = torch.zeros_like(k)
        v = torch.zeros_like(v)
    elif kind == "constant":
        k = torch.full_like(k, 1.5)
        v = torch.full_like(v, -0.25)
    elif kind == "huge":
        k = k * 1e30
        v = v * 3e29
    elif kind == "tiny":
        k = k * 1e-6
        v = v * 1e-7
    return k.to(dtype), v.to(dtype)


def reference_q(m: torch.Tensor, bits: int, iters: int, clip: tuple[int, int] | None = None) -> torch.Tensor:
    """The reference's pre-rounding code values ``(B - lo) / step`` of oriented tile halves ``m``."""
    m = m.float()
    r, c = sinkhorn(m, iters)
    c = c.to(COL_DTYPE).float()
    b = m / (r[..., :, None] * c[..., None, :])
    lo, step = choose_qparams(b, bits, clip)
    return (b - lo[..., None]) / step[..., None]


def check_records(got: torch.Tensor, want: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: KVarNConfig) -> dict:
    """Assert kernel records ``got`` match reference records ``want`` of prepared tiles ``k, v: [..., G, D]``.

    ``k, v`` are in the pool form (as ``prepare`` gives them). Returns the measured statistics (fractions of
    differing codes, equal bytes).
    """
    assert got.shape == want.shape and got.dtype == torch.uint8
    got = got.to(want.device)
    gk, gv = R.unpack_record(got, cfg)
    wk, wv = R.unpack_record(want, cfg)
    stats = {"bytes_equal": float((got == want).float().mean())}
    k, v = R.from_pool(k.to(want.device)), R.from_pool(v.to(want.device))  # the values the pool form stands for
    k_quantized = k
    if cfg.smooth_keys:  # the smoothing vector is exact: both sides then quantize the same smoothed tile
        stats["k_smooth_equal"] = float((gk.smooth.view(torch.uint8) == wk.smooth.view(torch.uint8)).float().mean())
        assert stats["k_smooth_equal"] == 1.0, "k_smooth differs from the reference's"
        k_quantized = smooth(k, wk.smooth.float())
    halves = (
        ("k", gk, wk, k_quantized.transpose(-1, -2), cfg.k_bits, cfg.k_clip),
        ("v", gv, wv, v, cfg.v_bits, cfg.v_clip),
    )
    for name, g, w, m, bits, clip in halves:
        # Sinkhorn's scales have a gauge freedom: rows * a, columns / a give the same balanced tile.
        # Iterates on an imbalance plateau differ (to fp32 rounding) only in a; the best-iterate
        # rule may then take another one than the reference. Divide a out per tile half.
        assert (g.col.float() > 0).all() and torch.isfinite(g.col.float()).all()
        ratio = g.col.float() / w.col.float()
        gauge = ratio.median(dim=-1, keepdim=True).values
        stats[f"{name}_gauge_changed"] = float(((gauge - 1).abs() > COL_REL).float().mean())
        col_rel = float((ratio / gauge - 1).abs().max())
        assert col_rel <= COL_REL, f"{name} column scales differ by {col_rel:.2e} relative (gauge removed)"
        top = w.scale.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
        rel = {
            field: (getattr(g, field).float() * gauge - getattr(w, field).float()).abs()
            / torch.maximum(getattr(w, field).float().abs(), top)
            for field in ("scale", "zero")
        }
        for field in ("scale", "zero"):
            assert torch.isfinite(getattr(g, field).float()).all()
        rows = torch.ones_like(rel["scale"], dtype=torch.bool)  # rows held to the code and parameter checks
        if clip is not None:  # a near-tie between two shrinks may go either way (see CLIP_PICK_MISMATCH_MAX)
            rows = (rel["scale"] <= ROW_REL) & (rel["zero"] <= ROW_REL)
            stats[f"{name}_clip_pick_mismatch"] = float((~rows).float().mean())
            assert stats[f"{name}_clip_pick_mismatch"] <= CLIP_PICK_MISMATCH_MAX, (
                f"{name}: {stats[f'{name}_clip_pick_mismatch']:.4f} of rows picked another clipped range"
            )
        dcode = (g.codes.int() - w.codes.int()).abs() * rows[..., None]
        assert int(dcode.max()) <= 1, f"{name} codes differ by {int(dcode.max())} steps"
        frac = float((dcode > 0).float().mean())
        stats[f"{name}_code_mismatch"] = frac
        assert frac <= CODE_MISMATCH_MAX, f"{name}: {frac:.4f} of codes differ"
        if frac > 0:
            iters = cfg.sinkhorn_iters if cfg.normalize else 0
            q = reference_q(m.reshape(-1, *m.shape[-2:]), bits, iters, clip).reshape(dcode.shape)
            dist = ((q - q.floor()) - 0.5).abs()[dcode > 0]
            assert float(dist.max()) <= TIE_WINDOW, f"{name}: a differing code is {float(dist.max()):.3f} from a tie"
        for field in ("scale", "zero"):
            worst = float(rel[field][rows].max()) if bool(rows.any()) else 0.0
            assert worst <= ROW_REL, f"{name} {field} differs by {worst:.2e} relative (gauge removed)"
    kg, vg = R.decode_records(got, cfg)
    kw, vw = R.decode_records(want, cfg)
    for name, a, b, x in (("k", kg, kw, k), ("v", vg, vw, v)):
        assert torch.isfinite(a).all()
        x = x.float()
        err_got, err_want = float((a - x).norm()), float((b - x).norm())
        assert err_got <= (1 + QUALITY_REL) * err_want + QUALITY_ABS * float(x.norm()), (
            f"{name}: kernel reconstruction error {err_got:.4g} vs reference {err_want:.4g}"
        )
    return stats


def check_prepared(got: torch.Tensor, want: torch.Tensor) -> float:
    """Prepared values of the model dtype: equal except a bounded fraction one ulp apart. Returns that fraction."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(g).all()
    diff = g != w
    frac = float(diff.float().mean())
    if frac:
        ulp = torch.finfo(want.dtype).eps * w.abs().clamp_min(torch.finfo(want.dtype).tiny)
        assert bool(((g - w).abs() <= 1.01 * ulp)[diff].all()), "prepared values differ by more than one ulp"
    assert frac <= PREPARE_ULP_FRACTION, f"{frac:.4f} of prepared values differ"
    return frac


def build_cache(cfg: KVarNConfig, seq_lens: list[int], hkv: int, dtype: torch.dtype, seed: int, device="cpu") -> dict:
    """A paged cache holding random sequences, stored with the reference.

    Block ids are a random permutation that never uses block 0; each sequence gets a tail slot
    (random values: the kernel and the reference read the same slot for the own tile) and every
    other sequence a sink slot.
    """
    gen = torch.Generator().manual_seed(seed)
    g, d = cfg.group_size, cfg.head_dim
    n_full = [s // g for s in seq_lens]
    num_blocks = sum(n_full) + 2
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    max_blocks = max(n_full) + 1
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    cache = torch.zeros(num_blocks, hkv, cfg.record_bytes, dtype=torch.uint8, device=device)
    nslots = 2 * len(seq_lens) + 1
    tail_k = torch.empty(nslots, g, hkv, d, dtype=dtype).normal_(generator=gen)
    tail_v = torch.empty(nslots, g, hkv, d, dtype=dtype).normal_(generator=gen)
    slot_perm = torch.randperm(nslots, generator=gen)
    tail_slots = slot_perm[: len(seq_lens)].to(torch.int32)
    sink_slots = torch.full((len(seq_lens),), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_full):
        ids = perm[i : i + n]
        i += n
        block_table[b, :n] = ids.to(torch.int32)
        if cfg.seq_smooth:  # entries past a sequence's tiles are never read, not even entry 0 of a short one
            block_table[b, n:] = POISON_BLOCK
        if n:
            k, v = make_kv(n, g, hkv, d, dtype, seed * 1000 + b)
            src = ids[:1].expand(n).to(device) if cfg.seq_smooth else None  # the sequence's first block
            R.store_tiles(k.to(device), v.to(device), ids.to(device), cache, cfg, src)
        if b % 2 == 0:
            sink_slots[b] = int(slot_perm[len(seq_lens) + b // 2])
    out = {
        "cache": cache,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "tail_k": tail_k,
        "tail_v": tail_v,
        "tail_slots": tail_slots,
        "sink_slots": sink_slots,
    }
    return {k: t.to(device) for k, t in out.items()}


def with_block_tails(state: dict, cfg: KVarNConfig, seed: int) -> dict:
    """``state`` (:func:`build_cache`) with each sequence's own tile moved from its tail slot into rows of
    blocks appended to the cache, as tails in vLLM's blocks keep them (``kvarn.paged.PagedKV.tail_block_view``,
    ``kvarn.paged.tail_geometry``'s rows): ``tail_k, tail_v`` the block views, ``tail_slots`` ``[B, N]`` int32
    tables of distinct random blocks. Every other byte of the new blocks is random (NaN/inf patterns
    included), the rows past each own tile's tokens too, so a read of one shows."""
    from kvarn.paged import PagedKV, tail_geometry

    gen = torch.Generator().manual_seed(seed)
    cache, tail_k = state["cache"], state["tail_k"]
    rows, n = tail_geometry(cfg, tail_k.element_size())
    batch, g = state["seq_lens"].shape[0], cfg.group_size
    extra = torch.randint(0, 256, (batch * n + 3, *cache.shape[1:]), dtype=torch.uint8, generator=gen)
    cache = torch.cat([cache, extra.to(cache.device)])
    ids = torch.randperm(batch * n + 3, generator=gen)[: batch * n] + state["cache"].shape[0]
    tables = ids.view(batch, n).to(torch.int32).to(cache.device)
    view_k, view_v = PagedKV(cfg, cache, tail_k, state["tail_v"]).tail_block_view(rows)
    own = state["tail_slots"].long()
    for b, n in enumerate(state["seq_lens"].tolist()):  # the own tile's tokens only: its other rows stay random
        j = torch.arange((n - 1) % g + 1 if n else 0, device=cache.device)
        view_k[tables[b, j // rows].long(), j % rows] = tail_k[own[b], j]
        view_v[tables[b, j // rows].long(), j % rows] = state["tail_v"][own[b], j]
    return {**state, "cache": cache, "tail_k": view_k, "tail_v": view_v, "tail_slots": tables}


POISON_BLOCK = 2**30
"""Block id in the unused block table entries of per-sequence smoothed caches: a kernel that reads one faults."""


def attention_args(state: dict, query: torch.Tensor, cfg: KVarNConfig, qsl=None, sink=False, step_kv=None) -> tuple:
    """``paged_attention``'s positional arguments, the reference's and the kernel's alike.

    ``step_kv`` (default: with ``qsl``): pass the step's own ``key, value``, random model-frame
    ``[Nq, Hkv, D]`` in the query dtype (seeded by the shape); else the step's tokens are read
    from the tail slot.
    """
    kv = (None, None)
    if qsl is not None if step_kv is None else step_kv:
        nq, _, d = query.shape
        hkv = state["cache"].shape[1]
        gen = torch.Generator().manual_seed(nq * 131 + hkv * 7 + d)
        k = torch.randn(nq, hkv, d, generator=gen)
        v = torch.randn(nq, hkv, d, generator=gen) * (0.1 + torch.rand(nq, 1, 1, generator=gen))
        kv = (k.to(query.dtype).to(query.device), v.to(query.dtype).to(query.device))
    return (
        query,
        state["cache"],
        state["block_table"],
        state["seq_lens"],
        state["tail_k"],
        state["tail_v"],
        state["tail_slots"],
        cfg,
        qsl,
        state["sink_slots"] if sink else None,
        None,
        *kv,
    )


def poison_before_window(args: tuple, window: int | None) -> tuple:
    """``args`` (:func:`attention_args`) with what a sliding ``window`` leaves unread made unreadable.

    Each sequence's block-table entries before the tile of its first query's first key point at a block
    appended to the cache, all 0xFF bytes (NaN scales), and a sink slot whose tile 0 that window has left at
    a pool slot appended full of NaN. A kernel that reads either returns NaN, even where it masks the scores:
    the NaN values then meet zero probabilities. The reference reads neither, so it is unchanged.
    """
    query, cache, table, lens, tail_k, tail_v, slots, cfg, qsl, sinks, *rest = args
    if window is None:
        return args
    g = cfg.group_size
    n_q = torch.ones_like(lens) if qsl is None else (qsl[1:] - qsl[:-1]).to(lens.device)
    seen = ((lens - n_q - window + 1).clamp(min=0) // g).tolist()  # each sequence's first tile in a window
    bad = torch.full((1, *cache.shape[1:]), 0xFF, dtype=torch.uint8, device=cache.device)
    table = table.clone()
    for b, t in enumerate(seen):
        table[b, :t] = cache.shape[0]
    cache = torch.cat([cache, bad])
    if sinks is not None:
        left = torch.tensor([t > 0 for t in seen], device=sinks.device)
        sinks = torch.where(left & (sinks >= 0), tail_k.shape[0], sinks).to(sinks.dtype)
        tail_k, tail_v = (torch.cat([t, torch.full_like(t[:1], float("nan"))]) for t in (tail_k, tail_v))
    return (query, cache, table, lens, tail_k, tail_v, slots, cfg, qsl, sinks, *rest)


def query_sensitivity(args: tuple, trials: int = 2, seed: int = 0, **attn) -> float:
    """How far the fp32 reference moves (relative to max |ref|) when each query element is
    perturbed by up to one unit roundoff of the query dtype; the largest of ``trials`` draws.
    ``attn``: the reference's ``window`` and ``sink_logits``."""
    query = args[0]
    ref = R.paged_attention(query.float(), *args[1:], **attn)
    scale = float(ref.abs().max()) or 1.0
    u = torch.finfo(query.dtype).eps / 2
    gen = torch.Generator(device=query.device).manual_seed(seed)
    worst = 0.0
    for _ in range(trials):
        noise = torch.rand(query.shape, generator=gen, device=query.device) * 2 - 1
        moved = R.paged_attention(query.float() * (1 + u * noise), *args[1:], **attn)
        worst = max(worst, float((moved - ref).abs().max()) / scale)
    return worst


def check_attention(out: torch.Tensor, args: tuple, conditioned: bool = False, **attn) -> float:
    """Assert ``out`` (kernel) matches the reference computed in fp32; returns the relative max error.

    ``conditioned``: the tolerance grows with the problem's sensitivity to a one-ulp query
    perturbation (``tolerances.ATTN_COND_FACTOR``), for deliberately ill-conditioned inputs.
    ``attn``: the call's ``window`` and ``sink_logits``, passed to the reference.
    """
    query = args[0]
    ref = R.paged_attention(query.float(), *args[1:], **attn)
    assert out.dtype == query.dtype and out.shape == query.shape
    o = out.float()
    assert torch.isfinite(o).all(), "attention output holds NaN/inf (an unwritten element?)"
    scale = float(ref.abs().max()) or 1.0
    err = float((o - ref).abs().max()) / scale
    tol = ATTN_REL[query.dtype]
    if conditioned:
        tol = max(tol, ATTN_COND_FACTOR * query_sensitivity(args, **attn))
    assert err <= tol, f"attention differs from the reference by {err:.2e} (relative to max |ref|; tolerance {tol:.2e})"
    return err


def ragged_lengths(g: int, n: int, seed: int, max_tiles: int = 3) -> list[int]:
    """``n`` sequence lengths covering every tail length ``0 .. G-1`` in turn, with 0..max_tiles full tiles."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rem = i % g
        tiles = int(torch.randint(0 if rem else 1, max_tiles + 1, (1,), generator=gen))
        out.append(tiles * g + rem)
    return out


def expect_math_constants(kernels_common) -> None:
    """The kernels' copies of the method's constants equal the reference's."""
    from kvarn.reference import normalize, quantize, rtn
    from kvarn.reference import smooth as smooth_mod

    pairs = {
        "SMOOTH_MIN": smooth_mod.SMOOTH_MIN,
        "SMOOTH_EXP": smooth_mod.SMOOTH_EXP,
        "SEQ_SMOOTH_SKIP": smooth_mod.SEQ_SMOOTH_SKIP,
        "STD_MIN": normalize.STD_MIN,
        "STD_MAX": normalize.STD_MAX,
        "LOG_SCALE_MIN": normalize.LOG_SCALE_MIN,
        "LOG_SCALE_MAX": normalize.LOG_SCALE_MAX,
        "IMBALANCE_EPS": normalize.IMBALANCE_EPS,
        "MIN_STEP": rtn.MIN_STEP,
        "MAX_ABS": quantize.MAX_ABS,
        "ROW_EXP_LO": quantize.ROW_PARAM_RANGE[0],
        "ROW_EXP_HI": quantize.ROW_PARAM_RANGE[1],
    }
    for name, want in pairs.items():
        got = getattr(kernels_common, name)
        got = getattr(got, "value", got)
        assert math.isclose(got, want, rel_tol=0, abs_tol=0), f"{name}: kernels {got} != reference {want}"


DECODE_VARIANTS = {
    # id: knobs of a decode launch (each a variant the launch rules can pick)
    "rows": {"tokens_m": False, "num_splits": 2},
    "rows_pair": {"tokens_m": False, "pair_tiles": True, "num_splits": 3},
    "rows_fold_one_split": {"tokens_m": False, "fold_offsets": True, "num_splits": 1},
    "tokens_m_fold": {"tokens_m": True, "fold_offsets": True, "num_splits": 2},
    "tokens_m_pair": {"tokens_m": True, "pair_tiles": True, "num_splits": 1},
    "stack": {"tokens_m": True, "stack_tiles": True, "num_splits": 2},
    "one_warp": {"tokens_m": True, "num_warps": 1, "num_splits": 3},
    "prologue": {"fuse_query": False, "num_splits": 2},
    "epilogue": {"fuse_merge": False, "num_splits": 3},
    "epilogue_one_split": {"fuse_merge": False, "num_splits": 1},
    "prologue_epilogue_tokens_m": {"fuse_query": False, "fuse_merge": False, "tokens_m": True, "num_splits": 2},
    "min_split_tiles": {"tokens_m": True, "num_splits": 4, "min_split_tiles": 2},
}
"""Knobs of ``attention.paged_attention`` for one decode token a sequence: each a variant the launch rules can pick."""


MULTI_QUERY_VARIANTS = {
    "one_split": {"num_splits": 1},
    "splits_pair_fold": {"num_splits": 3, "pair_tiles": True, "fold_offsets": True},
    "prologue_epilogue": {"num_splits": 2, "fuse_query": False, "fuse_merge": False},
    "epilogue_one_split": {"num_splits": 1, "fuse_merge": False},
}
"""Knobs of ``attention.paged_attention`` for prompt chunks (several queries a sequence)."""
