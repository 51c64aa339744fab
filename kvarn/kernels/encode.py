"""The encode kernel: prepared tiles -> cache records (normalize, round, pack, write), one launch.

One program encodes one tile half (the K or the V part of one tile of one KV head) and writes it
straight into its record; a launch covers every (tile, head, half) of the call. The host side is
:mod:`kvarn.kernels.store`. The math mirrors :mod:`kvarn.reference.quantize` stage by stage, in fp32:

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

import triton
import triton.language as tl

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
    bf16_bits,
    bf16_round,
    fp8e4m3_bits,
    fp8e4m3_round,
    fp8e4m3_to_f32,
    frexp_exponent,
    fwht_rows,
    hadamard_pm,
    hdot,
    load_f32,
    pool_factor,
    pow2,
    rotate_rows,
)

TINY = tl.constexpr(2.0**-24)  # kvarn.reference.quantize: 2^TINY_EXP, TINY_TARGET_EXP, MIN_EXP
TINY_TARGET_EXP = tl.constexpr(1)
MIN_EXP = tl.constexpr(-126)
VAR_MIN = tl.constexpr(STD_MIN.value * STD_MIN.value)  # the std clamps of the Sinkhorn step, on variances
VAR_MAX = tl.constexpr(STD_MAX.value * STD_MAX.value)
INV_SCALE_MIN = tl.constexpr(math.exp(-LOG_SCALE_MAX.value))  # the log-scale clamps, on reciprocal scales
INV_SCALE_MAX = tl.constexpr(math.exp(-LOG_SCALE_MIN.value))


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
