"""The paged-attention epilogue: merge the splits, leave the rotated frame, cast.

One launch after :mod:`kvarn.kernels.attention_decode` (launched by :mod:`kvarn.kernels.attention`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import NEG_BIG, STEP_COUNTS, rotate_rows, rotate_rows_split, split_tf32, store_model
from kvarn.kernels.attention_merge import _sink_logits, _with_sink


@triton.jit
def _merge_splits(part, ws_m, ws_l, rows, hmask, m2, num_splits, n_rows, D: tl.constexpr, z=None):
    """Log-sum-exp merge of the split partials of ``rows: [BLOCK_H]`` -> normalized ``[BLOCK_H, D]``; the rows' sink
    logits ``z: [BLOCK_H]`` (exp2 domain) join the summed denominator (``None``: none)."""
    BLOCK_H: tl.constexpr = rows.shape[0]
    dd = tl.arange(0, D)
    m_max = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    for sp in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(ws_m + sp * n_rows + rows, mask=hmask, other=NEG_BIG))
    den = tl.zeros([BLOCK_H], tl.float32)
    o = tl.zeros([BLOCK_H, D], tl.float32)
    for sp in range(num_splits):
        w = tl.exp2(tl.load(ws_m + sp * n_rows + rows, mask=hmask, other=NEG_BIG) - m_max)
        den += w * tl.load(ws_l + sp * n_rows + rows, mask=hmask, other=0.0)
        a = tl.load(part + (sp * n_rows + rows)[:, None] * D + dd[None, :], mask=m2, other=0.0)  # [BLOCK_H, D]
        o += a * w[:, None]
    if z is not None:
        o, den = _with_sink(o, den, m_max, z)
    return o / tl.where(den > 0.0, den, 1.0)[:, None]


@triton.jit(do_not_specialize=STEP_COUNTS)
def _epilogue_kernel(
    part,
    ws_m,
    ws_l,
    out,
    n_rows,
    num_splits,
    n_heads,
    s_o,
    s_oh,
    sink_logits,
    BLOCK_H: tl.constexpr,
    LAYOUT: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTATE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    HAS_SINK_LOGITS: tl.constexpr = False,
):
    """Grid ``(Nq,)``: merge the split partials (log-sum-exp), un-rotate, cast and store one query's heads.

    ``part: [splits, Nq, Hq, D]`` fp32 (normalized when ``SPLIT`` is off), ``ws_m, ws_l: [splits,
    Nq, Hq]``, ``out: [Nq, Hq, D]`` in the query dtype. Un-rotation runs as two tf32 dots with the
    +-1 Hadamard on ``hi + lo`` parts of ``o~`` (``hi`` exact in tf32, ``lo`` below 2^-11 of it),
    so it keeps ~22 bits. ``HAS_SINK_LOGITS``: ``sink_logits: [Hq]`` (raw, any float dtype) join the merge's
    denominator (:mod:`~kvarn.kernels.attention_merge`); one split's rows arrive with them already.
    """
    D: tl.constexpr = LAYOUT.D
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dd = tl.arange(0, D)
    rows = t * n_heads + heads
    m2 = hmask[:, None] & (dd[None, :] < D)
    if SPLIT:
        z = None
        if HAS_SINK_LOGITS:
            z = _sink_logits(sink_logits, heads, hmask)
        o = _merge_splits(part, ws_m, ws_l, rows, hmask, m2, num_splits, n_rows, D, z)
    else:
        o = tl.load(part + rows[:, None] * D + dd[None, :], mask=m2, other=0.0)  # [BLOCK_H, D]
    if ROTATE:
        HALF: tl.constexpr = D // 2
        if D > 128:
            o3 = tl.permute(tl.reshape(o, (BLOCK_H, 2, HALF)), (0, 2, 1))  # [BLOCK_H, HALF, 2]
            o1, o2 = tl.split(o3)
            h1, l1 = split_tf32(o1)
            h2, l2 = split_tf32(o2)
            o = rotate_rows_split(h1, h2, HALF, INV_SQRT_D) + rotate_rows_split(l1, l2, HALF, INV_SQRT_D)
        else:
            hi, lo = split_tf32(o)
            o = rotate_rows(hi, D, INV_SQRT_D) + rotate_rows(lo, D, INV_SQRT_D)
    dst = out + t * s_o + heads[:, None] * s_oh + dd[None, :]
    store_model(dst, o, m2, OUT_BF16)
