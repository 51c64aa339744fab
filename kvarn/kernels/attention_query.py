"""The queries of a paged-attention program: loaded, rotated, scaled, and smoothed for smoothed records.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_decode` (Triton inlines them). Each query
row is divided by a power of two so ``|q| < 1``; the range guard keeps every row parameter under
``2^15``, so ``q * k_scale`` and ``p * v_scale`` fit fp16 without a per-tile scale. Their fp16
rounding is the kernel's main error against the fp32 reference (~2e-3 of max |out|).

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

from kvarn.kernels._common import fp8e4m3_to_f32, frexp_exponent, hadamard_pm, load_f32, pow2
from kvarn.kernels.attention_merge import _unrotate
from kvarn.kernels.attention_tiles import _split_fields


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
    two returns of two types fail to compile (a ``SCALED`` flag did, in the sequence-smoothed launches).
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
    query,
    rec0,
    n_full,
    q_base,
    row_ok,
    LAYOUT: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR,
    FUSED: tl.constexpr,
    t0=0,
):
    """The score query of every record of a ``SEQ_SMOOTH`` sequence, whose first record walked is ``rec0``.

    Every record of a sequence carries its vector: ``s`` is ``rec0``'s ``k_smooth`` (read only where records
    ``t0 .. n_full - 1`` are walked; else 1, unused). The model-frame rows come from the raw queries
    (``FUSED``) or back from the prologue's rotated ones.
    """
    D: tl.constexpr = LAYOUT.D
    dd = tl.arange(0, D)
    s = fp8e4m3_to_f32(tl.load(rec0 + LAYOUT.K_SMOOTH + dd, mask=dd < D * (n_full > t0).to(tl.int32), other=0x38))
    if FUSED:
        q_model = _model_query(q_base, row_ok, D, IN_BF16, FACTOR)
    else:
        qn, rf = _query_rows(query, LAYOUT)
        q_model = _unrotate(qn * rf[:, None], 1.0 / D)  # (q H) H / D = q
    return _scaled_query(q_model, s, LAYOUT)


@triton.jit
def _first_record(walk, n_full, t0=0):
    """The sequence's first record in its window (block table entry ``t0``; 0 without a sliding window) for KV head
    ``kvh``; ``cache`` itself when the walk reads none (``n_full <= t0``). Entries before ``t0`` are not read."""
    records, bt_row, _, _, _ = walk
    cache, s_cb, s_ch, kvh = records
    blk0 = tl.load(bt_row + t0, mask=n_full > t0, other=0).to(tl.int64)
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
    t0=0,
):
    """``(query, rec_query)``: the unsmoothed queries (sink and tail) and those the records are scored with.

    Each is 4 x ``[BLOCK_M, DK]`` and ``[BLOCK_M]``. A ``SEQ_SMOOTH`` layout scores records with the queries smoothed by
    the sequence's vector (in its first record from tile ``t0`` on, the first a sliding window leaves:
    :func:`_first_record` of the record walk ``walk``): from the prologue
    (``SMOOTH_Q``, at ``qs_base``) or made here (:func:`_sequence_query`). With ``LATE_Q`` only those are loaded, so one
    query set is live in the tile loop; ``query`` is then a stand-in and
    :func:`~kvarn.kernels.attention_decode._fp_tiles` loads the unsmoothed queries after the loop.
    """
    if LATE_Q:
        if SMOOTH_Q:
            rec_query = _prerotated_query(qs_base, row_ok, LAYOUT)
        else:
            rec0 = _first_record(walk, n_full, t0)
            rec_query = _sequence_query(None, rec0, n_full, q_base, row_ok, LAYOUT, IN_BF16, FACTOR, True, t0)
        query = rec_query
    else:
        query = _load_query(q_base, row_ok, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q)
        rec_query = query
        if LAYOUT.SEQ_SMOOTH:  # multi-query from the prologue's rotated queries
            rec0 = _first_record(walk, n_full, t0)
            rec_query = _sequence_query(query, rec0, n_full, q_base, row_ok, LAYOUT, IN_BF16, FACTOR, FUSED_Q, t0)
    return query, rec_query
