"""The paged-attention kernel: one program per (query block, KV head, split).

A program serves ``BLOCK_Q`` queries x all ``Hq / Hkv`` query heads of one KV head (the rows of
its ``[BLOCK_M, ...]`` blocks), so each tile is read from memory once per KV head. It walks its
split's share of the sequence's tiles under the own-tile rule (:mod:`kvarn.reference.attention`):
quantized tiles first (:mod:`kvarn.kernels.attention_tiles`), those before each row's own tile,
then the full-precision sink and the own tile (tail slot, and the step's K/V for a multi-query
block), and ends in :mod:`kvarn.kernels.attention_merge`: the output itself (one split, or the
last split of its rows to finish merges them all), or its split's partial for the epilogue
kernel. The launcher is :mod:`kvarn.kernels.attention`.

Each query row is divided by a power of two so ``|q| < 1``; the range guard keeps every row
parameter under ``2^15``, so ``q * k_scale`` and ``p * v_scale`` fit fp16 without a per-tile scale.
Their fp16 rounding is the kernel's main error against the fp32 reference (~2e-3 of max |out|).

Smoothed records (``LAYOUT.K_SMOOTH >= 0``, ``smooth_keys``): a record's K tile is
``unrotate(R) * s`` in the model frame (``R`` the tile its codes store), so its scores are
``((q * s) H) . R[t]``: the program keeps its model-frame queries and, per record tile, multiplies
them by the tile's ``s`` and rotates them (:func:`_smoothed_query`, two tf32 dots on a hi/lo split,
~22 bits) before the usual score step. Sink and tail tiles are stored unsmoothed and use ``q H``.
Needs ``FUSED_Q`` (the raw queries at ``q``) and not ``TOKENS_M``; the launcher enforces both.

One vector per sequence (``LAYOUT.SEQ_SMOOTH``): every record of a sequence carries the same
``s``, so the program reads it once from the sequence's first record (block table entry 0) and
smooths and rotates its queries once (:func:`_sequence_query`); the tiles are then walked as
unsmoothed ones, with every variant (``TOKENS_M``, prologue queries). Sink and tail tiles keep ``q H``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import NEG_BIG, STEP_COUNTS, fp8e4m3_to_f32, frexp_exponent, hadamard_pm, load_f32, pow2
from kvarn.kernels.attention_merge import _finish, _unrotate
from kvarn.kernels.attention_tiles import (
    _causal,
    _fp_block_tile,
    _fp_rows,
    _fp_tile,
    _key_side,
    _split_fields,
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
def _query_block(pid, query_start_loc, num_seqs, BLOCK_Q: tl.constexpr):
    """Multi-query grid: program ``pid``'s ``(seq, q_start, n_q, q_first)``.

    Sequence ``b`` owns programs ``query_start_loc[b] // BLOCK_Q + b ..`` (one spare per sequence,
    so every sequence's blocks fit); a binary search finds ``pid``'s. ``q_start, n_q``: the
    sequence's first query row and query count; ``q_first``: the program's first query in it.
    """
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid
    seq = lo
    q_start = tl.load(query_start_loc + seq)
    n_q = tl.load(query_start_loc + seq + 1) - q_start
    q_first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    return seq, q_start, n_q, q_first


@triton.jit
def _concat(a, b):
    """``[R, C]`` and ``[R, C]`` -> ``[R, 2C]`` (``a`` first)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _query_channels(q_base, m2, b: tl.constexpr, h, ROTATE: tl.constexpr, IN_BF16: tl.constexpr):
    """Channel block ``b`` (``RB`` channels) of the rows' fp16/bf16 queries, times ``h = H_RB``: fp32."""
    RB: tl.constexpr = h.shape[0]
    z = load_f32(q_base + b * RB + tl.arange(0, RB)[None, :], m2, IN_BF16)
    if ROTATE:
        z = tl.dot(z, h, input_precision="tf32")  # +-1 entries: exact products of fp16/bf16 inputs
    return z


@triton.jit
def _query_field(q_base, row_ok, q_norm, f: tl.constexpr, DK: tl.constexpr):
    """Channels ``f * DK ..`` of the program's query rows, times ``q_norm``: ``[BLOCK_M, DK]`` fp32."""
    dk = tl.arange(0, DK)
    return tl.load(q_base + f * DK + dk[None, :], mask=row_ok[:, None], other=0.0) * q_norm[:, None]


