"""Triton store path: tiles -> cache records (normalize, round, pack, write) and tokens -> tail pool.

One program encodes one tile half (the K or the V part of one tile of one KV head) and writes it
straight into its record; a launch covers every (tile, head, half) of the call. ``prepare``
(sanitize, rotate, round) is a separate kernel shared by :func:`write_tail` and
:func:`store_tiles`, so both paths hand the encoder bit-identical tiles. The math mirrors
:mod:`kvarn.reference.quantize` stage by stage, in fp32:

- Sinkhorn with the reference's clamps and best-iterate rule, carried in the linear domain as
  reciprocal scales ``1 / r``, ``1 / c`` (``exp``/``log`` are monotonic, so the log-domain clamps
  commute): a step is ``clamp(inv * rsqrt(clamp(var, STD_MIN^2, STD_MAX^2)), e^-10, e^0.3)``, no
  ``log``, ``exp``, ``sqrt`` or division per row or column. Variances of the scaled tile
  ``X = M / (r c^T)`` are taken in factored form, ``colvar(X)_j = var_i(M_ij / r_i) / c_j^2`` and
  ``rowvar(X)_i = var_j(M_ij / c_j) / r_i^2``: two centered two-pass reductions per iteration (a
  one-pass shifted sum would cancel on rows with a large bias, see :func:`_var_axis0`); the
  imbalance is ``sqrt(max var / max(min var, eps^2))`` per axis, so the square roots are scalars.
- ``c`` rounded to bf16 before ``B = M / (r c^T)``, asymmetric RTN (ties to even; divisions, as
  exact ties are common on coarse inputs), the range guard's exponent
  from the fp32 bits (``frexp`` semantics), fp16 row parameters, bf16 column scales; a tiny tile
  half is rescaled by a power of two first, which its column scales take back. Clipped ranges
  (2-bit halves): each shrink costs an fma, a clamp, a rounding and a square-add per element on
  ``B - min(B)`` (no cancellation), ``1 / step`` per row from ``1 / width``.
- Planar packing along rows (K: channels, V: tokens).
- Key smoothing (``smooth_keys`` configs, :func:`_smooth_tile`): the K program leaves the rotated
  frame with the reference's butterflies (:func:`~kvarn.kernels._common.fwht_rows`, exact in the
  reference's op order), takes each channel's std over the tile's tokens (two-pass; the reference's
  ``torch.std`` may differ by an fp32 ulp, which matters only at an fp8 rounding tie), rounds
  ``s`` to fp8 e4m3 in fp32 bit arithmetic, stores it, and divides (``div_rn``) and rotates back.
  One vector per sequence (``smooth_scope="sequence"``, ``smooth_src`` given): two launches of
  the encoder. The first (``SMOOTH_PHASE = 0``, K programs of first tiles only) takes the vector
  of each first tile without its first token and writes it into that tile's record; the second
  encodes every tile with the vector it reads from its ``smooth_src`` record (and copies it into
  its own), so a tile and its sequence's first tile may share a call.

Results equal the reference's except where fp32 rounding differs (``rsqrt`` and reciprocal
approximations, linear instead of log-domain accumulation of the scales, summation order): a
code can then move by one step at a rounding tie and a column scale by one
bf16 ulp. Where the imbalance plateaus, iterates of equal imbalance (to fp32 rounding) differ
only by a gauge factor (rows x a, columns / a); the best-iterate rule may then keep another one
than the reference, with equivalent scales. ``tests/test_kernels_*.py`` bounds all of this.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvarn.config import KVarNConfig
from kvarn.kernels import _plan
from kvarn.kernels._common import (
    IMBALANCE_EPS,
    LOG_SCALE_MAX,
    LOG_SCALE_MIN,
    MIN_STEP,
    ROW_EXP_HI,
    ROW_EXP_LO,
    SEQ_SMOOTH_SKIP,
    SMOOTH_MIN,
    STD_MAX,
    STD_MIN,
    STEP_COUNTS,
    bf16_bits,
    bf16_round,
    cdiv,
    check_cache,
    check_dtype,
    fp8e4m3_bits,
    fp8e4m3_round,
    fp8e4m3_to_f32,
    frexp_exponent,
    fwht_rows,
    hadamard_pm,
    hdot,
    index_list,
    inv_sqrt,
    load_f32,
    pool_factor,
    pow2,
    record_layout,
    rotate_rows,
    rotate_rows_split,
    round_to_dtype,
    sanitize,
    store_model,
)

TINY = tl.constexpr(2.0**-24)  # kvarn.reference.quantize: 2^TINY_EXP, TINY_TARGET_EXP, MIN_EXP
TINY_TARGET_EXP = tl.constexpr(1)
MIN_EXP = tl.constexpr(-126)
VAR_MIN = tl.constexpr(STD_MIN.value * STD_MIN.value)  # the std clamps of the Sinkhorn step, on variances
VAR_MAX = tl.constexpr(STD_MAX.value * STD_MAX.value)
INV_SCALE_MIN = tl.constexpr(math.exp(-LOG_SCALE_MAX.value))  # the log-scale clamps, on reciprocal scales
INV_SCALE_MAX = tl.constexpr(math.exp(-LOG_SCALE_MIN.value))

ENCODE_SMALL_TILE = 128 * 128
"""Tiles of up to this many elements (``D * G``) run the encoder with 4 warps per program, larger ones
and smoothed K halves with 8 (``benchmarks/RESULTS.md`` has the sweeps)."""


@triton.jit
def _var_axis0(x, N: tl.constexpr):
    """Unbiased variance over axis 0 of ``x: [N, C]`` -> ``[C]`` (two-pass, centered).

    Kept two-pass: a one-pass ``sum((x - p)^2) - sum(x - p)^2 / N`` loses ``(mean - p)^2 / var``
    ulps, and no pivot ``p`` is both free and close: K rows carry biases of many stds, and a step
    rescales a row's mean by the mean change of the other axis' scales (large in early iterations),
    so the previous iterate's mean or the first element misses by up to ``bias / std``.
    """
    mean = tl.sum(x, axis=0) / N
    d = x - mean[None, :]
    return tl.sum(d * d, axis=0) / (N - 1)


@triton.jit
def _var_axis1(x, N: tl.constexpr):
    """Unbiased variance over axis 1 of ``x: [R, N]`` -> ``[R]`` (two-pass, centered)."""
    mean = tl.sum(x, axis=1) / N
    d = x - mean[:, None]
    return tl.sum(d * d, axis=1) / (N - 1)


@triton.jit
def _scale_step(inv_scale, var):
    """One Sinkhorn step of reciprocal scales ``1 / exp(l)`` given the scaled tile's variances ``std^2``.

    ``exp(-clamp(l + log(clamp(std, STD_MIN, STD_MAX)), LOG_SCALE_MIN, LOG_SCALE_MAX))`` taken in the
    linear domain (``exp`` and ``log`` are monotonic, so the clamps commute):
    ``clamp(inv_scale * rsqrt(clamp(var, STD_MIN^2, STD_MAX^2)), e^-LOG_SCALE_MAX, e^-LOG_SCALE_MIN)``.
    """
    v = tl.minimum(tl.maximum(var, VAR_MIN), VAR_MAX)
    return tl.minimum(tl.maximum(inv_scale * tl.math.rsqrt(v), INV_SCALE_MIN), INV_SCALE_MAX)


@triton.jit
def _imbalance(col_var, row_var):
    """``imbalance`` of the reference from column and row variances: ``sqrt(max var / max(min var, eps^2))`` each."""
    col_term = tl.max(col_var, axis=0) / tl.maximum(tl.min(col_var, axis=0), IMBALANCE_EPS * IMBALANCE_EPS)
    row_term = tl.max(row_var, axis=0) / tl.maximum(tl.min(row_var, axis=0), IMBALANCE_EPS * IMBALANCE_EPS)
    return tl.sqrt_rn(col_term) + tl.sqrt_rn(row_term)


@triton.jit
def _rtn_codes(bs, shift, step, QMAX: tl.constexpr):
    """Codes (fp32 integers in ``[0, QMAX]``) of rows ``bs = b - min(b): [R, C]``, ``lo = min(b) + shift``, ``step``.

    ``(bs - shift) / step``: the reference's ``(b - lo) / step`` with ``b - lo`` taken as ``(b - min(b)) - shift``
    (the same rounding for an unclipped row, ``shift = 0``). A division, not a reciprocal multiply:
    coarse inputs (fp16 subnormals, bf16) put many ``q`` exactly on a tie, which a reciprocal moves.
    """
    q = (bs - shift[:, None]) / step[:, None]
    q = (q + 12582912.0) - 12582912.0  # round half to even (|q| < 2^22)
    return tl.minimum(tl.maximum(q, 0.0), QMAX)


@triton.jit
def _row_sq_error(bs, shift, step, inv, QMAX: tl.constexpr):
    """Squared error ``[R]`` of rows ``bs = b - min(b): [R, C]`` rounded with ``lo = min(b) + shift``, ``step``.

    ``rtn._row_sq_error``: ``step^2 sum_j (t_j - code_j)^2``, ``t = (b - lo) * inv`` (``inv = 1 / step``
    to an ulp or two), here ``t = fma(bs, inv, -shift * inv)`` (``|shift * inv| < QMAX``: no
    cancellation): an fma, a clamp, a rounding and a fused square-add per element.
    """
    t = tl.fma(bs, inv[:, None], (-shift * inv)[:, None])
    q = tl.minimum(tl.maximum(t, 0.0), QMAX)
    e = t - ((q + 12582912.0) - 12582912.0)  # round half to even the clamped t: clamp(round(t))
    return (step * step) * tl.sum(e * e, axis=1)


@triton.jit
def _encode_half(
    m,
    out,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    ITERS: tl.constexpr,
    CODE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr,
    COL_OFF: tl.constexpr,
    CLIP_UNIT: tl.constexpr,
    CLIP_COUNT: tl.constexpr,
):
    """Quantize one oriented tile half ``m: [R, C]`` fp32 and write its fields at record ``out``.

    Per Sinkhorn iteration: two passes over the tile per axis (scale, sum; centered square-sum),
    per row and column a clamp, an ``rsqrt``, a multiply and a clamp, four min/max reductions.

    ``CLIP_COUNT > 1``: each row tries the ranges shrunk by ``k / CLIP_UNIT`` of its width
    (``k < CLIP_COUNT``) and keeps the smallest squared error (``rtn.choose_qparams(clip=...)``).
    """
    QMAX: tl.constexpr = (1 << BITS) - 1
    P: tl.constexpr = 8 // BITS
    amax_m = tl.max(tl.max(tl.abs(m), axis=1), axis=0)  # tiny tiles: rescaled, 2^p folded into col
    p = tl.where((amax_m > 0.0) & (amax_m < TINY), tl.maximum(frexp_exponent(amax_m) - TINY_TARGET_EXP, MIN_EXP), 0)
    m = m * pow2(-p)
    inv_r = tl.full([R], 1.0, tl.float32)  # 1 / r = exp(-lr), 1 / c = exp(-lc)
    inv_c = tl.full([C], 1.0, tl.float32)
    best_inv_r = inv_r
    best_inv_c = inv_c
    if ITERS > 0:
        col_var = _var_axis0(m, R)  # colvar(X), X = M / (r c^T)
        best_imb = _imbalance(col_var, _var_axis1(m, C))
        for _ in range(ITERS):
            inv_c = _scale_step(inv_c, col_var)
            u = _var_axis1(m * inv_c[None, :], C)  # rowvar(X) * r^2
            inv_r = _scale_step(inv_r, u * (inv_r * inv_r))
            col_var = _var_axis0(m * inv_r[:, None], R) * (inv_c * inv_c)
            imb = _imbalance(col_var, u * (inv_r * inv_r))
            take = imb <= best_imb
            best_imb = tl.where(take, imb, best_imb)
            best_inv_r = tl.where(take, inv_r, best_inv_r)
            best_inv_c = tl.where(take, inv_c, best_inv_c)
    r = 1.0 / best_inv_r
    c = bf16_round(1.0 / best_inv_c)
    b = m / (r[:, None] * c[None, :])
    lo = tl.min(b, axis=1)
    hi = tl.max(b, axis=1)
    bs = b - lo[:, None]  # b - lo, rounded as the reference rounds it for the unclipped range
    step = tl.maximum((hi - lo) / QMAX, MIN_STEP)
    shift = tl.zeros([R], tl.float32)  # lo of the chosen range - min(b)
    if CLIP_COUNT > 1:
        width = hi - lo
        inv_width = 1.0 / tl.maximum(width, 1e-30)  # past 1 / MIN_STEP for a constant row, as its 1 / step_s
        best = _row_sq_error(bs, shift, step, 1.0 / step, QMAX)
        best_lo = lo
        best_step = step
        for k in range(1, CLIP_COUNT):  # a loop, not unrolled: one shrink's temporaries live at a time
            kf = tl.zeros([], tl.float32) + k  # the fractions below round as the reference's fp32(k / unit / 2) etc.
            lo_s = lo + width * (kf / (2 * CLIP_UNIT))
            step_s = tl.maximum(width * ((CLIP_UNIT - kf) / (CLIP_UNIT * QMAX)), MIN_STEP)
            inv_s = tl.minimum(inv_width * ((CLIP_UNIT * QMAX) / (CLIP_UNIT - kf)), 1.0 / MIN_STEP)  # 1 / step_s
            err = _row_sq_error(bs, lo_s - lo, step_s, inv_s, QMAX)
            take = err < best
            best = tl.where(take, err, best)
            best_lo = tl.where(take, lo_s, best_lo)
            best_step = tl.where(take, step_s, best_step)
        shift = best_lo - lo
        lo = best_lo
        step = best_step
    codes = _rtn_codes(bs, shift, step, QMAX).to(tl.int32)

    scale = r * step
    zero = r * lo
    amax = tl.maximum(tl.max(tl.abs(scale), axis=0), tl.max(tl.abs(zero), axis=0))
    e = frexp_exponent(amax)
    e = tl.where((e > ROW_EXP_LO) & (e <= ROW_EXP_HI), 0, e)
    scale = scale * pow2(-e)
    zero = zero * pow2(-e)
    col = c * pow2(e) * pow2(p)

    packed = tl.reshape(codes, (P, R // P, C))
    shifts = (tl.arange(0, P) * BITS)[:, None, None]
    packed = tl.sum(packed << shifts, axis=0).to(tl.uint8)  # [R // P, C]
    rows_p = tl.arange(0, R // P)
    cols = tl.arange(0, C)
    tl.store(out + CODE_OFF + rows_p[:, None] * C + cols[None, :], packed)
    rows = tl.arange(0, R)
    tl.store((out + SCALE_OFF).to(tl.pointer_type(tl.float16)) + rows, scale.to(tl.float16))
    tl.store((out + ZERO_OFF).to(tl.pointer_type(tl.float16)) + rows, zero.to(tl.float16))
    tl.store((out + COL_OFF).to(tl.pointer_type(tl.int16)) + cols, bf16_bits(col))


@triton.jit
def _smoothing_vector(xm, SKIP: tl.constexpr):
    """``s: [D]`` fp32 (fp8 e4m3 values) of the model-frame tile ``xm: [G, D]`` without its first ``SKIP`` tokens.

    ``s = fp8(clamp(sqrt(std / max std), SMOOTH_MIN, 1))``, ``std`` per channel over the tokens
    (``kvarn.reference.smooth.smoothing_vector``).
    """
    G: tl.constexpr = xm.shape[0]
    used = (tl.arange(0, G) >= SKIP)[:, None]
    count = tl.sum(used.to(tl.float32), axis=0)  # [1]: G - SKIP, divided by correctly rounded (div_rn)
    mean = tl.div_rn(tl.sum(tl.where(used, xm, 0.0), axis=0), count)
    dev = tl.where(used, xm - mean[None, :], 0.0)
    std = tl.sqrt_rn(tl.div_rn(tl.sum(dev * dev, axis=0), count))  # [D], correction 0
    top = tl.max(std, axis=0)
    rel = tl.where(top > 0.0, tl.div_rn(std, tl.where(top > 0.0, top, 1.0)), 1.0)
    return fp8e4m3_round(tl.minimum(tl.maximum(tl.sqrt_rn(rel), SMOOTH_MIN), 1.0))  # SMOOTH_EXP = 0.5


@triton.jit
def _stored_vector(s_src, D: tl.constexpr):
    """The fp8 smoothing vector at ``s_src`` as ``reference.smooth.stored_smoothing_vector`` reads it:
    NaN bytes and values below ``SMOOTH_MIN`` -> ``SMOOTH_MIN``, above 1 -> 1."""
    byte = tl.load(s_src + tl.arange(0, D))
    s = tl.minimum(tl.maximum(fp8e4m3_to_f32(byte), SMOOTH_MIN), 1.0)
    return tl.where((byte.to(tl.int32) & 0x7F) == 0x7F, SMOOTH_MIN, s)


@triton.jit
def _smooth_tile(x, dst, INV_SQRT_D: tl.constexpr, SKIP: tl.constexpr = 0, s_src=None):
    """Smooth one rotated K tile ``x: [G, D]`` fp32 (``kvarn.reference.smooth``); its ``s: [D]`` fp8 bytes to ``dst``.

    ``s`` is the fp8 vector at ``s_src`` where given, else the tile's own (:func:`_smoothing_vector`
    without its first ``SKIP`` tokens). Returns ``rotate(rotate(x) / s)``.
    """
    D: tl.constexpr = x.shape[1]
    xm = fwht_rows(x, INV_SQRT_D)  # [G, D] model frame
    if s_src is None:
        s = _smoothing_vector(xm, SKIP)
    else:
        s = _stored_vector(s_src, D)
    tl.store(dst + tl.arange(0, D), fp8e4m3_bits(s))
    return fwht_rows(tl.div_rn(xm, s[None, :]), INV_SQRT_D)


@triton.jit
def _smooth_tile_tc(x, dst, s_src, INV_SQRT_D: tl.constexpr):
    """:func:`_smooth_tile` with the vector at ``s_src`` for ``D <= 128``, its rotations on tensor cores.

    ``x`` is pool-form (fp16/bf16 values times a power of two), so ``x H`` has exact products; the
    rotation back takes ``rotate(x) / s`` as a hi/lo pair of tf32 parts (the low part truncated: a
    relative error ~2^-21). Only the order of the fp32 sums differs from the reference's butterflies,
    so the tile matches it to fp32 rounding, not bit for bit; ``s`` (read, not computed) is exact.
    """
    D: tl.constexpr = x.shape[1]
    s = _stored_vector(s_src, D)
    tl.store(dst + tl.arange(0, D), fp8e4m3_bits(s))
    y = tl.div_rn(rotate_rows(x, D, INV_SQRT_D), s[None, :])
    return hdot(y, hadamard_pm(D)) * INV_SQRT_D


@triton.jit
def _load_tile(base, s_tok, LAYOUT: tl.constexpr, IS_BF16: tl.constexpr):
    """Load one prepared tile ``[G, D]`` (tokens, channels, pool form) as the fp32 values it stands for."""
    tok = tl.arange(0, LAYOUT.G)
    ch = tl.arange(0, LAYOUT.D)
    return load_f32(base + tok[:, None] * s_tok + ch[None, :], None, IS_BF16) * pool_factor(LAYOUT.D, IS_BF16)


@triton.jit
def _encode_kernel(
    k_src,
    v_src,
    src_idx,
    s_tile,
    s_tok,
    s_head,
    dst,
    dst_idx,
    d_block,
    d_head,
    smooth_src,
    HAS_SRC_IDX: tl.constexpr,
    HAS_DST_IDX: tl.constexpr,
    HAS_SMOOTH_SRC: tl.constexpr,
    SMOOTH_PHASE: tl.constexpr,
    IS_BF16: tl.constexpr,
    LAYOUT: tl.constexpr,
    ITERS: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    K_CLIP_UNIT: tl.constexpr,
    K_CLIP_COUNT: tl.constexpr,
    V_CLIP_UNIT: tl.constexpr,
    V_CLIP_COUNT: tl.constexpr,
):
    """Grid ``(N, Hkv, 2)``: tile ``i``, head ``h``, half (0 = K, 1 = V) -> its part of one record.

    With ``LAYOUT.K_SMOOTH >= 0`` the K program smooths its tile first and writes ``k_smooth``:
    with its own vector, or (``LAYOUT.SEQ_SMOOTH`` and ``HAS_SMOOTH_SRC``) the one in record
    ``smooth_src[i]``, which an earlier launch with ``SMOOTH_PHASE = 0`` (grid ``(N, Hkv, 1)``)
    wrote for the first tiles (``smooth_src[i]`` = own block). Without ``smooth_src`` a
    ``SEQ_SMOOTH`` tile is taken as the first of its sequence.
    """
    L: tl.constexpr = LAYOUT
    i = tl.program_id(0)
    h = tl.program_id(1)
    half = tl.program_id(2)
    if HAS_SRC_IDX:
        t = tl.load(src_idx + i).to(tl.int64)
    else:
        t = i.to(tl.int64)
    if HAS_DST_IDX:
        blk = tl.load(dst_idx + i).to(tl.int64)
    else:
        blk = i.to(tl.int64)
    off = t * s_tile + h.to(tl.int64) * s_head
    out = dst + blk * d_block + h.to(tl.int64) * d_head
    SKIP: tl.constexpr = SEQ_SMOOTH_SKIP if L.SEQ_SMOOTH else 0
    FROM_SRC: tl.constexpr = L.SEQ_SMOOTH and HAS_SMOOTH_SRC
    if FROM_SRC:
        src_blk = tl.load(smooth_src + i).to(tl.int64)
        src_rec = dst + src_blk * d_block + h.to(tl.int64) * d_head
    if SMOOTH_PHASE == 0:
        tl.static_assert(FROM_SRC, "SMOOTH_PHASE 0 is for per-sequence smoothing with smooth_src")
        if (t >= 0) & (src_blk == blk):  # a first tile publishes its sequence's vector
            xm = fwht_rows(_load_tile(k_src + off, s_tok, L, IS_BF16), INV_SQRT_D)
            tl.store(out + L.K_SMOOTH + tl.arange(0, L.D), fp8e4m3_bits(_smoothing_vector(xm, SKIP)))
    elif t >= 0:  # a negative source (padding of a fixed-size commit list) writes nothing
        if half == 0:
            x = _load_tile(k_src + off, s_tok, L, IS_BF16)  # [G, D]
            if FROM_SRC and L.D <= 128:
                x = _smooth_tile_tc(x, out + L.K_SMOOTH, src_rec + L.K_SMOOTH, INV_SQRT_D)
            elif FROM_SRC:
                x = _smooth_tile(x, out + L.K_SMOOTH, INV_SQRT_D, SKIP, src_rec + L.K_SMOOTH)
            elif L.K_SMOOTH >= 0:
                x = _smooth_tile(x, out + L.K_SMOOTH, INV_SQRT_D, SKIP)
            _encode_half(
                tl.trans(x),
                out,
                L.D,
                L.G,
                L.K_BITS,
                ITERS,
                L.K_CODES,
                L.K_SCALE,
                L.K_ZERO,
                L.K_TOK,
                K_CLIP_UNIT,
                K_CLIP_COUNT,
            )
        else:
            x = _load_tile(v_src + off, s_tok, L, IS_BF16)  # [G, D]
            _encode_half(
                x, out, L.G, L.D, L.V_BITS, ITERS, L.V_CODES, L.V_SCALE, L.V_ZERO, L.V_CHAN, V_CLIP_UNIT, V_CLIP_COUNT
            )


def default_encode_warps(cfg: KVarNConfig) -> int:
    """Warps per program of the encode kernel unless the caller picks them (see ``ENCODE_SMALL_TILE``)."""
    return 4 if cfg.head_dim * cfg.group_size <= ENCODE_SMALL_TILE and not cfg.smooth_keys else 8


def _launch_encode(
    k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs=None, smooth_src=None
) -> None:
    if n_tiles == 0 or n_heads == 0:
        return
    src_idx, dst_idx, smooth_src = index_list(src_idx), index_list(dst_idx), index_list(smooth_src)
    if smooth_src is not None:  # per-sequence vectors: the first tiles publish theirs first
        _launch_encode_phase(
            k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, None, smooth_src, 0
        )
    _launch_encode_phase(
        k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs, smooth_src, 1
    )


def _launch_encode_phase(
    k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs, smooth_src, phase=1
) -> None:
    iters = cfg.sinkhorn_iters if cfg.normalize else 0
    _encode_kernel[(n_tiles, n_heads, 2 if phase else 1)](
        k,
        v,
        src_idx if src_idx is not None else k,
        strides[0],
        strides[1],
        strides[2],
        dst,
        dst_idx if dst_idx is not None else dst,
        d_strides[0],
        d_strides[1],
        smooth_src if smooth_src is not None else dst,
        HAS_SRC_IDX=src_idx is not None,
        HAS_DST_IDX=dst_idx is not None,
        HAS_SMOOTH_SRC=smooth_src is not None,
        SMOOTH_PHASE=phase,
        IS_BF16=k.dtype == torch.bfloat16,
        LAYOUT=record_layout(cfg),
        ITERS=iters,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        K_CLIP_UNIT=(cfg.k_clip or (1, 1))[0],
        K_CLIP_COUNT=(cfg.k_clip or (1, 1))[1],
        V_CLIP_UNIT=(cfg.v_clip or (1, 1))[0],
        V_CLIP_COUNT=(cfg.v_clip or (1, 1))[1],
        num_warps=num_warps or default_encode_warps(cfg),
        maxnreg=max_regs,
    )


def _check_kv_tiles(k: torch.Tensor, v: torch.Tensor, cfg: KVarNConfig, layout: str) -> None:
    check_dtype("k", k)
    if v.dtype != k.dtype or v.shape != k.shape or v.device != k.device:
        raise ValueError(
            f"k and v must match in shape, dtype and device, got {tuple(k.shape)} {k.dtype} and "
            f"{tuple(v.shape)} {v.dtype}"
        )
    g_axis = -2 if layout == "tiles" else 1
    if k.dim() < (2 if layout == "tiles" else 4) or k.shape[-1] != cfg.head_dim or k.shape[g_axis] != cfg.group_size:
        want = "[..., G, D]" if layout == "tiles" else "[N, G, Hkv, D]"
        raise ValueError(
            f"k must have shape {want} with G = {cfg.group_size} and D = {cfg.head_dim}, got {tuple(k.shape)}"
        )


def encode_records(
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: KVarNConfig,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
) -> torch.Tensor:
    """Prepared tiles ``k, v: [..., G, D]`` (rotated, fp16/bf16, pool form) -> records ``[..., record_bytes]`` uint8.

    Knobs (keyword only, as for every store op): ``num_warps`` of the encode kernel (default
    :func:`default_encode_warps`) and ``max_regs``, its register cap per thread (default: none,
    ptxas picks); ``empty`` allocates
    outputs and workspaces (``torch.empty``'s signature; tests pass one that pre-fills them).
    """
    _check_kv_tiles(k, v, cfg, "tiles")
    lead = k.shape[:-2]
    kf = k.reshape(-1, cfg.group_size, cfg.head_dim).contiguous()
    vf = v.reshape(-1, cfg.group_size, cfg.head_dim).contiguous()
    n = kf.shape[0]
    out = empty(n, cfg.record_bytes, dtype=torch.uint8, device=k.device)
    strides = (kf.stride(0), kf.stride(1), 0)
    _launch_encode(kf, vf, None, n, 1, strides, out, None, (out.stride(0), 0), cfg, num_warps, max_regs)
    return out.reshape(*lead, cfg.record_bytes)


def commit_tiles(
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
) -> None:
    """Quantize full pool tiles ``tail_*[tail_slots[i]]`` (``[num_slots, G, Hkv, D]``) into ``cache[block_ids[i]]``.

    Entries with a negative slot are skipped: their programs exit at once (a fixed-size list's padding).
    ``smooth_src: [N]`` as in :func:`kvarn.reference.commit_tiles` (per-sequence smoothing only).
    """
    check_cache(cache, cfg)
    _check_pool(tail_k, tail_v, cache, cfg)
    if tail_slots.shape != block_ids.shape or tail_slots.dim() != 1:
        raise ValueError(
            f"tail_slots and block_ids must be [N] of one length, got {tuple(tail_slots.shape)} and "
            f"{tuple(block_ids.shape)}"
        )
    _check_smooth_src(smooth_src, block_ids, cfg)
    n = tail_slots.shape[0]
    strides = (tail_k.stride(0), tail_k.stride(1), tail_k.stride(2))
    _launch_encode(
        tail_k,
        tail_v,
        tail_slots,
        n,
        cache.shape[1],
        strides,
        cache,
        block_ids,
        (cache.stride(0), cache.stride(1)),
        cfg,
        num_warps,
        max_regs,
        smooth_src,
    )


def store_tiles(
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
) -> None:
    """Quantize whole model-frame tiles ``k, v: [N, G, Hkv, D]`` into ``cache[block_ids]``, in place.

    ``smooth_src: [N]`` as in :func:`kvarn.reference.store_tiles` (per-sequence smoothing only).

    Runs the :func:`write_tail` kernel into a ``[N, G, Hkv, D]`` workspace, then the
    :func:`commit_tiles` encoder: the same kernels as the tail path, so a tile gets the same bytes
    whichever path completed it (the extra pass costs 2 x 2 bytes per element of memory traffic,
    small next to the encoder's arithmetic).
    """
    check_cache(cache, cfg)
    _check_kv_tiles(k, v, cfg, "store")
    if k.dim() != 4 or k.shape[2] != cache.shape[1]:
        raise ValueError(f"k must be [N, G, Hkv, D] with Hkv = {cache.shape[1]}, got {tuple(k.shape)}")
    if block_ids.dim() != 1 or block_ids.shape[0] != k.shape[0]:
        raise ValueError(f"block_ids must be [N] with N = {k.shape[0]}, got {tuple(block_ids.shape)}")
    _check_smooth_src(smooth_src, block_ids, cfg)
    n, g, hkv, d = k.shape
    if n == 0:
        return
    work_k = empty((n, g, hkv, d), dtype=k.dtype, device=k.device)
    work_v = empty((n, g, hkv, d), dtype=k.dtype, device=k.device)
    mapping = torch.arange(n * g, device=k.device)
    write_tail(k.reshape(n * g, hkv, d), v.reshape(n * g, hkv, d), work_k, work_v, mapping, cfg)
    strides = (work_k.stride(0), work_k.stride(1), work_k.stride(2))
    tiles = torch.arange(n, dtype=torch.int32, device=k.device)  # same kernel variant as commit_tiles
    d_strides = (cache.stride(0), cache.stride(1))
    _launch_encode(
        work_k, work_v, tiles, n, hkv, strides, cache, block_ids, d_strides, cfg, num_warps, max_regs, smooth_src
    )


def _check_smooth_src(smooth_src: torch.Tensor | None, block_ids: torch.Tensor, cfg: KVarNConfig) -> None:
    """Raise unless ``smooth_src`` is given exactly for a ``seq_smooth`` format, shaped like ``block_ids``."""
    if cfg.seq_smooth != (smooth_src is not None):
        raise ValueError(
            "smooth_src (each tile's sequence's first block id) is needed by, and only by, smooth_scope='sequence' "
            f"formats; {cfg.name} has smooth_scope={cfg.smooth_scope!r}, smooth_keys={cfg.smooth_keys}"
        )
    if smooth_src is not None and (smooth_src.shape != block_ids.shape or smooth_src.device != block_ids.device):
        raise ValueError(
            f"smooth_src must be shaped like block_ids {tuple(block_ids.shape)} on its device, got "
            f"{tuple(smooth_src.shape)} on {smooth_src.device}"
        )


def _check_pool(tail_k: torch.Tensor, tail_v: torch.Tensor, cache: torch.Tensor, cfg: KVarNConfig) -> None:
    check_dtype("tail_k", tail_k)
    if tail_v.dtype != tail_k.dtype or tail_v.shape != tail_k.shape or tail_v.stride() != tail_k.stride():
        raise ValueError("tail_k and tail_v must match in shape, dtype and strides")
    want = (cfg.group_size, cache.shape[1], cfg.head_dim)
    if tail_k.dim() != 4 or tuple(tail_k.shape[1:]) != want:
        raise ValueError(f"tail_k must be [num_slots, {', '.join(map(str, want))}], got {tuple(tail_k.shape)}")
    if tail_k.stride(-1) != 1:
        raise ValueError("tail_k must be contiguous along head_dim")


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


def write_tail(
    k: torch.Tensor,
    v: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    cfg: KVarNConfig,
) -> None:
    """``prepare`` new tokens ``k, v: [T, Hkv, D]`` into the pool at ``tail_slot_mapping: [T]`` (``slot * R + offset``).

    ``R = tail_k.shape[1]``: ``G`` for a pool ``[num_slots, G, Hkv, D]``, fewer for tails kept as rows of a
    cache's blocks (``kvarn.paged.PagedKV.tail_block_view``). A negative mapping entry skips its token. The
    pool holds the pool form (:func:`kvarn.reference.prepare`: an fp16 pool the rotated values times
    ``1 / pool_factor``).
    Eager calls replay a launch plan per call shape (:data:`WRITE_TAIL_PLANS`, :mod:`kvarn.kernels._plan`).
    """
    inputs = (k, v, tail_k, tail_v, tail_slot_mapping)
    return WRITE_TAIL_PLANS.call(
        lambda: (cfg,),
        inputs,
        lambda empty: _write_tail(k, v, tail_k, tail_v, tail_slot_mapping, cfg),
    )


WRITE_TAIL_PLANS = _plan.Planner()
"""Launch plans of :func:`write_tail` (``WRITE_TAIL_PLANS.enabled = False`` turns replays off)."""


def _write_tail(k, v, tail_k, tail_v, tail_slot_mapping, cfg: KVarNConfig) -> None:
    """:func:`write_tail` itself (the launcher its plans record)."""
    check_dtype("k", k)
    check_dtype("tail_k", tail_k)
    if v.shape != k.shape or v.dtype != k.dtype or k.dim() != 3 or k.shape[-1] != cfg.head_dim:
        raise ValueError(f"k and v must both be [T, Hkv, {cfg.head_dim}] of one dtype, got {tuple(k.shape)}")
    if tail_v.dtype != tail_k.dtype or tail_v.shape != tail_k.shape or tail_v.stride() != tail_k.stride():
        raise ValueError("tail_k and tail_v must match in shape, dtype and strides")
    if tail_k.dim() != 4 or not 0 < tail_k.shape[1] <= cfg.group_size or tail_k.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"tail_k must be [num_slots, rows <= {cfg.group_size}, {k.shape[1]}, {cfg.head_dim}], "
            f"got {tuple(tail_k.shape)}"
        )
    if tail_slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"tail_slot_mapping must be [T] with T = {k.shape[0]}, got {tuple(tail_slot_mapping.shape)}")
    if k.shape[0] == 0:
        return
    if k.stride() != v.stride() or k.stride(-1) != 1:  # one set of strides for both (vLLM's views of qkv share them)
        k, v = k.contiguous(), v.contiguous()
    tail_slot_mapping = index_list(tail_slot_mapping)
    if tail_k.stride(-1) != 1:
        raise ValueError("tail_k must be contiguous along head_dim")
    n_heads = k.shape[1]
    n_rows = k.shape[0] * n_heads
    _plan.launch(
        _prepare_kernel,
        (cdiv(n_rows, PREPARE_ROWS), 2),
        k,
        v,
        tail_k,
        tail_v,
        tail_slot_mapping,
        n_rows,
        n_heads,
        k.stride(0),
        k.stride(1),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        LAYOUT=record_layout(cfg),
        ROWS=PREPARE_ROWS,
        ROTATE=cfg.rotate,
        IN_BF16=k.dtype == torch.bfloat16,
        POOL_BF16=tail_k.dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        SLOT_ROWS=tail_k.shape[1],
        num_warps=4,
    )


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


GATHER_ROWS = 32
"""(token, head) rows per program of :func:`gather_tail_tiles`."""


def gather_tail_tiles(
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
    tables: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Copy whole tiles kept as block rows into pool slots. See :func:`kvarn.reference.gather_tail_tiles`.

    One launch of ``len(slots)`` programs per ``GATHER_ROWS`` rows; padding entries (negative slots)
    exit at once, so a captured graph can launch a fixed-size list.
    """
    check_dtype("tail_k", tail_k)
    g, heads, d = tail_k.shape[1:]
    for name, x in (("rows_k", rows_k), ("rows_v", rows_v), ("tail_v", tail_v)):
        if x.dtype != tail_k.dtype or x.dim() != 4 or tuple(x.shape[2:]) != (heads, d) or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [*, *, {heads}, {d}] {tail_k.dtype} with unit last stride")
    if rows_v.shape != rows_k.shape or rows_v.stride() != rows_k.stride() or tail_v.stride() != tail_k.stride():
        raise ValueError("rows_k and rows_v, tail_k and tail_v must match in shape and strides")
    rows = rows_k.shape[1]
    if tables.dim() != 2 or tables.shape[1] * rows < g:
        raise ValueError(f"tables must be [num_slots, N] with N * {rows} >= {g}, got {tuple(tables.shape)}")
    if slots.dim() != 1:
        raise ValueError(f"slots must be [N], got {tuple(slots.shape)}")
    if slots.numel() == 0:
        return
    tables, slots = index_list(tables), index_list(slots)
    _plan.launch(
        _gather_tiles_kernel,
        (slots.shape[0], cdiv(g * heads, GATHER_ROWS), 2),
        rows_k,
        rows_v,
        tables,
        tail_k,
        tail_v,
        slots,
        heads,
        tables.stride(0),
        rows_k.stride(0),
        rows_k.stride(1),
        rows_k.stride(2),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        G=g,
        D=d,
        R=rows,
        ROWS=GATHER_ROWS,
        num_warps=4,
    )
