"""Constants and small ``@triton.jit`` helpers shared by the KVarN kernels.

The constants mirror :mod:`kvarn.reference.normalize`, :mod:`kvarn.reference.rtn` and
:mod:`kvarn.reference.quantize` (the kernels do not import the reference; a test pins them equal).

:func:`record_layout` turns a :class:`~kvarn.config.KVarNConfig` into the one compile-time constant
every kernel launch passes as ``LAYOUT``: the record's byte layout and the shapes it implies.

Two helpers stand in for conversions the Triton CPU interpreter gets wrong: fp32 -> bf16 casts
(it truncates instead of rounding to nearest even) and bf16 loads and dots. bf16 values travel as
their 16 raw bits in ``int16`` and are converted with integer shifts, which compile to the same
instructions as a cast on the GPU.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

STD_MIN = tl.constexpr(1e-3)
STD_MAX = tl.constexpr(1e3)
LOG_SCALE_MIN = tl.constexpr(-0.3)
LOG_SCALE_MAX = tl.constexpr(10.0)
IMBALANCE_EPS = tl.constexpr(1e-8)
MIN_STEP = tl.constexpr(1e-10)
MAX_ABS = tl.constexpr(2.0**24)
ROW_EXP_LO = tl.constexpr(-8)
ROW_EXP_HI = tl.constexpr(15)
FP16_MAX = tl.constexpr(65504.0)
BF16_MAX = tl.constexpr(3.3895313892515355e38)
SMOOTH_MIN = tl.constexpr(2.0**-6)
SMOOTH_EXP = 0.5
"""The kernels take the smoothing factor as a square root (``sqrt_rn``): a test pins the reference's exponent to it."""
SEQ_SMOOTH_SKIP = tl.constexpr(1)
"""Tokens of a sequence's first tile that its smoothing vector leaves out (``kvarn.reference.smooth``)."""

STEP_COUNTS = ("num_seqs", "num_splits", "min_units", "n_rows")
"""Integer kernel arguments that change from one serving step to the next (batch, split and row counts),
passed as ``do_not_specialize`` to the kernels that take them. Triton otherwise compiles a kernel once
per class of each integer argument (``== 1``, a multiple of 16, other), so vLLM's steps, whose counts
vary, would compile new variants while serving. The kernels use them in scalar arithmetic, loop
bounds and row masks, not in the addresses of vector loads along ``D``, so the specialization is not
expected to matter for speed (not timed on its own). Names a kernel does not take are ignored."""

NEG_BIG = tl.constexpr(-1.0e30)
"""Start value of a running maximum: finite, so ``exp2(NEG_BIG - NEG_BIG)`` is 1, not NaN."""
LOG2E = 1.4426950408889634
"""``log2(e)``: kernels take ``exp2`` of scores pre-scaled by it."""

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
"""Model dtypes the kernels take for K, V, queries and the tail pool."""


class RecordLayout(NamedTuple):
    """One config's record layout as kernel constants, passed to every launch as ``LAYOUT: tl.constexpr``.

    Kernels read ``LAYOUT.K_SCALE`` etc.; the values come from :class:`~kvarn.config.KVarNConfig`
    only (see ``docs/internals/cache_layout.md``). Offsets are in bytes from the start of a record.
    """

    D: int
    """head_dim"""
    G: int
    """tokens per tile (``group_size``)"""
    K_BITS: int
    V_BITS: int
    K_PER_BYTE: int
    """K codes per byte (``8 // K_BITS``): the number of planar bit fields of the K codes"""
    V_PER_BYTE: int
    K_CODES: int
    V_CODES: int
    K_SCALE: int
    K_ZERO: int
    K_TOK: int
    V_SCALE: int
    V_ZERO: int
    V_CHAN: int
    K_SMOOTH: int = -1
    """offset of the key smoothing vector (``smooth_keys`` configs; kernels test ``K_SMOOTH >= 0``), -1 without one"""
    SEQ_SMOOTH: bool = False
    """one smoothing vector per sequence (``smooth_scope="sequence"``), carried by every record of the sequence"""


@functools.cache
def record_layout(cfg) -> RecordLayout:
    """The :class:`RecordLayout` of ``cfg`` (a :class:`~kvarn.config.KVarNConfig`)."""
    offsets = {name.upper(): off for name, off in cfg.offsets.items()}
    return RecordLayout(
        D=cfg.head_dim,
        G=cfg.group_size,
        K_BITS=cfg.k_bits,
        V_BITS=cfg.v_bits,
        K_PER_BYTE=cfg.k_per_byte,
        V_PER_BYTE=cfg.v_per_byte,
        SEQ_SMOOTH=cfg.seq_smooth,
        **offsets,
    )