@triton.jit
def _prerotated_query(q_base, row_ok, LAYOUT: tl.constexpr):
    """:func:`_load_query` for queries the prologue kernel already rotated and scaled (fp32 at ``q_base``)."""
    D: tl.constexpr = LAYOUT.D
    DK: tl.constexpr = D // LAYOUT.K_PER_BYTE
    qmax = tl.max(tl.abs(tl.load(q_base + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)), axis=1)
    e = frexp_exponent(qmax)
    q_norm = pow2(-e)  # |q| * 2^-e < 1
    q0 = _query_field(q_base, row_ok, q_norm, 0, DK)
    q1 = _query_field(q_base, row_ok, q_norm, 1, DK)
    q2 = q0
    q3 = q1
    if LAYOUT.K_PER_BYTE == 4:
        q2 = _query_field(q_base, row_ok, q_norm, 2, DK)
        q3 = _query_field(q_base, row_ok, q_norm, 3, DK)
    return q0, q1, q2, q3, pow2(e)


@triton.jit
def _rotated_query(q_base, row_ok, LAYOUT: tl.constexpr, ROTATE: tl.constexpr, IN_BF16: tl.constexpr, FACTOR):
    """:func:`_load_query` from the fp16/bf16 queries at ``q_base``: rotate (if ``ROTATE``) and scale here.

    Returns ``(q0, q1, q2, q3, rf)``: ``q0 .. q3: [BLOCK_M, DK]`` (``q2, q3`` repeat ``q0, q1``
    with two fields), divided by ``rf: [BLOCK_M]``, a power of two, so ``|q| < 1``. ``H_D`` is
    applied as ``H_RB`` on each block of ``RB`` channels, then butterflies across the 2 or 4 blocks
    (``H_2n = [[H_n, H_n], [H_n, -H_n]]``); each field is one block (or two with ``DK = 128``).
    """
    D: tl.constexpr = LAYOUT.D
    PK: tl.constexpr = LAYOUT.K_PER_BYTE
    DK: tl.constexpr = D // PK
    RB: tl.constexpr = DK if DK <= 64 else 64
    h = hadamard_pm(RB)
    m2 = row_ok[:, None] & (tl.arange(0, RB)[None, :] < RB)
    z0 = _query_channels(q_base, m2, 0, h, ROTATE, IN_BF16)  # [BLOCK_M, RB]
    z1 = _query_channels(q_base, m2, 1, h, ROTATE, IN_BF16)
    if ROTATE:
        z0, z1 = z0 + z1, z0 - z1
    z2 = z0
    z3 = z1
    if D // RB == 4:
        z2 = _query_channels(q_base, m2, 2, h, ROTATE, IN_BF16)
        z3 = _query_channels(q_base, m2, 3, h, ROTATE, IN_BF16)
        if ROTATE:
            z2, z3 = z2 + z3, z2 - z3
            z0, z1, z2, z3 = z0 + z2, z1 + z3, z0 - z2, z1 - z3
    qmax = tl.maximum(tl.max(tl.abs(z0), axis=1), tl.max(tl.abs(z1), axis=1))
    if D // RB == 4:
        qmax = tl.maximum(qmax, tl.maximum(tl.max(tl.abs(z2), axis=1), tl.max(tl.abs(z3), axis=1)))
    e = frexp_exponent(qmax * FACTOR)
    qn = (pow2(-e) * FACTOR)[:, None]  # |q| * 2^-e < 1
    if DK > RB:
        return _concat(z0, z1) * qn, _concat(z2, z3) * qn, _concat(z0, z1) * qn, _concat(z2, z3) * qn, pow2(e)
    else:
        return z0 * qn, z1 * qn, z2 * qn, z3 * qn, pow2(e)


@triton.jit
def _load_query(q_base, row_ok, LAYOUT: tl.constexpr, ROTATE: tl.constexpr, IN_BF16: tl.constexpr, FACTOR, FUSED):
    """The rows' queries in the rotated frame, times ``FACTOR``, split into the K fields' channel blocks.

    ``FUSED``: rotate and scale here (:func:`_rotated_query`); else read the prologue's output
    (:func:`_prerotated_query`). Returns ``(q0, q1, q2, q3, rf)``: ``q0 .. q3: [BLOCK_M, DK]``
    and ``rf: [BLOCK_M]``, a power of two that undoes the scaling to ``|q| < 1``.
    """
    if FUSED:
        query = _rotated_query(q_base, row_ok, LAYOUT, ROTATE, IN_BF16, FACTOR)
    else:
        query = _prerotated_query(q_base, row_ok, LAYOUT)
    return query


@triton.jit
def _query_rows(query, LAYOUT: tl.constexpr):
    """:func:`_load_query`'s fields as whole rows, exactly: ``(qn, rf)``, ``qn: [BLOCK_M, D]`` (``|qn| < 1``) and
    its power-of-two scale ``rf: [BLOCK_M]`` (the rotated, scaled queries are ``qn * rf[:, None]``).

    One return: Triton (3.6 and 3.9) type-checks a ``return`` that follows a constexpr branch which returned, so
    two returns of two types fail to compile (a ``SCALED`` flag did, in the sequence-smoothed launches, session 27).
    """
    q0, q1, q2, q3, rf = query
    if LAYOUT.K_PER_BYTE == 4:
        q_full = _concat(_concat(q0, q1), _concat(q2, q3))
    else:
        q_full = _concat(q0, q1)
    return q_full, rf


