"""The tail pool's kernels: new tokens prepared into it, and tiles kept as block rows gathered into it.

``prepare`` (sanitize, rotate, round to the pool dtype: :func:`prepare_rows`) is the one definition of
the pool form in the kernels; :func:`kvarn.kernels.store.write_tail` launches it, and
:func:`kvarn.kernels.store.store_tiles` runs the same kernel before the encoder, so both paths hand
the encoder bit-identical tiles. The host side is :mod:`kvarn.kernels.store`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import (
    STEP_COUNTS,
    load_f32,
    pool_factor,
    rotate_rows,
    rotate_rows_split,
    round_to_dtype,
    sanitize,
    store_model,
)

PREPARE_ROWS = 64
"""(token, head) rows per program of the prepare kernel. Fixed: every path that prepares values
runs this kernel with this block, so the rotation's tensor-core arithmetic is the same for all."""


@triton.jit
def prepare_rows(
    src,
    ok,
    D: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    POOL_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Model-frame rows at ``src: [ROWS]`` (row pointers; ``ok`` masks them) -> their pool form ``[ROWS, D]``.

    Sanitize, rotate (tf32 dot; ``D > 128`` as two loaded halves), ``* 1 / pool_factor`` (exact
    scaling), round to the pool dtype: fp32 values of the pool dtype. The one definition of the pool
    form in the kernels: ``_prepare_kernel`` (``write_tail``) and ``pages._row_pages_kernel`` (a
    step's tokens read back as pages) both call it, with ``PREPARE_ROWS`` rows and 4 warps, so they
    round to the same bits.
    """
    HALF: tl.constexpr = D // 2
    if ROTATE and D > 128:
        ch = tl.arange(0, HALF)
        m2 = ok[:, None] & (ch[None, :] < HALF)
        x1 = sanitize(load_f32(src[:, None] + ch[None, :], m2, IN_BF16))
        x2 = sanitize(load_f32(src[:, None] + HALF + ch[None, :], m2, IN_BF16))
        x = rotate_rows_split(x1, x2, HALF, INV_SQRT_D)
    else:
        ch = tl.arange(0, D)
        x = sanitize(load_f32(src[:, None] + ch[None, :], ok[:, None] & (ch[None, :] < D), IN_BF16))
        if ROTATE:
            x = rotate_rows(x, D, INV_SQRT_D)
    return round_to_dtype(x * (1.0 / pool_factor(D, POOL_BF16)), POOL_BF16)


@triton.jit(do_not_specialize=STEP_COUNTS)
def _prepare_kernel(
    k,
    v,
    tail_k,
    tail_v,
    mapping,
    n_rows,
    n_heads,
    s_tok,
    s_head,
    p_slot,
    p_off,
    p_head,
    LAYOUT: tl.constexpr,
    ROWS: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    POOL_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
):
    """Grid ``(cdiv(T * Hkv, ROWS), 2)``: ``ROWS`` (token, head) rows of K (0) or V (1) -> ``prepare`` -> pool.

    ``mapping`` entries are ``slot * SLOT_ROWS + row`` (``SLOT_ROWS = G`` for a pool, a block's rows
    for tails in a cache's blocks)."""
    G: tl.constexpr = SLOT_ROWS
    D: tl.constexpr = LAYOUT.D
    which = tl.program_id(1)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = r < n_rows
    t = (r // n_heads).to(tl.int64)
    h = (r % n_heads).to(tl.int64)
    idx = tl.load(mapping + t, mask=in_range, other=-1).to(tl.int64)
    ok = in_range & (idx >= 0)
    slot = tl.where(ok, idx // G, 0)
    off = tl.where(ok, idx % G, 0)
    src = tl.where(which == 0, k, v) + t * s_tok + h * s_head  # [ROWS] row pointers
    dst = tl.where(which == 0, tail_k, tail_v) + slot * p_slot + off * p_off + h * p_head
    x = prepare_rows(src, ok, D, ROTATE, IN_BF16, POOL_BF16, INV_SQRT_D)
    ch_all = tl.arange(0, D)
    store_model(dst[:, None] + ch_all[None, :], x, ok[:, None] & (ch_all[None, :] < D), POOL_BF16)


GATHER_ROWS = 32
"""(token, head) rows per program of :func:`~kvarn.kernels.store.gather_tail_tiles`."""


@triton.jit
def _gather_tiles_kernel(
    rows_k,
    rows_v,
    tables,
    tail_k,
    tail_v,
    slots,
    n_heads,
    s_tab,
    r_blk,
    r_row,
    r_head,
    p_slot,
    p_tok,
    p_head,
    G: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Grid ``(N, cdiv(G * Hkv, ROWS), 2)``: ``ROWS`` (token, head) rows of K (0) or V (1) of entry ``i``'s
    tile, from row ``t % R`` of block ``tables[slot, t // R]`` to ``tail[slot, t]`` (a raw copy)."""
    slot = tl.load(slots + tl.program_id(0)).to(tl.int64)
    if slot >= 0:
        which = tl.program_id(2)
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        ok = r < G * n_heads
        t = (r // n_heads).to(tl.int64)
        h = (r % n_heads).to(tl.int64)
        blk = tl.load(tables + slot * s_tab + t // R, mask=ok, other=0).to(tl.int64)
        src = tl.where(which == 0, rows_k, rows_v) + blk * r_blk + (t % R) * r_row + h * r_head
        dst = tl.where(which == 0, tail_k, tail_v) + slot * p_slot + t * p_tok + h * p_head
        ch = tl.arange(0, D)
        x = tl.load(src[:, None] + ch[None, :], mask=ok[:, None])
        tl.store(dst[:, None] + ch[None, :], x, mask=ok[:, None])