def interpreting() -> bool:
    """Whether the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def index_list(t: torch.Tensor | None) -> torch.Tensor | None:
    """Index list ``t`` (block ids, slots, lengths) as the kernels read it, entry ``i`` at ``t + i``:
    a strided or expanded view is copied to a plain tensor; a plain one (or ``None``) is returned as
    it is, so a captured CUDA graph's buffers pass through untouched."""
    return None if t is None else t.contiguous()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` is a constexpr function in newer Triton, slow from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``), for host ints (see :func:`cdiv`)."""
    return 1 << max(0, n - 1).bit_length()


def inv_sqrt(d: int) -> float:
    """``1 / sqrt(d)``, the Hadamard normalization (rounded to fp32 inside a kernel)."""
    return 1.0 / math.sqrt(d)


@triton.jit
def sanitize(x):
    """``prepare``'s input policy on fp32 ``x``: NaN -> 0, saturate to ``+-MAX_ABS``."""
    x = tl.where(x == x, x, 0.0)
    return tl.minimum(tl.maximum(x, -MAX_ABS), MAX_ABS)


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is fp16 or bf16 (the dtypes the Triton kernels are built for)."""
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"{name} must be float16 or bfloat16 for the Triton kernels, got {t.dtype}; "
            f"use impl='reference' for {t.dtype}"
        )


def check_cache(cache: torch.Tensor, cfg) -> None:
    """Raise unless ``cache`` is a ``[num_blocks, Hkv, record_bytes]`` uint8 tensor with unit last stride."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != cfg.record_bytes:
        raise ValueError(
            f"cache must be uint8 [num_blocks, Hkv, {cfg.record_bytes}] for {cfg.name} at head_dim "
            f"{cfg.head_dim}, got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1:
        raise ValueError("cache must be contiguous along its last (record byte) axis")


@triton.jit
def bf16_bits(x):
    """fp32 ``x`` rounded to bf16 (nearest, ties to even), as its 16 raw bits in ``int16``. Finite ``x`` only."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).to(tl.int16)


@triton.jit
def bf16_round(x):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), returned in fp32. Finite ``x`` only."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def bf16_to_f32(bits):
    """Raw bf16 bits (``int16``) -> fp32, exactly."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_f32(ptr, mask, IS_BF16: tl.constexpr):
    """Load fp16 or bf16 values at ``ptr`` (a pointer block of the model dtype) as fp32, exactly.

    ``mask`` may be ``None``; masked-off elements read 0.
    """
    if IS_BF16:
        p16 = ptr.to(tl.pointer_type(tl.int16))
        if mask is None:
            bits = tl.load(p16)
        else:
            bits = tl.load(p16, mask=mask, other=0)
        return bf16_to_f32(bits)
    else:
        if mask is None:
            x = tl.load(ptr)
        else:
            x = tl.load(ptr, mask=mask, other=0.0)
        return x.to(tl.float32)


@triton.jit
def round_to_dtype(x, IS_BF16: tl.constexpr):
    """Saturate fp32 ``x`` to the finite range of fp16/bf16 and round to it (nearest even); fp32 result."""
    if IS_BF16:
        x = tl.minimum(tl.maximum(x, -BF16_MAX), BF16_MAX)
        return bf16_round(x)
    else:
        x = tl.minimum(tl.maximum(x, -FP16_MAX), FP16_MAX)
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def pool_factor(D: tl.constexpr, POOL_BF16: tl.constexpr):
    """``2^POOL_EXP`` of a pool of head dim ``D`` (``kvarn.reference.quantize.pool_exponent``).

    An fp16 pool holds rotated values times ``2^-ceil(log2 sqrt(D))`` (8 at D = 64, 16 at 128 and
    256) so the rotation never saturates it; a bf16 pool holds them as they are (1).
    """
    tl.static_assert(D >= 32 and D <= 256, "pool_factor covers head dims 32 to 256")
    if POOL_BF16:
        return 1.0
    elif D <= 64:
        return 8.0
    else:
        return 16.0


@triton.jit
def store_model(ptr, x, mask, IS_BF16: tl.constexpr):
    """Store fp32 ``x`` (already a value of the model dtype) to a fp16/bf16 pointer block."""
    if IS_BF16:
        tl.store(ptr.to(tl.pointer_type(tl.int16)), bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(tl.float16), mask=mask)


@triton.jit
def hadamard_pm(N: tl.constexpr):
    """The unnormalized Sylvester Hadamard ``[N, N]`` fp32: entry ``(-1)^popcount(i & j)``, ``N <= 256``."""
    i = tl.arange(0, N)
    p = i[:, None] & i[None, :]
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def rotate_rows(x, D: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """``x @ H`` for ``x: [R, D]`` fp32 holding fp16/bf16 values (or +-2^24), ``D <= 128``.

    The +-1 matrix and the inputs are exact in tf32, so the tensor-core products are exact and
    only the fp32 accumulation and the final ``* 1/sqrt(D)`` round.
    """
    y = tl.dot(x, hadamard_pm(D), input_precision="tf32")
    return y * INV_SQRT_D


@triton.jit
def rotate_rows_split(x1, x2, HALF: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """``[x1, x2] @ H_{2 HALF}`` for two column halves ``x1, x2: [R, HALF]`` -> ``[R, 2 HALF]`` fp32.

    Uses ``H_2n = [[H_n, H_n], [H_n, -H_n]]``: ``[x1 H + x2 H, x1 H - x2 H]``.
    """
    h = hadamard_pm(HALF)
    y1 = tl.dot(x1, h, input_precision="tf32")
    y2 = tl.dot(x2, h, input_precision="tf32")
    y = tl.join((y1 + y2) * INV_SQRT_D, (y1 - y2) * INV_SQRT_D)  # [R, HALF, 2]
    y = tl.permute(y, (0, 2, 1))  # [R, 2, HALF]
    return tl.reshape(y, (x1.shape[0], 2 * HALF))


TF32_HI_MASK = tl.constexpr(-8192)
"""fp32 bits with the 13 low mantissa bits cleared, the ones tf32 drops."""


@triton.jit
def split_tf32(x):
    """``x`` (fp32) as ``hi + lo`` with ``hi`` exact in tf32 (low 13 mantissa bits cleared)."""
    hi = (x.to(tl.int32, bitcast=True) & TF32_HI_MASK).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def hdot(x, h):
    """``x @ h`` for fp32 ``x`` and a +-1 matrix ``h``: two tf32 dots on ``hi + lo`` (~22 bits kept)."""
    hi, lo = split_tf32(x)
    return tl.dot(lo, h, tl.dot(hi, h, input_precision="tf32"), input_precision="tf32")


@triton.jit
def frexp_exponent(x):
    """``frexp`` exponent of a positive normal fp32 scalar ``x`` (``x = m 2^e``, ``m`` in [0.5, 1)); 0 for 0."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126
    return tl.where(x == 0.0, 0, e)


@triton.jit
def pow2(e):
    """``2^e`` in fp32 for an int32 ``e`` in [-126, 127], exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fwht_rows(x, INV_SQRT_D: tl.constexpr):
    """``x @ H`` for ``x: [R, D]`` fp32 by the reference's butterflies: equal to :func:`kvarn.reference.rotate`.

    Stage ``h = 1, 2, 4, ..`` maps the pair ``(a, b)`` of channels ``h`` apart to ``(a + b, a - b)``,
    then one ``* INV_SQRT_D`` (``D^-0.5`` in fp32). Elementwise fp32 adds, so exact in the same op
    order as the reference (no tensor cores): for fp32 inputs that a tf32 dot would truncate.
    """
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    for stage in tl.static_range(8):  # pairs 1 << stage apart
        if (1 << stage) < D:
            y = tl.permute(tl.reshape(x, (R, D // (2 << stage), 2, 1 << stage)), (0, 1, 3, 2))  # [R, blocks, h, 2]
            a, b = tl.split(y)
            y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
            x = tl.reshape(y, (R, D))
    return x * INV_SQRT_D


@triton.jit
def fp8e4m3_to_f32(byte):
    """fp8 e4m3 (``float8_e4m3fn``) bits ``byte`` (any int type) -> fp32, exactly. Not for NaN bytes.

    Decoded with integer ops: the interpreter's fp8 casts are not the GPU's.
    """
    bits = byte.to(tl.int32) & 0xFF
    e = (bits >> 3) & 0xF
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((bits >> 7) == 1, -val, val)


@triton.jit
def fp8e4m3_round(x):
    """fp32 ``x`` in fp8 e4m3's normal range (``2^-6 <= |x| <= 448``) rounded to it (nearest even), fp32 result.

    Rounds the fp32 mantissa to 3 bits in fp32 bit arithmetic, as the GPU cast does; the interpreter's cast does not.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def fp8e4m3_bits(x):
    """fp32 ``x``, a normal fp8 e4m3 value (as :func:`fp8e4m3_round` returns), as its fp8 bits in ``uint8``."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    e = ((bits >> 23) & 0xFF) - 120
    m = (bits >> 20) & 7
    return (sign | (e << 3) | m).to(tl.uint8)