@triton.jit
def _model_query(q_base, row_ok, D: tl.constexpr, IN_BF16: tl.constexpr, FACTOR):
    """The rows' fp16/bf16 queries in the model frame, times ``FACTOR``: ``[BLOCK_M, D]`` fp32 (smoothed records)."""
    dd = tl.arange(0, D)
    return load_f32(q_base + dd[None, :], row_ok[:, None] & (dd[None, :] < D), IN_BF16) * FACTOR


@triton.jit
def _scaled_query(q_model, s, LAYOUT: tl.constexpr):
    """The score query ``(q_model * s) @ H_D`` (+-1 entries) in :func:`_load_query`'s form.

    ``q_model: [BLOCK_M, D]`` already carries ``FACTOR`` (with the Hadamard's ``1 / sqrt(D)``);
    ``s: [D]`` fp32. Returns ``(q0, q1, q2, q3, rf)``.
    """
    BLOCK_M: tl.constexpr = q_model.shape[0]
    D: tl.constexpr = LAYOUT.D
    z = _unrotate(q_model * s[None, :], 1.0)  # [BLOCK_M, D]
    e = frexp_exponent(tl.max(tl.abs(z), axis=1))
    q0, q1, q2, q3 = _split_fields(z * pow2(-e)[:, None], BLOCK_M, LAYOUT.K_PER_BYTE, D // LAYOUT.K_PER_BYTE)
    return q0, q1, q2, q3, pow2(e)


@triton.jit
def _smoothed_query(rec, q_model, LAYOUT: tl.constexpr):
    """The score query of smoothed record ``rec`` (its fp8 ``k_smooth`` as ``s``): :func:`_scaled_query`."""
    s = fp8e4m3_to_f32(tl.load(rec + LAYOUT.K_SMOOTH + tl.arange(0, LAYOUT.D)))  # [D]
    return _scaled_query(q_model, s, LAYOUT)


@triton.jit
def _sequence_query(
    query, rec0, n_full, q_base, row_ok, LAYOUT: tl.constexpr, IN_BF16: tl.constexpr, FACTOR, FUSED: tl.constexpr
):
    """The score query of every record of a ``SEQ_SMOOTH`` sequence, whose first record is ``rec0``.

    ``s`` is ``rec0``'s ``k_smooth`` (read only with ``n_full > 0`` records; else 1, unused). The
    model-frame rows come from the raw queries (``FUSED``) or back from the prologue's rotated ones.
    """
    D: tl.constexpr = LAYOUT.D
    dd = tl.arange(0, D)
    s = fp8e4m3_to_f32(tl.load(rec0 + LAYOUT.K_SMOOTH + dd, mask=dd < D * (n_full > 0).to(tl.int32), other=0x38))
    if FUSED:
        q_model = _model_query(q_base, row_ok, D, IN_BF16, FACTOR)
    else:
        qn, rf = _query_rows(query, LAYOUT)
        q_model = _unrotate(qn * rf[:, None], 1.0 / D)  # (q H) H / D = q
    return _scaled_query(q_model, s, LAYOUT)


@triton.jit
def _ahead_start(base, s_cb, bt_row, u0, u1, STEP: tl.constexpr, LAYOUT: tl.constexpr):
    """What a walk over tiles ``u0, u0 + STEP, .. < u1`` reads before its first step: tile ``u0``'s record
    (``base`` plus its block's offset), K and V scales (:func:`_key_side`, :func:`_value_side`), and the
    block id of tile ``u0 + STEP``. An empty walk (``u0 >= u1``) reads nothing.

    Each step then reads ahead (:func:`_ahead_step`, and the next tile's :func:`_value_side` after its
    value step), so no step waits on global memory for its tile's scales: they were 16-bit loads, too
    narrow for Triton's ``cp.async`` pipeline, and read in the step that used them they cost four
    round trips a tile (``benchmarks/RESULTS.md``, session 20). The codes are prefetched by the pipeline.
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
):
    """Online softmax over the quantized tiles ``u0 .. u1 - 1`` of one sequence.

    ``query`` as returned by :func:`_load_query`; with smoothed records ``q_model`` (the
    :func:`_model_query` rows) gives each tile its own score query (:func:`_smoothed_query`)
    instead. ``records = (cache, block_stride, head_stride,
    kv_head)``; ``bt_row`` points at the sequence's block table row. Returns the running max
    ``m_i``, the sum ``l_i`` (``[BLOCK_M]``) and the unnormalized output ``acc: [BLOCK_M, D]``
    (rotated frame). With ``PAIR`` (constexpr) each step takes two tiles (one softmax step for
    both, two independent score chains); an odd last tile is read twice, the copy masked out.
    ``FOLD``: the K codes are unpacked without removing their offsets, which leave the zero-point
    term instead (:func:`_tile_scores`; V codes are always centered).
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
        m_new = tl.maximum(m_i, rf * tl.max(tl.maximum(s_e, s_o), axis=1))
        if PAIR:
            rec2 = cache + tl.load(bt_row + tl.minimum(u + 1, u1 - 1)).to(tl.int64) * s_cb + kvh.to(tl.int64) * s_ch
            q2 = query if q_model is None else _smoothed_query(rec2, q_model, LAYOUT)
            rf2 = q2[4]
            s2_e, s2_o = _tile_scores(rec2, q2, LAYOUT, USE_ASM, FOLD)
            if MULTI_Q:
                s2_e, s2_o = _causal(s2_e, s2_o, pos_q, (u + 1) * G, G // 2)
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
    """:func:`_load_query`'s ``(q0, q1, q2, q3, rf)`` with the channel blocks transposed to ``[DK, N]``."""
    q0, q1, q2, q3, rf = query
    return tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3), rf


@triton.jit
def _quantized_tiles_t(
    query, records, bt_row, u0, u1, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, PAIR, FOLD: tl.constexpr = False
):
    """:func:`_quantized_tiles` with the tokens as the M of both dots (decode only, no causal mask).

    The score dot is ``codes^T @ (q k_scale)^T: [G // 2, N]`` and the value dot ``V^T @ p: [D // 2, N]``,
    so the ``N = BLOCK_M`` query rows (the heads of one KV head) are the MMA's columns: the
    per-token and per-channel work runs on ``G x N`` and ``D x N`` blocks, not on 16 padded rows.
    Same returns as :func:`_quantized_tiles`. ``FOLD``: the K codes are unpacked without removing
    their offsets, which leave the zero-point term instead (:func:`_tile_scores_t`).
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
        m_new = tl.maximum(m_i, rf * tl.max(tl.maximum(s_e, s_o), axis=0))
        if PAIR:
            rec2 = cache + tl.load(bt_row + tl.minimum(u + 1, u1 - 1)).to(tl.int64) * s_cb + kvh.to(tl.int64) * s_ch
            s2_e, s2_o = _tile_scores_t(rec2, query_t, LAYOUT, USE_ASM, FOLD)
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
    query, records, bt_row, u0, u1, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, GQP: tl.constexpr, FOLD: tl.constexpr
):
    """:func:`_quantized_tiles_t` with two tiles a step stacked on the dots' M (``STACK``, decode only).

    Column ``c`` of the ``N`` query rows walks the even tiles of the split (``u0, u0 + 2, ..``) where
    ``(c // GQP) % 2 == 0``, the odd ones otherwise: the caller loads rows ``GQP .. 2 GQP - 1`` with
    the same queries as rows ``0 .. GQP - 1`` (``2 GQP <= N``). One step scores and weighs both tiles
    in one dot each (:func:`_tile_scores_st`, :func:`_tile_values_st`); at the end each row's two
    running states merge into the first copy (:func:`_merge_stacked`), the second left empty.
    Same returns as :func:`_quantized_tiles_t`.
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
):
    """The program's quantized tiles: :func:`_quantized_tiles_t` with ``TOKENS_M`` (:func:`_quantized_tiles_st`
    with ``STACK`` too), else :func:`_quantized_tiles`.

    ``walk = (records, bt_row, u0, u1, pos_q)``; ``FOLD`` as in :func:`_quantized_tiles`; the raw queries
    at ``q_base`` (rows ``row_ok``)
    are read for per-tile smoothed records (``LAYOUT.K_SMOOTH >= 0``, which need ``FUSED_Q`` and not
    ``TOKENS_M``); for ``SEQ_SMOOTH`` records ``query`` is already the sequence's (:func:`_sequence_query`).
    """
    records, bt_row, u0, u1, pos_q = walk
    if TOKENS_M:
        if not LAYOUT.SEQ_SMOOTH:
            tl.static_assert(LAYOUT.K_SMOOTH < 0, "per-tile smoothed records are not implemented with TOKENS_M")
        if STACK:
            tl.static_assert(not MULTI_Q and 2 * GQP <= query[4].shape[0], "STACK: decode, 2 GQP <= BLOCK_M")
            out = _quantized_tiles_st(query, records, bt_row, u0, u1, LAYOUT, USE_ASM, GQP, FOLD)
        else:
            out = _quantized_tiles_t(query, records, bt_row, u0, u1, LAYOUT, USE_ASM, PAIR, FOLD)
    elif LAYOUT.SEQ_SMOOTH:  # query: the sequence's smoothed queries (_sequence_query)
        out = _quantized_tiles(query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, None, FOLD)
    elif LAYOUT.K_SMOOTH >= 0:
        tl.static_assert(FUSED_Q, "smoothed records need FUSED_Q (the raw queries at q)")
        q_model = _model_query(q_base, row_ok, LAYOUT.D, IN_BF16, FACTOR)
        out = _quantized_tiles(query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, q_model, FOLD)
    else:
        out = _quantized_tiles(query, records, bt_row, u0, u1, pos_q, LAYOUT, MULTI_Q, USE_ASM, PAIR, None, FOLD)
    return out


@triton.jit
def _program_rows(N: tl.constexpr, q_start, q_first, n_q, kvh, GQ: tl.constexpr, GQP: tl.constexpr):
    """The first ``N`` rows of a program: ``(q_row, head, row_ok, q_local)``, each ``[N]``.

    Row ``r`` is query ``q_first + r // GQP`` of the sequence (global row ``q_row``) and query
    head ``kvh * GQ + r % GQP``; ``row_ok`` says it is a real one.
    """
    rows = tl.arange(0, N)
    hj = rows % GQP
    q_local = q_first + rows // GQP
    row_ok = (hj < GQ) & (q_local < n_q)
    return (q_start + q_local).to(tl.int64), kvh * GQ + hj, row_ok, q_local


@triton.jit
def _read_rows(rows, q_start, kvh, GQ: tl.constexpr, GQP: tl.constexpr, STACK: tl.constexpr):
    """The rows whose queries a program reads: ``rows = (q_row, head, row_ok)`` of :func:`_program_rows`, or
    with ``STACK`` (decode) row ``r`` reading head ``r % GQP`` of the query (real where ``r % GQP < GQ``):
    rows from ``GQP`` on carry the queries of the other tile of a step (:func:`_quantized_tiles_st`) and
    are never written."""
    q_row, head, row_ok = rows
    if STACK:
        r = tl.arange(0, q_row.shape[0]) % GQP
        return q_row * 0 + q_start, kvh * GQ + r, r < GQ
    return q_row, head, row_ok


@triton.jit
def _split_units(
    seq,
    seq_len,
    n_q,
    q_first,
    split,
    num_splits,
    min_units,
    sink_slots,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_KV: tl.constexpr,
):
    """What split ``split`` of sequence ``seq`` reads: ``(n_full, own, u0, u1, qt0, sink_slot, has_sink, n_act)``.

    The program's units are ``n_full`` record tiles, then one full-precision unit (the own tile,
    :func:`_fp_tiles`) ``own = (n_slot, fp0, j0, n_step)``: ``n_slot`` tail slot tokens at
    positions ``fp0 ..`` and, with ``HAS_KV``, ``n_step`` of the step's tokens at positions
    ``j0 ..``. Decode: ``(seq_len - 1) // G`` records and the other ``1 .. G`` tokens from the
    slot. A multi-query block: the records before the tile of its last query, the own-tile unit
    from the tile of its first query on, the step's tokens (``HAS_KV``) or the slot's (the
    sequence's queries in one tile) up to its last query. The split's units are
    ``u0 .. u1 - 1``, its records from ``qt0``; with ``has_sink`` tile 0 is read from pool slot
    ``sink_slot`` instead of its record. Each split takes ``max(cdiv(n_units, num_splits), min_units)``
    units, so only the first ``n_act`` splits have any: a launch sized for the longest sequence
    (vLLM's block table width) gives short sequences few, full splits and few partials to merge.
    """
    if MULTI_Q:
        first = seq_len - n_q  # the step's first position
        p_last = first + tl.minimum(n_q, q_first + BLOCK_Q) - 1
        n_full = p_last // G
        fp0 = (first + q_first) // G * G
        if HAS_KV:
            n_slot = tl.maximum(first - fp0, 0)
        else:
            n_slot = p_last + 1 - fp0
        j0 = tl.maximum(first, fp0)
        n_units = n_full + 1
    else:
        n_full = (seq_len - 1) // G  # Triton's // and % truncate: an empty sequence reads nothing
        n_slot = (seq_len - 1) % G + 1  # of the forms timed on the H200, the one as fast as before
        fp0 = n_full * G
        j0 = seq_len
        p_last = seq_len - 1
        n_units = n_full + (n_slot > 0).to(tl.int32)
    per = tl.maximum(tl.cdiv(n_units, num_splits), min_units)
    n_act = tl.maximum(tl.cdiv(n_units, per), 1)  # an empty sequence (padding) still gets its zero rows
    u0 = split * per
    u1 = tl.minimum(u0 + per, n_units)
    if HAS_SINK:
        sink_slot = tl.load(sink_slots + seq)
    else:
        sink_slot = seq * 0 - 1
    has_sink = (sink_slot >= 0) & (n_full > 0)
    qt0 = u0
    if has_sink & (u0 == 0):
        qt0 = 1
    return n_full, (n_slot, fp0, j0, p_last + 1 - j0), u0, u1, qt0, sink_slot, has_sink, n_act


@triton.jit
def _first_record(walk, n_full):
    """The sequence's first record (block table entry 0) for KV head ``kvh``; ``cache`` itself when it has none."""
    records, bt_row, _, _, _ = walk
    cache, s_cb, s_ch, kvh = records
    blk0 = tl.load(bt_row, mask=n_full > 0, other=0).to(tl.int64)
    return cache + blk0 * s_cb + kvh.to(tl.int64) * s_ch


@triton.jit
def _records_query(
    q_base,
    qs_base,
    row_ok,
    walk,
    n_full,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR,
    FUSED_Q: tl.constexpr,
    SMOOTH_Q: tl.constexpr,
    LATE_Q: tl.constexpr,
):
    """``(query, rec_query)``: the unsmoothed queries (sink and tail) and those the records are scored with.

    Each is 4 x ``[BLOCK_M, DK]`` and ``[BLOCK_M]``. A ``SEQ_SMOOTH`` layout scores records with
    the queries smoothed by the sequence's vector (in its first record, :func:`_first_record` of the
    record walk ``walk``): from the prologue (``SMOOTH_Q``, at ``qs_base``) or made here
    (:func:`_sequence_query`). With ``LATE_Q`` only those are loaded, so one query set is live in
    the tile loop; ``query`` is then a stand-in and :func:`_fp_tiles` loads the unsmoothed queries
    after the loop.
    """
    if LATE_Q:
        if SMOOTH_Q:
            rec_query = _prerotated_query(qs_base, row_ok, LAYOUT)
        else:
            rec0 = _first_record(walk, n_full)
            rec_query = _sequence_query(None, rec0, n_full, q_base, row_ok, LAYOUT, IN_BF16, FACTOR, True)
        query = rec_query
    else:
        query = _load_query(q_base, row_ok, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q)
        rec_query = query
        if LAYOUT.SEQ_SMOOTH:  # multi-query from the prologue's rotated queries
            rec0 = _first_record(walk, n_full)
            rec_query = _sequence_query(query, rec0, n_full, q_base, row_ok, LAYOUT, IN_BF16, FACTOR, FUSED_Q)
    return query, rec_query


@triton.jit
def _fp_tiles(
    state,
    query,
    src,
    units,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR,
    FUSED_Q: tl.constexpr,
    POOL_BF16: tl.constexpr,
    LATE_Q: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_KV: tl.constexpr,
    TAIL_ROWS: tl.constexpr = 0,
):
    """The full-precision units of a split, the sink (tile 0) and the own tile, into ``state = (m, l, acc)``.

    ``TAIL_ROWS > 0`` (decode, no sink): the own tile is kept as rows of blocks, ``TAIL_ROWS`` a
    block, and ``tail_slots`` holds ``cdiv(G, TAIL_ROWS)`` blocks a sequence (:func:`_fp_block_tile`).

    ``src = (q_base, row_ok, pool, step)``, ``units = (sink_here, sink_slot, own_here, (tail_slots,
    seq), own, pos_q, lo_q)`` with ``own`` from :func:`_split_units` and ``lo_q`` each row's
    own-tile start; ``step = (key, value, row)``: the step's pool-form K/V ``[rows, Hkv, D]`` and
    the row of position ``j0`` (read with ``HAS_KV``). A multi-query row sees the sink below
    ``lo_q`` and the own-tile unit from ``lo_q`` to its position. Scored with the unsmoothed
    ``query``, or with ``LATE_Q`` with the unsmoothed queries loaded here from ``q_base`` (``query``
    is then not read).
    """
    q_base, row_ok, pool, step = src
    sink_here, sink_slot, own_here, tails, own, pos_q, lo_q = units
    tail_slots, seq = tails
    n_slot, fp0, j0, n_step = own
    if sink_here | own_here:
        if LATE_Q:
            q_use = _load_query(q_base, row_ok, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q)
        else:
            q_use = query
        q_rows = _query_rows(q_use, LAYOUT)  # (qn [BLOCK_M, D], rf [BLOCK_M])
        if sink_here:
            if MULTI_Q:
                state = _fp_tile(q_rows, state, pool, sink_slot, LAYOUT.G, 0, lo_q - 1, POOL_BF16)
            else:
                state = _fp_tile(q_rows, state, pool, sink_slot, LAYOUT.G, 0, pos_q, POOL_BF16)
        if TAIL_ROWS > 0:
            if own_here:
                n_cols: tl.constexpr = (LAYOUT.G + TAIL_ROWS - 1) // TAIL_ROWS  # blocks of a tail
                table = tail_slots + seq * n_cols
                state = _fp_block_tile(q_rows, state, pool, table, n_slot, fp0, pos_q, TAIL_ROWS, POOL_BF16)
        elif own_here:
            slot = tl.load(tail_slots + seq)
            if MULTI_Q:
                state = _fp_tile(q_rows, state, pool, slot, n_slot, fp0, pos_q, POOL_BF16, lo_q)
                if HAS_KV:
                    key, value, row = step
                    D: tl.constexpr = LAYOUT.D
                    kvh = pool[5]
                    stride = tl.num_programs(1) * D  # [rows, Hkv, D] contiguous
                    off = row.to(tl.int64) * stride + kvh * D
                    state = _fp_rows(q_rows, state, key, value, off, stride, n_step, j0, pos_q, lo_q, POOL_BF16)
            else:
                state = _fp_tile(q_rows, state, pool, slot, n_slot, fp0, pos_q, POOL_BF16)
    return state


TIMELINE_ENTRY = tl.constexpr(0)
TIMELINE_UNITS = tl.constexpr(1)
TIMELINE_RECORDS = tl.constexpr(2)
TIMELINE_FP = tl.constexpr(3)
TIMELINE_DONE = tl.constexpr(4)
TIMELINE_SM = tl.constexpr(7)
"""Columns of a ``TIMELINE`` row (:func:`kvarn.kernels.attention.decode_timeline`): ``%globaltimer`` (ns) at the
program's entry, once its units are known (``seq_lens`` read), after its record tiles, after its
full-precision units, after its finish (partial, merge, output); the SM it ran on."""


@triton.jit
def _stamp(TL: tl.constexpr, col: tl.constexpr, dep):
    """With ``TL`` (a buffer's address, else nothing) write ``%globaltimer`` at the program's row, column ``col``.

    A diagnostic (GPU only: inline PTX, never under the interpreter): ``dep`` is a scalar the stamp
    waits for (a loop's result), so the time is taken after the work that produced it. The row is
    ``(pid(0) * Hkv + pid(1)) * splits + pid(2)``; at ``col`` ``TIMELINE_ENTRY`` the SM id is written too.
    """
    if TL != 0:
        row = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], tl.int64, is_pure=False, pack=1)
        base = tl.full([], TL, tl.int64).to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * 8
        tl.store(base + col, now)
        if col == TIMELINE_ENTRY:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(base + TIMELINE_SM, sm.to(tl.int64))


