"""One tile half from rotated values to codes and stored parameters, and back.

A *tile half* is the K or the V part of one tile, oriented so that its rows are what gets one
pair of RTN parameters: ``M: [..., R, C]`` with ``R = D, C = G`` for K (rows are channels) and
``R = G, C = D`` for V (rows are tokens). Stages, each in its own module::

    (r, c)      = sinkhorn(M, iters)                      normalize.py
    c           = bf16(c)                                 rounded first, so its rounding is exact
    B           = M / (r c^T)
    (lo, step)  = choose_qparams(B, bits)                 rtn.py
    codes       = quantize_rows(B, lo, step, bits)        rtn.py
    scale, zero = r * step, r * lo                        folded into one pair per row
    e           = range guard (see below)
    stored      = fp16(scale / 2^e), fp16(zero / 2^e), bf16(c * 2^e), codes

Reconstruction: ``M~[i, j] = (codes[i, j] * scale[i] + zero[i]) * c[j]`` (``dequant.py``).

Range guard. The row parameters are stored in fp16, the column scales in bf16. When the largest
row parameter of a tile half falls outside ``[2^-8, 2^15)``, the power of two ``2^e`` that brings
it to ``[0.5, 1)`` moves from the row parameters to the column scales. The product is unchanged
(powers of two scale exactly), ordinary tiles are stored exactly as the method states, and no
finite input can overflow fp16 or sink into its subnormals wholesale.

Input policy (:func:`prepare`): NaN becomes 0 and values are saturated to ``+-MAX_ABS`` (2^24,
far past any KV value of a working model, and small enough that every fp32 statistic of a
rotated tile stays finite). ``kvarn.quantize`` refuses NaN and inf instead; the store path, which
cannot raise in the middle of a model step, applies this policy so nothing non-finite is stored.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvarn.reference.dequant import dequantize_rows
from kvarn.reference.hadamard import rotate
from kvarn.reference.normalize import sinkhorn
from kvarn.reference.rtn import choose_qparams, quantize_rows

MAX_ABS = 2.0**24
"""Inputs are saturated to [-MAX_ABS, MAX_ABS] before rotation."""
ROW_PARAM_RANGE = (-8, 15)
"""A tile half's largest row parameter is kept in [2^-8, 2^15) (see the range guard)."""
ROW_DTYPE = torch.float16
COL_DTYPE = torch.bfloat16


class TileHalf(NamedTuple):
    """The quantized form of tile halves ``[..., R, C]``: unpacked codes and stored parameters."""

    codes: torch.Tensor  # [..., R, C] uint8
    scale: torch.Tensor  # [..., R] fp16
    zero: torch.Tensor  # [..., R] fp16
    col: torch.Tensor  # [..., C] bf16


def prepare(x: torch.Tensor, dtype: torch.dtype | None = None, rotate_: bool = True) -> torch.Tensor:
    """Sanitize, rotate and round ``x: [..., D]`` to ``dtype`` (default ``x.dtype``): the quantizer's input.

    NaN -> 0, saturate to ``+-MAX_ABS``, ``@ H`` in fp32 (skipped if ``rotate_`` is false), then
    saturate to the finite range of ``dtype`` and round to it. Every path that stores K/V (the
    fp16 tail, a full tile, ``kvarn.quantize``) goes through this, so a tile quantizes to the
    same bytes whichever path completed it.
    """
    dtype = dtype or x.dtype
    y = torch.nan_to_num(x.to(torch.float32), nan=0.0).clamp(-MAX_ABS, MAX_ABS)
    if rotate_:
        y = rotate(y)
    finite = torch.finfo(dtype).max
    return y.clamp(-finite, finite).to(dtype)


def range_exponent(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The range guard's exponent ``e: [...]`` (int32) for row parameters ``[..., R]`` in fp32."""
    amax = torch.maximum(scale.abs().amax(-1), zero.abs().amax(-1))
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1); exp = 0 for amax = 0
    lo, hi = ROW_PARAM_RANGE
    inside = (exp > lo) & (exp <= hi)
    return torch.where(inside, torch.zeros_like(exp), exp)


def quantize_half(m: torch.Tensor, bits: int, iters: int = 8, normalize: bool = True) -> TileHalf:
    """Quantize tile halves ``m: [..., R, C]`` (rotated and oriented) with ``bits`` per code.

    ``normalize=False`` skips the Sinkhorn stage (all scales 1): plain per-row RTN.
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
    if normalize:
        r, c = sinkhorn(m, iters)
    else:
        r = m.new_ones(m.shape[:-1])
        c = m.new_ones(m.shape[:-2] + m.shape[-1:])
    c = c.to(COL_DTYPE).to(torch.float32)
    b = m / (r[..., :, None] * c[..., None, :])
    lo, step = choose_qparams(b, bits)
    codes = quantize_rows(b, lo, step, bits)
    scale, zero = r * step, r * lo
    e = range_exponent(scale, zero)
    scale = torch.ldexp(scale, -e[..., None].float()).to(ROW_DTYPE)
    zero = torch.ldexp(zero, -e[..., None].float()).to(ROW_DTYPE)
    col = torch.ldexp(c, e[..., None].float()).to(COL_DTYPE)
    return TileHalf(codes, scale, zero, col)


def dequantize_half(half: TileHalf) -> torch.Tensor:
    """``TileHalf`` -> reconstructed tile halves ``[..., R, C]`` in fp32 (rotated frame)."""
    return dequantize_rows(half.codes, half.scale, half.zero, half.col)
