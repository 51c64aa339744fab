"""Packed codes in tensor-core dots: bit fields unpacked to fp16 and multiplied, K and V alike.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_tiles` (Triton inlines them). The code
products are ``tl.dot`` on codes converted to fp16 (exact for 2- and 4-bit integers), centered
(``code - 2^(b-1)``, with the mean folded into the fp32 zero-point term) so the dot and the zero
term do not cancel. Codes are read as 16-bit words, so on the GPU one 32-bit mask unpacks two
codes. Fields are unpacked in place (:func:`_unpack_raw`: a field at bit ``S`` becomes
``2^(10 - S) + code`` with no shift) and centered by one fp16 subtraction (head dims up to
``IN_PLACE_MAX_D``; above it, shifted down a field at a time, :func:`_unpack`); uncentered
(:func:`_packed_dot_raw` without ``CENTER``) the caller takes the offsets out of the zero-point term.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP16_1024 = tl.constexpr(0x6400)
"""fp16 bits of 1024.0. OR-ing an integer ``c < 1024`` into them gives the fp16 value ``1024 + c``."""


FP16_1024_PAIR = tl.constexpr(0x64006400)
"""``FP16_1024`` in both halves of a 32-bit word (1677747200): unpacks two codes in one ``lop3``."""


LOP3_AND_OR = tl.constexpr(0xEA)
"""``lop3`` truth table of ``(a & b) | c``."""


IN_PLACE_MAX_D = tl.constexpr(128)
"""Largest head dim whose centered codes :func:`_packed_dot` unpacks in place (one ``shr`` a code word for every
high-byte field, a fp16 subtraction a code pair) rather than a field at a time (a ``shr`` a code pair and field):
fewer instructions a code, but at ``D = 256``, already at 255 registers, in place was slower."""


@triton.jit
def _unpack(w, f: tl.constexpr, BITS: tl.constexpr, HIGH: tl.constexpr, USE_ASM: tl.constexpr):
    """Bit field ``f`` of the low (``HIGH=0``) or high byte of 16-bit words ``w`` as centered fp16 codes.

    ``(field | 0x6400)`` read as fp16 is ``1024 + field``; subtracting ``1024 + 2^(BITS-1)`` is exact
    and centers the codes (``-8 .. 7`` for 4 bits): the dot then does not carry the row's mean,
    which the caller folds into the fp32 zero-point term instead (``zero + 2^(BITS-1) * scale``).
    Uncentered, the dot and the zero term nearly cancel on centered rows and the fp16 rounding
    of ``q * k_scale`` is amplified many times. On the GPU
    two 16-bit words share a 32-bit register: one ``shr`` + one ``lop3`` unpack both (LLVM would
    split the shift per 16-bit lane); the interpreter takes the plain expression.
    """
    SHIFT: tl.constexpr = f * BITS + 8 * HIGH
    MASK: tl.constexpr = (1 << BITS) - 1
    MASK_PAIR: tl.constexpr = MASK | (MASK << 16)
    if USE_ASM:
        if SHIFT == 0:
            x = tl.inline_asm_elementwise(
                f"lop3.b32 $0, $1, {MASK_PAIR}, {FP16_1024_PAIR}, {LOP3_AND_OR};",
                "=r,r",
                [w],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
        else:
            x = tl.inline_asm_elementwise(
                f"{{ .reg .b32 t; shr.b32 t, $1, {SHIFT}; "
                f"lop3.b32 $0, t, {MASK_PAIR}, {FP16_1024_PAIR}, {LOP3_AND_OR}; }}",
                "=r,r",
                [w],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
    else:
        x = ((w >> SHIFT) & MASK) | FP16_1024
    return x.to(tl.float16, bitcast=True) - (1024.0 + (1 << (BITS - 1)))


@triton.jit
def _field_dot(
    a, w, f: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, even, odd, CODES_LEFT: tl.constexpr = False
):
    """``even += a @ field f of the low bytes of w``, ``odd += a @ field f of the high bytes``.

    ``a: [M, K]`` fp16, ``w: [K, N]`` int16 -> ``[M, N]`` fp32 each; ``None`` accumulators start at 0.
    ``CODES_LEFT``: the codes are the left operand instead, ``w: [M, K]``, ``a: [K, N]``
    (``field @ a``; the tokens-as-M form of :func:`~kvarn.kernels.attention_walk._quantized_tiles_t`).
    """
    if CODES_LEFT:
        even = tl.dot(_unpack(w, f, BITS, 0, USE_ASM), a, even)
        odd = tl.dot(_unpack(w, f, BITS, 1, USE_ASM), a, odd)
    else:
        even = tl.dot(a, _unpack(w, f, BITS, 0, USE_ASM), even)
        odd = tl.dot(a, _unpack(w, f, BITS, 1, USE_ASM), odd)
    return even, odd


@triton.jit
def _high_bytes(w, USE_ASM: tl.constexpr):
    """The high byte of each 16-bit word of ``w`` in its low byte (bits 8-15 are left undefined).

    On the GPU one ``shr.b32`` moves the high bytes of two words in a 32-bit register at once.
    """
    if USE_ASM:
        x = tl.inline_asm_elementwise("shr.b32 $0, $1, 8;", "=r,r", [w], dtype=tl.int16, is_pure=True, pack=2)
    else:
        x = w >> 8
    return x


@triton.jit
def _unpack_raw(w, f: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """Bit field ``f`` of the low byte of 16-bit words ``w`` as fp16 ``2^(10 - f * BITS) + code``, in place.

    The field sits at bits ``S = f * BITS``; OR-ing it into an fp16 of exponent ``2^(10 - S)``
    (mantissa unit ``2^-S`` of it) gives ``2^(10 - S) + code`` exactly, with no shift and no
    subtraction: one ``lop3`` per two codes on the GPU. The offset ``2^(10 - S)`` is folded into
    the zero-point term by the caller (:func:`~kvarn.kernels.attention_tiles._k_apply`).
    """
    S: tl.constexpr = f * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << S
    EXP: tl.constexpr = (25 - S) << 10
    if USE_ASM:
        x = tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, {MASK | (MASK << 16)}, {EXP | (EXP << 16)}, {LOP3_AND_OR};",
            "=r,r",
            [w],
            dtype=tl.int16,
            is_pure=True,
            pack=2,
        )
    else:
        x = (w & MASK) | EXP
    return x.to(tl.float16, bitcast=True)


@triton.jit
def _unpack_in_place(w, f: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, CENTER: tl.constexpr):
    """:func:`_unpack_raw`, and with ``CENTER`` its offset ``2^(10 - S)`` and ``2^(BITS - 1)`` taken off in fp16:
    the centered codes of :func:`_unpack`, bit for bit (small integers, exact), with no per-field shift."""
    x = _unpack_raw(w, f, BITS, USE_ASM)
    if CENTER:
        OFF: tl.constexpr = (1024 >> (f * BITS)) + (1 << (BITS - 1))
        x = x - OFF
    return x


@triton.jit
def _raw_dot(
    a, w, wh, f: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, even, odd, CODES_LEFT: tl.constexpr,
    CENTER: tl.constexpr,
):  # fmt: skip
    """:func:`_field_dot` on :func:`_unpack_in_place`'s codes; ``wh`` is :func:`_high_bytes` of ``w``."""
    if CODES_LEFT:
        even = tl.dot(_unpack_in_place(w, f, BITS, USE_ASM, CENTER), a, even)
        odd = tl.dot(_unpack_in_place(wh, f, BITS, USE_ASM, CENTER), a, odd)
    else:
        even = tl.dot(a, _unpack_in_place(w, f, BITS, USE_ASM, CENTER), even)
        odd = tl.dot(a, _unpack_in_place(wh, f, BITS, USE_ASM, CENTER), odd)
    return even, odd


