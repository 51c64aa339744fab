"""The walk over a split's quantized tiles: the online softmax of a paged-attention program.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_decode` (Triton inlines them). Three
forms: the query rows as the dots' M (:func:`_quantized_tiles`, multi-query and decode), the tokens
as M (:func:`_quantized_tiles_t`, ``TOKENS_M`` decode) and two tiles a step stacked on M
(:func:`_quantized_tiles_st`, ``STACK``); :func:`_record_tiles` picks one. Each tile's scores and
values are :mod:`kvarn.kernels.attention_tiles`; its scales are read a step ahead
(:func:`_ahead_start`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import NEG_BIG
from kvarn.kernels.attention_query import _model_query, _smoothed_query
from kvarn.kernels.attention_tiles import (
    _causal,
    _in_window,
    _in_window_t,
    _key_side,
    _tile_scores,
    _tile_scores_st,
    _tile_scores_t,
    _tile_values,
    _tile_values_st,
    _tile_values_t,
    _value_side,
    _value_side_st,
)


@triton.jit
def _ahead_start(base, s_cb, bt_row, u0, u1, STEP: tl.constexpr, LAYOUT: tl.constexpr):
    """What a walk over tiles ``u0, u0 + STEP, .. < u1`` reads before its first step: tile ``u0``'s record
    (``base`` plus its block's offset), K and V scales (:func:`_key_side`, :func:`_value_side`), and the
    block id of tile ``u0 + STEP``. An empty walk (``u0 >= u1``) reads nothing.

    Each step then reads ahead (:func:`_ahead_step`, and the next tile's :func:`_value_side` after its
    value step), so no step waits on global memory for its tile's scales: they were 16-bit loads, too
    narrow for Triton's ``cp.async`` pipeline, and read in the step that used them they cost four
    round trips a tile. The codes are prefetched by the pipeline.
    """
    walk = u0 < u1
    rec = base + tl.load(bt_row + u0, mask=walk, other=0).to(tl.int64) * s_cb
    blk = tl.load(bt_row + tl.minimum(u0 + STEP, u1 - 1), mask=walk, other=0)
    return rec, blk, _key_side(rec, LAYOUT, walk), _value_side(rec, LAYOUT, walk)


@triton.jit
def _ahead_step(base, s_cb, bt_row, u, u1, blk, STEP: tl.constexpr, LAYOUT: tl.constexpr):
    """Step ``u``'s reads for the steps after it: the next tile's record (from block id ``blk``, read the
    step before) and K scales, and the block id of the tile after that: ``(rec, blk, key_side)``."""
    rec = base + blk.to(tl.int64) * s_cb
    return rec, tl.load(bt_row + tl.minimum(u + 2 * STEP, u1 - 1)), _key_side(rec, LAYOUT)


@triton.jit
def _quantized_tiles(
    query,
    records,
    bt_row,
    u0,
    u1,
    pos_q,
    LAYOUT: tl.constexpr,
    MULTI_Q: tl.constexpr,
    USE_ASM: tl.constexpr,
    PAIR,
    q_model=None,
    FOLD: tl.constexpr = False,
    win_lo=None,
):
    """Online softmax over the quantized tiles ``u0 .. u1 - 1`` of one sequence.

    ``query`` as returned by :func:`~kvarn.kernels.attention_query._load_query`; with smoothed records ``q_model`` (the
    :func:`_model_query` rows) gives each tile its own score query (:func:`_smoothed_query`)
    instead. ``records = (cache, block_stride, head_stride,
    kv_head)``; ``bt_row`` points at the sequence's block table row. Returns the running max
    ``m_i``, the sum ``l_i`` (``[BLOCK_M]``) and the unnormalized output ``acc: [BLOCK_M, D]``
    (rotated frame). With ``PAIR`` (constexpr) each step takes two tiles (one softmax step for
    both, two independent score chains); an odd last tile is read twice, the copy masked out.
    ``FOLD``: the K codes are unpacked without removing their offsets, which leave the zero-point
    term instead (:func:`_tile_scores`; V codes are always centered). ``win_lo: [BLOCK_M]`` (a sliding
    window) masks each row's keys before it; ``None``: no window.
    """
    BLOCK_M: tl.constexpr = query[4].shape[0]
    G: tl.constexpr = LAYOUT.G
    D: tl.constexpr = LAYOUT.D
    cache, s_cb, s_ch, kvh = records
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_e = tl.zeros([BLOCK_M, G // 2], tl.float32)  # per token pair, summed at the end
    acc_e = tl.zeros([BLOCK_M, D // 2], tl.float32)  # even output channels
    acc_o = tl.zeros([BLOCK_M, D // 2], tl.float32)  # odd output channels
    STEP: tl.constexpr = 2 if PAIR else 1
    base = cache + kvh.to(tl.int64) * s_ch
    rec_n, blk_nn, kside_n, side_n = _ahead_start(base, s_cb, bt_row, u0, u1, STEP, LAYOUT)
    for u in range(u0, u1, STEP):  # PAIR's second tile reads its own scales
        rec, kside, side = rec_n, kside_n, side_n
        rec_n, blk_nn, kside_n = _ahead_step(base, s_cb, bt_row, u, u1, blk_nn, STEP, LAYOUT)
        q_u = query if q_model is None else _smoothed_query(rec, q_model, LAYOUT)
        rf = q_u[4]  # [BLOCK_M], > 0: the scores' power of two, applied in the exponent
        s_e, s_o = _tile_scores(rec, q_u, LAYOUT, USE_ASM, FOLD, kside)  # [BLOCK_M, G // 2] each, / rf
        if MULTI_Q:
            s_e, s_o = _causal(s_e, s_o, pos_q, u * G, G // 2)
        if win_lo is not None:
            s_e, s_o = _in_window(s_e, s_o, win_lo, u * G, G // 2)
        m_new = tl.maximum(m_i, rf * tl.max(tl.maximum(s_e, s_o), axis=1))
        if PAIR:
            rec2 = cache + tl.load(bt_row + tl.minimum(u + 1, u1 - 1)).to(tl.int64) * s_cb + kvh.to(tl.int64) * s_ch
            q2 = query if q_model is None else _smoothed_query(rec2, q_model, LAYOUT)
            rf2 = q2[4]
            s2_e, s2_o = _tile_scores(rec2, q2, LAYOUT, USE_ASM, FOLD)
            if MULTI_Q:
                s2_e, s2_o = _causal(s2_e, s2_o, pos_q, (u + 1) * G, G // 2)
            if win_lo is not None:
                s2_e, s2_o = _in_window(s2_e, s2_o, win_lo, (u + 1) * G, G // 2)
            s2_e = tl.where(u + 1 < u1, s2_e, float("-inf"))
            s2_o = tl.where(u + 1 < u1, s2_o, float("-inf"))
            m_new = tl.maximum(m_new, rf2 * tl.max(tl.maximum(s2_e, s2_o), axis=1))
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e * rf[:, None] - m_new[:, None])
        p_o = tl.exp2(s_o * rf[:, None] - m_new[:, None])
        l_e = l_e * alpha[:, None] + (p_e + p_o)
        acc_e, acc_o = _tile_values(rec, p_e, p_o, alpha, acc_e, acc_o, LAYOUT, USE_ASM, side)
        side_n = _value_side(rec_n, LAYOUT)
        if PAIR:
            p2_e = tl.exp2(s2_e * rf2[:, None] - m_new[:, None])
            p2_o = tl.exp2(s2_o * rf2[:, None] - m_new[:, None])
            l_e += p2_e + p2_o
            acc_e, acc_o = _tile_values(rec2, p2_e, p2_o, None, acc_e, acc_o, LAYOUT, USE_ASM)
        m_i = m_new
    l_i = tl.sum(l_e, axis=1)
    acc = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_M, D))
    return m_i, l_i, acc


@triton.jit
def _transposed(query):
    """:func:`~kvarn.kernels.attention_query._load_query`'s ``(q0, q1, q2, q3, rf)`` with the channel blocks transposed
    to ``[DK, N]``."""
    q0, q1, q2, q3, rf = query
    return tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3), rf


@triton.jit
def _quantized_tiles_t(
    query,
    records,
    bt_row,
    u0,
    u1,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    PAIR,
    FOLD: tl.constexpr = False,
    win_lo=None,
):
    """:func:`_quantized_tiles` with the tokens as the M of both dots (decode only, no causal mask).

    The score dot is ``codes^T @ (q k_scale)^T: [G // 2, N]`` and the value dot ``V^T @ p: [D // 2, N]``,
    so the ``N = BLOCK_M`` query rows (the heads of one KV head) are the MMA's columns: the
    per-token and per-channel work runs on ``G x N`` and ``D x N`` blocks, not on 16 padded rows.
    Same returns as :func:`_quantized_tiles`. ``FOLD``: the K codes are unpacked without removing
    their offsets, which leave the zero-point term instead (:func:`_tile_scores_t`). ``win_lo: [N]``: as in
    :func:`_quantized_tiles`.
    """
    query_t = _transposed(query)  # [DK, N] each
    rf = query_t[4]  # [N], > 0: the scores' power of two, applied in the exponent
    N: tl.constexpr = rf.shape[0]
    G: tl.constexpr = LAYOUT.G
    D: tl.constexpr = LAYOUT.D
    cache, s_cb, s_ch, kvh = records
    m_i = tl.full([N], NEG_BIG, tl.float32)
    l_e = tl.zeros([G // 2, N], tl.float32)
    acc_e = tl.zeros([D // 2, N], tl.float32)  # even output channels
    acc_o = tl.zeros([D // 2, N], tl.float32)
    STEP: tl.constexpr = 2 if PAIR else 1
    base = cache + kvh.to(tl.int64) * s_ch
    rec_n, blk_nn, kside_n, side_n = _ahead_start(base, s_cb, bt_row, u0, u1, STEP, LAYOUT)
    for u in range(u0, u1, STEP):  # PAIR's second tile reads its own scales
        rec, kside, side = rec_n, kside_n, side_n
        rec_n, blk_nn, kside_n = _ahead_step(base, s_cb, bt_row, u, u1, blk_nn, STEP, LAYOUT)
        s_e, s_o = _tile_scores_t(rec, query_t, LAYOUT, USE_ASM, FOLD, kside)  # [G // 2, N] each, / rf
        if win_lo is not None:
            s_e, s_o = _in_window_t(s_e, s_o, win_lo, u * G, G // 2)
        m_new = tl.maximum(m_i, rf * tl.max(tl.maximum(s_e, s_o), axis=0))
        if PAIR:
            rec2 = cache + tl.load(bt_row + tl.minimum(u + 1, u1 - 1)).to(tl.int64) * s_cb + kvh.to(tl.int64) * s_ch
            s2_e, s2_o = _tile_scores_t(rec2, query_t, LAYOUT, USE_ASM, FOLD)
            if win_lo is not None:
                s2_e, s2_o = _in_window_t(s2_e, s2_o, win_lo, (u + 1) * G, G // 2)
            s2_e = tl.where(u + 1 < u1, s2_e, float("-inf"))
            s2_o = tl.where(u + 1 < u1, s2_o, float("-inf"))
            m_new = tl.maximum(m_new, rf * tl.max(tl.maximum(s2_e, s2_o), axis=0))
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e * rf[None, :] - m_new[None, :])
        p_o = tl.exp2(s_o * rf[None, :] - m_new[None, :])
        l_e = l_e * alpha[None, :] + (p_e + p_o)
        acc_e, acc_o = _tile_values_t(rec, p_e, p_o, alpha, acc_e, acc_o, LAYOUT, USE_ASM, side)
        side_n = _value_side(rec_n, LAYOUT)
        if PAIR:
            p2_e = tl.exp2(s2_e * rf[None, :] - m_new[None, :])
            p2_o = tl.exp2(s2_o * rf[None, :] - m_new[None, :])
            l_e += p2_e + p2_o
            acc_e, acc_o = _tile_values_t(rec2, p2_e, p2_o, None, acc_e, acc_o, LAYOUT, USE_ASM)
        m_i = m_new
    l_i = tl.sum(l_e, axis=0)
    acc = tl.reshape(tl.permute(tl.join(acc_e, acc_o), (1, 0, 2)), (N, D))  # [N, D // 2, 2] -> [N, D]
    return m_i, l_i, acc


@triton.jit
def _quantized_tiles_st(
    query,
    records,
    bt_row,
    u0,
    u1,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    GQP: tl.constexpr,
    FOLD: tl.constexpr,
    win_lo=None,
):
    """:func:`_quantized_tiles_t` with two tiles a step stacked on the dots' M (``STACK``, decode only).

    Column ``c`` of the ``N`` query rows walks the even tiles of the split (``u0, u0 + 2, ..``) where
    ``(c // GQP) % 2 == 0``, the odd ones otherwise: the caller loads rows ``GQP .. 2 GQP - 1`` with
    the same queries as rows ``0 .. GQP - 1`` (``2 GQP <= N``). One step scores and weighs both tiles
    in one dot each (:func:`_tile_scores_st`, :func:`_tile_values_st`); at the end each row's two
    running states merge into the first copy (:func:`_merge_stacked`), the second left empty.
    Same returns as :func:`_quantized_tiles_t`; ``win_lo: [N]``: as in :func:`_quantized_tiles`.
    """
    query_t = _transposed(query)  # [DK, N] each
    rf = query_t[4]  # [N], > 0: the scores' power of two, applied in the exponent
    N: tl.constexpr = rf.shape[0]
    G: tl.constexpr = LAYOUT.G
    D: tl.constexpr = LAYOUT.D
    cache, s_cb, s_ch, kvh = records
    base = cache + kvh.to(tl.int64) * s_ch
    second = (tl.arange(0, N) // GQP) % 2 == 1
    m_i = tl.full([N], NEG_BIG, tl.float32)
    l_e = tl.zeros([G, N], tl.float32)
    acc = (tl.zeros([D // 2, N], tl.float32), tl.zeros([D // 2, N], tl.float32))  # even, odd output channels
    walk = u0 < u1  # an empty split reads nothing
    off_an = tl.load(bt_row + u0, mask=walk, other=0).to(tl.int64) * s_cb
    off_bn = tl.load(bt_row + tl.minimum(u0 + 1, u1 - 1), mask=walk, other=0).to(tl.int64) * s_cb
    blk_an = tl.load(bt_row + tl.minimum(u0 + 2, u1 - 1), mask=walk, other=0)
    blk_bn = tl.load(bt_row + tl.minimum(u0 + 3, u1 - 1), mask=walk, other=0)
    kside_an = _key_side(base + off_an, LAYOUT, walk)
    kside_bn = _key_side(base + off_bn, LAYOUT, walk)
    vside_n = _value_side_st(base, off_an, off_bn, LAYOUT, walk)
    for u in range(u0, u1, 2):
        # as _ahead_start / _ahead_step for two tiles a step: the scales a step ahead, the block ids two
        off_a = off_an
        off_b = off_bn
        kside_a = kside_an
        kside_b = kside_bn
        vside = vside_n
        off_an = blk_an.to(tl.int64) * s_cb
        off_bn = blk_bn.to(tl.int64) * s_cb
        blk_an = tl.load(bt_row + tl.minimum(u + 4, u1 - 1))
        blk_bn = tl.load(bt_row + tl.minimum(u + 5, u1 - 1))
        kside_an = _key_side(base + off_an, LAYOUT)
        kside_bn = _key_side(base + off_bn, LAYOUT)
        s_e, s_o = _tile_scores_st(
            base, off_a, off_b, u + 1 < u1, query_t, second, LAYOUT, USE_ASM, FOLD, kside_a, kside_b
        )
        if win_lo is not None:  # tile a's token pairs, then tile b's: positions u * G ..
            s_e, s_o = _in_window_t(s_e, s_o, win_lo, u * G, G)
        m_new = tl.maximum(m_i, rf * tl.max(tl.maximum(s_e, s_o), axis=0))  # the scores are / rf
        alpha = tl.exp2(m_i - m_new)
        p_e = tl.exp2(s_e * rf[None, :] - m_new[None, :])
        p_o = tl.exp2(s_o * rf[None, :] - m_new[None, :])
        l_e = l_e * alpha[None, :] + (p_e + p_o)
        acc = _tile_values_st(base, off_a, off_b, p_e, p_o, alpha, acc, second, LAYOUT, USE_ASM, vside)
        vside_n = _value_side_st(base, off_an, off_bn, LAYOUT)
        m_i = m_new
    acc_e, acc_o = acc
    acc = tl.reshape(tl.permute(tl.join(acc_e, acc_o), (1, 0, 2)), (N, D))
    return _merge_stacked(m_i, tl.sum(l_e, axis=0), acc, GQP)


@triton.jit
def _merge_stacked(m_i, l_i, acc, GQP: tl.constexpr):
    """Merge the online-softmax states of rows ``c`` and ``c + GQP`` of each ``2 GQP`` rows into row ``c``.

    ``m_i, l_i: [N]``, ``acc: [N, D]``; rows ``c + GQP`` come back empty (``NEG_BIG``, 0, 0).
    """
    N: tl.constexpr = m_i.shape[0]
    D: tl.constexpr = acc.shape[1]
    P: tl.constexpr = N // (2 * GQP)
    m_a, m_b = tl.split(tl.permute(tl.reshape(m_i, (P, 2, GQP)), (0, 2, 1)))  # [P, GQP]
    l_a, l_b = tl.split(tl.permute(tl.reshape(l_i, (P, 2, GQP)), (0, 2, 1)))
    a_a, a_b = tl.split(tl.permute(tl.reshape(acc, (P, 2, GQP, D)), (0, 2, 3, 1)))  # [P, GQP, D]
    m = tl.maximum(m_a, m_b)
    f_a = tl.exp2(m_a - m)
    f_b = tl.exp2(m_b - m)
    l_m = l_a * f_a + l_b * f_b
    a_m = a_a * f_a[:, :, None] + a_b * f_b[:, :, None]
    m_out = tl.reshape(tl.permute(tl.join(m, tl.full([P, GQP], NEG_BIG, tl.float32)), (0, 2, 1)), (N,))
    l_out = tl.reshape(tl.permute(tl.join(l_m, tl.zeros([P, GQP], tl.float32)), (0, 2, 1)), (N,))
    a_out = tl.reshape(tl.permute(tl.join(a_m, tl.zeros([P, GQP, D], tl.float32)), (0, 3, 1, 2)), (N, D))
    return m_out, l_out, a_out


@triton.jit
def _record_tiles(
    query,
    walk,
    q_base,
    row_ok,
    LAYOUT: tl.constexpr,
    MULTI_Q: tl.constexpr,
    USE_ASM: tl.constexpr,
    PAIR: tl.constexpr,
    TOKENS_M: tl.constexpr,
    FUSED_Q: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
    FOLD: tl.constexpr,
    STACK: tl.constexpr = False,
    GQP: tl.constexpr = 1,
    win_lo=None,
):
    """The program's quantized tiles: :func:`_quantized_tiles_t` with ``TOKENS_M`` (:func:`_quantized_tiles_st`
    with ``STACK`` too), else :func:`_quantized_tiles`.

    ``walk = (records, bt_row, u0, u1, pos_q)``; ``FOLD`` as in :func:`_quantized_tiles`; the raw queries at ``q_base``
    (rows ``row_ok``) are read for per-tile smoothed records (``LAYOUT.K_SMOOTH >= 0``, which need ``FUSED_Q`` and not
    ``TOKENS_M``); for ``SEQ_SMOOTH`` records ``query`` is already the sequence's
    (:func:`~kvarn.kernels.attention_query._sequence_query`). ``win_lo``: each row's first key in its sliding
    window, or ``None`` (:func:`_quantized_tiles`).
    """
    records, bt_row, u0, u1, pos_q = walk
    if TOKENS_M:
        if not LAYOUT.SEQ_SMOOTH:
            tl.static_assert(LAYOUT.K_SMOOTH < 0, "per-tile smoothed records are not implemented with TOKENS_M")
        if STACK:
            tl.static_assert(not MULTI_Q and 2 * GQP <= query[4].shape[0], "STACK: decode, 2 GQP <= BLOCK_M")
            out = _quantized_tiles_st(query, records, bt_row, u0, u1, LAYOUT, USE_ASM, GQP, FOLD, win_lo)
        else:
            out = _quantized_tiles_t(query, records, bt_row, u0, u1, LAYOUT, USE_ASM, PAIR, FOLD, win_lo)
    elif LAYOUT.SEQ_SMOOTH:  # query: the sequence's smoothed queries (_sequence_query)
        out = _quantized_tiles(
            query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, None, FOLD, win_lo
        )
    elif LAYOUT.K_SMOOTH >= 0:
        tl.static_assert(FUSED_Q, "smoothed records need FUSED_Q (the raw queries at q)")
        q_model = _model_query(q_base, row_ok, LAYOUT.D, IN_BF16, FACTOR)
        out = _quantized_tiles(
            query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, q_model, FOLD, win_lo
        )
    else:
        out = _quantized_tiles(
            query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, None, FOLD, win_lo
        )
    return out
