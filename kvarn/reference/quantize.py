"""One tile half from rotated values to codes and stored parameters, and back.

A *tile half* is the K or the V part of one tile, oriented so that its rows are what gets one
pair of RTN parameters: ``M: [..., R, C]`` with ``R = D, C = G`` for K (rows are channels) and
``R = G, C = D`` for V (rows are tokens). Stages, each in its own module::

    p           = tiny-tile exponent (see below)          0 for ordinary tiles
    M           = M / 2^p
    (r, c)      = sinkhorn(M, iters)                      normalize.py
    c           = bf16(c)                                 rounded first, so its rounding is exact
    B           = M / (r c^T)
    (lo, step)  = choose_qparams(B, bits, clip)           rtn.py (clip: 2-bit halves, KVarNConfig.clip)
    codes       = quantize_rows(B, lo, step, bits)        rtn.py
    scale, zero = r * step, r * lo                        folded into one pair per row
    e           = range guard (see below)
    stored      = fp16(scale / 2^e), fp16(zero / 2^e), bf16(c * 2^e * 2^p), codes

Reconstruction: ``M~[i, j] = (codes[i, j] * scale[i] + zero[i]) * c[j]`` (``dequant.py``).

Range guard. The row parameters are stored in fp16, the column scales in bf16. When the largest
row parameter of a tile half falls outside ``[2^-8, 2^15)``, the power of two ``2^e`` that brings
it to ``[0.5, 1)`` moves from the row parameters to the column scales. The product is unchanged
(powers of two scale exactly), ordinary tiles are stored exactly as the method states, and no
finite input can overflow fp16 or sink into its subnormals wholesale.

Tiny tiles. The method's absolute floors (the RTN step floor ``1e-10``, the imbalance floor
``1e-8``) were set for values of ordinary size: below a largest ``|M|`` of about ``1e-9`` they
dominate, and a tile of ``randn * 1e-20`` would round to zeros. A tile half whose largest ``|M|``
is below ``2^TINY_EXP`` (``2^-24``, 64x above where the floors start to cost accuracy) is first
divided by the power of two ``2^p`` that brings its largest value to ``[1, 2)``, and ``2^p`` is
folded into its column scales: exact, and a no-op (``p = 0``) for every other tile. ``p`` is
bounded below by ``-126`` so ``2^-p`` is a normal fp32 number; the column scales, bf16 with
fp32's exponent range, stay normal down to inputs of about ``2^-120``.

Input policy (:func:`prepare`): NaN becomes 0 and values are saturated to ``+-MAX_ABS`` (2^24,
far past any KV value of a working model, and small enough that every fp32 statistic of a
rotated tile stays finite).

Pool form. Prepared values are what the full-precision tail pool holds, in the pool's dtype. The
rotation can grow a value by up to ``sqrt(D)`` (``|x H|_inf <= |x|_2 <= sqrt(D) |x|_inf``), so an
fp16 pool holds the rotated values times ``2^-POOL_EXP`` with ``POOL_EXP = ceil(log2 sqrt(D))``
(:func:`pool_exponent`: 3 at D = 64, 4 at D = 128 and 256): every finite fp16 input then rotates
to a storable value, never to a saturated one. Scaling by a power of two is exact, so a rotated
value ``y`` with ``|y| >= 2^(POOL_EXP - 14)`` is stored exactly as rounding ``y`` to fp16 would
store it; only smaller ones, which land in fp16's subnormals, keep an absolute error of at most
``2^(POOL_EXP - 25)`` (``2^-21`` at D = 128) instead of ``2^-25``. bf16 and fp32 pools have
fp32's range and store the values as they are (``POOL_EXP = 0``). Every reader undoes the factor
(:func:`from_pool`). ``kvarn.quantize`` refuses NaN and inf instead and scales tiles that
would saturate (:func:`input_exponent`); the store path, which cannot raise in the middle of a
model step, applies this policy so nothing non-finite is stored.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvarn.reference.dequant import dequantize_rows
from kvarn.reference.hadamard import rotate
from kvarn.reference.normalize import sinkhorn
from kvarn.reference.rtn import choose_qparams, quantize_rows

MAX_ABS_EXP = 24
MAX_ABS = 2.0**MAX_ABS_EXP
"""Inputs are saturated to [-MAX_ABS, MAX_ABS] before rotation."""
ROW_PARAM_RANGE = (-8, 15)
"""A tile half's largest row parameter is kept in [2^-8, 2^15) (see the range guard)."""
TINY_EXP = -24
"""A tile half whose largest ``|value|`` is below ``2^TINY_EXP`` is rescaled first (tiny tiles)."""
TINY_TARGET_EXP = 1
"""... by the power of two that brings its largest ``|value|`` to ``[2^(TINY_TARGET_EXP - 1), 2^TINY_TARGET_EXP)``."""
MIN_EXP = -126
"""Smallest exponent of a normal fp32 number: bounds every power of two applied here."""
ROW_DTYPE = torch.float16
COL_DTYPE = torch.bfloat16