@triton.jit
def _packed_dot_raw(
    w, a0, a1, a2, a3, P: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, CODES_LEFT: tl.constexpr = True,
    CENTER: tl.constexpr = False,
):  # fmt: skip
    """:func:`_packed_dot` with the fields unpacked in place (:func:`_unpack_in_place`: no per-field shift).

    With ``CODES_LEFT`` ``sum_f field_f(w) @ a_f`` (``w: [M, K]`` int16, ``a_f: [K, N]`` fp16), else
    ``sum_f a_f @ field_f(w)`` (``a_f: [M, K]``, ``w: [K, N]``). Returns ``(even, odd)`` (codes of the low and of the
    high byte of each word), ``[M, N]`` fp32 each. Without ``CENTER`` each carries ``sum_f off_f sum_k a_f`` on top of
    the centered product, which the caller subtracts (``off_f = 2^(10 - f * BITS) + 2^(BITS - 1)``,
    :func:`~kvarn.kernels.attention_tiles._k_apply`; scores only, module doc); with it the codes are centered before the
    dot, as :func:`_packed_dot`'s.
    """
    wh = _high_bytes(w, USE_ASM)  # one shift for all the fields of the high bytes
    even, odd = _raw_dot(a0, w, wh, 0, BITS, USE_ASM, None, None, CODES_LEFT, CENTER)
    even, odd = _raw_dot(a1, w, wh, 1, BITS, USE_ASM, even, odd, CODES_LEFT, CENTER)
    if P == 4:
        even, odd = _raw_dot(a2, w, wh, 2, BITS, USE_ASM, even, odd, CODES_LEFT, CENTER)
        even, odd = _raw_dot(a3, w, wh, 3, BITS, USE_ASM, even, odd, CODES_LEFT, CENTER)
    return even, odd


@triton.jit
def _packed_dot(
    a0, a1, a2, a3, w, P: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, CODES_LEFT: tl.constexpr,
    D: tl.constexpr,
):  # fmt: skip
    """``sum_f a_f @ field_f(w)`` over the ``P`` planar bit fields of the code words ``w: [K, N]`` int16.

    ``a_f: [M, K]`` fp16 is the operand of field ``f`` (``a2, a3`` unused when ``P = 2``). Returns
    ``(even, odd)``: the products with the codes of the low and of the high byte of each word,
    ``[M, N]`` fp32 each, on centered codes. Serves both the score dot (K) and the value dot (V). With
    ``CODES_LEFT`` the products are ``field_f(w) @ a_f`` (``w: [M, K]``, ``a_f: [K, N]``). Head dim
    ``D`` up to ``IN_PLACE_MAX_D``: codes unpacked in place (:func:`_packed_dot_raw` with ``CENTER``),
    above it shifted down a field at a time (:func:`_field_dot`); the same values either way.
    """
    if D <= IN_PLACE_MAX_D:
        even, odd = _packed_dot_raw(w, a0, a1, a2, a3, P, BITS, USE_ASM, CODES_LEFT, True)
    else:
        even, odd = _field_dot(a0, w, 0, BITS, USE_ASM, None, None, CODES_LEFT)
        even, odd = _field_dot(a1, w, 1, BITS, USE_ASM, even, odd, CODES_LEFT)
        if P == 4:
            even, odd = _field_dot(a2, w, 2, BITS, USE_ASM, even, odd, CODES_LEFT)
            even, odd = _field_dot(a3, w, 3, BITS, USE_ASM, even, odd, CODES_LEFT)
    return even, odd