@triton.jit(do_not_specialize=STEP_COUNTS)
def _attn_kernel(
    q,
    q_smooth,
    cache,
    block_table,
    seq_lens,
    tail_k,
    tail_v,
    tail_slots,
    sink_slots,
    query_start_loc,
    key,
    value,
    part,
    ws_m,
    ws_l,
    final,
    counters,
    num_seqs,
    hq,
    s_iq,
    s_iqh,
    s_o,
    s_oh,
    s_cb,
    s_ch,
    s_bt,
    p_slot,
    p_tok,
    p_head,
    s_ws,
    num_splits,
    min_units,
    GQ: tl.constexpr,
    GQP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LAYOUT: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_SINK: tl.constexpr,
    POOL_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
    FUSED_Q: tl.constexpr,
    PAIR: tl.constexpr,
    TOKENS_M: tl.constexpr,
    FOLD: tl.constexpr,
    MERGE_CH: tl.constexpr,
    FLAGS: tl.constexpr,
    SMOOTH_Q: tl.constexpr = False,
    LATE_Q: tl.constexpr = False,
    HAS_KV: tl.constexpr = False,
    STACK: tl.constexpr = False,
    TAIL_ROWS: tl.constexpr = 0,
    TIMELINE: tl.constexpr = 0,
):
    """Grid ``(query blocks, Hkv, num_splits)``; see :func:`kvarn.kernels.attention_merge._finish` for what it writes.

    ``q: [Nq, Hq, D]`` (strides ``s_iq, s_iqh``): with ``FUSED_Q`` the fp16/bf16 queries, rotated and scaled by
    ``FACTOR`` here, else the prologue's rotated fp32 queries. ``part: [splits, Nq, Hq, D]`` fp32 partials
    (``s_ws = Nq * Hq``, ``hq = Hq``), ``final: [Nq, Hq, D]`` the output (strides ``s_o, s_oh``), ``counters:
    [query blocks * Hkv]`` int32 zeros (with ``MERGE``). ``GQ`` query heads per KV head, padded to ``GQP`` (a
    power of two); row ``r`` of a block is query ``r // GQP``, head ``r % GQP``. ``FLAGS = (SPLIT, MERGE, ROTATE,
    OUT_BF16, INV_SQRT_D)``. ``TOKENS_M`` (decode only): tokens on the dots' M (:func:`_quantized_tiles_t`);
    ``FOLD``: :func:`_quantized_tiles`. ``SMOOTH_Q`` (``SEQ_SMOOTH`` decode with the prologue): ``q_smooth``
    holds the prologue's queries for the records (smoothed with the sequence's vector), laid out as ``q``; else
    the program smooths its own (:func:`_sequence_query`). ``LATE_Q`` (``SMOOTH_Q``, or ``SEQ_SMOOTH`` with
    ``FUSED_Q``): the unsmoothed queries are loaded only after the tile loop, for the sink and tail. ``HAS_KV``
    (multi-query only): ``key, value: [Nq, Hkv, D]`` hold the step's own K/V in the pool form (contiguous, rows
    as ``q``'s), read for the own-tile positions from the step's first on; else those are read from the tail
    slot too (:func:`_split_units`). ``STACK``: :func:`_quantized_tiles_st`. ``TAIL_ROWS > 0``: own tiles in block
    rows of ``tail_k, tail_v`` (strides ``p_*``), ``tail_slots: [B, cdiv(G, TAIL_ROWS)]`` (:func:`_fp_block_tile`).
    """
    G: tl.constexpr = LAYOUT.G
    ROTATE: tl.constexpr = FLAGS[2]
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _stamp(TIMELINE, TIMELINE_ENTRY, split)
    if MULTI_Q:
        seq, q_start, n_q, q_first = _query_block(pid, query_start_loc, num_seqs, BLOCK_Q)
    else:
        seq, q_start, n_q, q_first = pid, pid, 1, 0
    has_q = q_first < n_q  # else a spare query block of a multi-query launch: nothing to do
    seq_len = tl.load(seq_lens + seq, mask=has_q, other=0)
    q_row, head, row_ok, q_local = _program_rows(BLOCK_M, q_start, q_first, n_q, kvh, GQ, GQP)
    pos_q = seq_len - n_q + q_local  # [BLOCK_M]
    ld_row, ld_head, ld_ok = _read_rows((q_row, head, row_ok), q_start, kvh, GQ, GQP, STACK)
    q_base = q + ld_row[:, None] * s_iq + ld_head[:, None] * s_iqh  # [BLOCK_M, 1]
    n_full, own, u0, u1, qt0, sink_slot, has_sink, n_act = _split_units(
        seq, seq_len, n_q, q_first, split, num_splits, min_units, sink_slots, G, BLOCK_Q, MULTI_Q, HAS_SINK, HAS_KV
    )
    _stamp(TIMELINE, TIMELINE_UNITS, n_act + u0 + u1)
    if has_q & ((split < n_act) | (not FLAGS[1])):  # without MERGE the epilogue reads every split's partial
        lo_q = pos_q // G * G if MULTI_Q else pos_q  # each row's own tile: records (and the sink) before it only
        bt_row = block_table + seq.to(tl.int64) * s_bt
        records = (cache, s_cb, s_ch, kvh)
        qt1 = tl.minimum(u1, n_full)
        walk = (records, bt_row, qt0, qt1, lo_q - 1)
        qs_base = q_smooth + ld_row[:, None] * s_iq + ld_head[:, None] * s_iqh
        query, rec_query = _records_query(q_base, qs_base, ld_ok, walk, n_full, LAYOUT, ROTATE, IN_BF16, FACTOR,
            FUSED_Q, SMOOTH_Q, LATE_Q)  # fmt: skip
        state = _record_tiles(rec_query, walk, q_base, ld_ok, LAYOUT, MULTI_Q, USE_ASM, PAIR, TOKENS_M, FUSED_Q,
            IN_BF16, FACTOR, FOLD, STACK, GQP)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_RECORDS, tl.max(state[0], axis=0).to(tl.int32, bitcast=True))
        pool = (tail_k, tail_v, p_slot, p_tok, p_head, kvh)
        own_here = (own[0] + own[3] > 0) & (u0 <= n_full) & (n_full < u1)
        units = (has_sink & (u0 == 0), sink_slot, own_here, (tail_slots, seq), own, pos_q, lo_q)
        src = (q_base, ld_ok, pool, (key, value, q_start + own[2] - (seq_len - n_q)))
        m_i, l_i, acc = _fp_tiles(state, query, src, units, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q, POOL_BF16,
            LATE_Q, MULTI_Q, HAS_KV, TAIL_ROWS)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_FP, tl.max(m_i, axis=0).to(tl.int32, bitcast=True))
        R: tl.constexpr = BLOCK_Q * GQP  # the program's distinct rows
        q_row_c, head_c, row_ok_c, _ = _program_rows(R, q_start, q_first, n_q, kvh, GQ, GQP)
        compact = (q_row_c * hq + head_c, row_ok_c)
        counter = counters + pid * tl.num_programs(1) + kvh
        _finish((m_i, l_i, acc), (q_row, head, row_ok, hq, split), compact, (part, ws_m, ws_l, s_ws, final, s_o, s_oh),
            counter, n_act, MERGE_CH, FLAGS)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_DONE, split)