class TileHalf(NamedTuple):
    """The quantized form of tile halves ``[..., R, C]``: unpacked codes and stored parameters."""

    codes: torch.Tensor  # [..., R, C] uint8
    scale: torch.Tensor  # [..., R] fp16
    zero: torch.Tensor  # [..., R] fp16
    col: torch.Tensor  # [..., C] bf16
    smooth: torch.Tensor | None = None  # [..., D] fp8: the K half's smoothing vector (smooth_keys only)


def pool_exponent(dtype: torch.dtype, head_dim: int) -> int:
    """``POOL_EXP``: a pool of ``dtype`` holds rotated values times ``2^-POOL_EXP`` (see "Pool form").

    ``ceil(log2 sqrt(head_dim))`` for fp16 (3 at 64, 4 at 128 and 256), 0 for every other dtype.
    """
    return int(head_dim).bit_length() // 2 if dtype == torch.float16 else 0


def from_pool(x: torch.Tensor) -> torch.Tensor:
    """Prepared (pool-form) values ``x: [..., D]`` -> the rotated values they stand for, fp32 (exact)."""
    exp = pool_exponent(x.dtype, x.shape[-1])
    x = x.to(torch.float32)
    return x * 2.0**exp if exp else x


def prepare(x: torch.Tensor, dtype: torch.dtype | None = None, rotate_: bool = True) -> torch.Tensor:
    """Sanitize, rotate and round ``x: [..., D]`` to ``dtype`` (default ``x.dtype``): the quantizer's input.

    NaN -> 0, saturate to ``+-MAX_ABS``, ``@ H`` in fp32 (skipped if ``rotate_`` is false), times
    ``2^-POOL_EXP`` (the pool form, :func:`pool_exponent`; fp16 only), then saturate to the finite
    range of ``dtype`` and round to it. Every path that stores K/V (the fp16 tail, a full tile,
    ``kvarn.quantize``) goes through this, so a tile quantizes to the same bytes whichever path
    completed it; the encoders read it back through :func:`from_pool`.
    """
    dtype = dtype or x.dtype
    y = torch.nan_to_num(x.to(torch.float32), nan=0.0).clamp(-MAX_ABS, MAX_ABS)
    if rotate_:
        y = rotate(y)
    exp = pool_exponent(dtype, x.shape[-1])
    if exp:
        y = y * 2.0**-exp
    finite = torch.finfo(dtype).max
    return y.clamp(-finite, finite).to(dtype)


def range_exponent(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The range guard's exponent ``e: [...]`` (int32) for row parameters ``[..., R]`` in fp32."""
    amax = torch.maximum(scale.abs().amax(-1), zero.abs().amax(-1))
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1); exp = 0 for amax = 0
    lo, hi = ROW_PARAM_RANGE
    inside = (exp > lo) & (exp <= hi)
    return torch.where(inside, torch.zeros_like(exp), exp)


def tiny_exponent(m: torch.Tensor) -> torch.Tensor:
    """The tiny-tile exponent ``p: [...]`` (int32) of tile halves ``m: [..., R, C]``; 0 unless tiny."""
    amax = m.abs().amax((-2, -1))
    _, exp = torch.frexp(amax)
    tiny = (amax > 0) & (amax < 2.0**TINY_EXP)
    return torch.where(tiny, (exp - TINY_TARGET_EXP).clamp_min(MIN_EXP), torch.zeros_like(exp))


def quantize_half(
    m: torch.Tensor, bits: int, iters: int = 8, normalize: bool = True, clip: tuple[int, int] | None = None
) -> TileHalf:
    """Quantize tile halves ``m: [..., R, C]`` (rotated and oriented) with ``bits`` per code.

    ``normalize=False`` skips the Sinkhorn stage (all scales 1): plain per-row RTN. ``clip=(unit, count)``
    lets each row pick a clipped range (:func:`~kvarn.reference.rtn.choose_qparams`).
    """
    m = m.to(torch.float32)
    if m.numel() == 0:  # no tiles: empty outputs of the right shapes
        rows, cols = m.shape[:-1], m.shape[:-2] + m.shape[-1:]
        return TileHalf(
            m.to(torch.uint8),
            m.new_empty(rows, dtype=ROW_DTYPE),
            m.new_empty(rows, dtype=ROW_DTYPE),
            m.new_empty(cols, dtype=COL_DTYPE),
        )
    p = tiny_exponent(m)[..., None].float()
    m = torch.ldexp(m, -p[..., None])
    if normalize:
        r, c = sinkhorn(m, iters)
    else:
        r = m.new_ones(m.shape[:-1])
        c = m.new_ones(m.shape[:-2] + m.shape[-1:])
    c = c.to(COL_DTYPE).to(torch.float32)
    b = m / (r[..., :, None] * c[..., None, :])
    lo, step = choose_qparams(b, bits, clip)
    codes = quantize_rows(b, lo, step, bits)
    scale, zero = r * step, r * lo
    e = range_exponent(scale, zero)[..., None].float()
    scale = torch.ldexp(scale, -e).to(ROW_DTYPE)
    zero = torch.ldexp(zero, -e).to(ROW_DTYPE)
    col = torch.ldexp(torch.ldexp(c, e), p).to(COL_DTYPE)  # two exact steps, as the kernel does
    return TileHalf(codes, scale, zero, col)


def dequantize_half(half: TileHalf) -> torch.Tensor:
    """``TileHalf`` -> reconstructed tile halves ``[..., R, C]`` in fp32 (rotated frame)."""
    return dequantize_rows(half.codes, half.scale, half.zero, half.col)


def scale_half(half: TileHalf, exp: torch.Tensor) -> TileHalf:
    """``half`` with its column scales times ``2^exp`` (``exp: [...]`` int): it reconstructs ``2^exp`` times the tiles.

    Exact while the scaled column scales stay normal bf16 numbers.
    """
    col = torch.ldexp(half.col.float(), exp[..., None].float().to(half.col.device)).to(COL_DTYPE)
    return half._replace(col=col)


def input_exponent(x: torch.Tensor, dtype: torch.dtype | None = None, rotate_: bool = True) -> torch.Tensor:
    """Per tile, the power of two ``s: [...]`` (int32) that ``kvarn.quantize`` divides tiles ``x: [..., G, D]`` by.

    ``s`` is 0 for every tile that :func:`prepare` stores as it is, so those tiles keep the bytes
    the caches store. It is not 0 where ``prepare(x, dtype)`` would lose the tile:

    - ``max |x| > MAX_ABS`` (fp32 or bf16 values past 2^24 would saturate): ``s`` brings the
      largest value under ``2^24``;
    - ``0 < max |x|`` below ``2^POOL_EXP`` times the smallest normal number of ``dtype`` (fp16
      values under ``2^(POOL_EXP - 14)``, ``2^-10`` at D = 128, whose rotation would be stored in
      fp16 subnormals): ``s`` (negative) brings it to ``[1, 2)``;
    - ``max |x H|`` past what the pool form of ``dtype`` holds (``2^POOL_EXP`` times its finite
      maximum): ``s`` brings the rotated tile under it. No input of ``dtype`` itself gets there
      (``|x H|_inf <= sqrt(D) |x|_inf``); only values wider than ``dtype`` do.

    The caller stores ``x / 2^s`` and folds ``2^s`` into the column scales (:func:`scale_half`).
    """
    dtype = dtype or x.dtype
    x = x.to(torch.float32)
    info = torch.finfo(dtype)
    pool_exp = pool_exponent(dtype, x.shape[-1])
    limit = info.max * 2.0**pool_exp  # the largest rotated value the pool form stores unsaturated
    amax = x.abs().amax((-2, -1))
    _, exp = torch.frexp(amax)
    s = torch.where(amax > MAX_ABS, exp - MAX_ABS_EXP, torch.zeros_like(exp))
    tiny = (amax > 0) & (amax < info.tiny * 2.0**pool_exp)
    s = torch.where(tiny, (exp - TINY_TARGET_EXP).clamp_min(MIN_EXP), s)
    scaled_max = torch.ldexp(amax, -s.float())
    if rotate_ and bool((scaled_max * x.shape[-1] ** 0.5 > limit).any()):  # |x H| <= sqrt(D) max |x|
        rot = rotate(torch.ldexp(x, -s[..., None, None].float())).abs().amax((-2, -1))
        _, rot_exp = torch.frexp(rot)
        top = math.frexp(info.max)[1] - 1 + pool_exp  # 2^top <= limit
        s = torch.where(rot > limit, s + rot_exp - top, s)
    return s
