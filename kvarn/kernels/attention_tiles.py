"""One tile's share of paged attention: unpack codes, scores, values, full-precision tiles.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_decode` (Triton inlines them). A program
holds ``BLOCK_M`` rows, each one (query, query head) pair of one KV head. Per quantized tile, in
the rotated frame with ``q`` pre-scaled by ``softmax_scale * log2(e)`` (``docs/algorithm.md``,
"Attention over the cache")::

    s[t]  = k_tok[t] * ( sum_d (q_d k_scale[d]) code[d, t] + sum_d q_d k_zero[d] )
    o~   += v_chan * ( sum_t (p_t v_scale[t]) code[t, :] + sum_t p_t v_zero[t] )

The code products are ``tl.dot`` on codes converted to fp16 (exact for 2- and 4-bit integers),
centered (``code - 2^(b-1)``, with the mean folded into the fp32 zero-point term) so the dot and
the zero term do not cancel. Planar packing hands each bit field over as a contiguous slice: a K
field is a block of channels (the score dot's reduction axis), a V field a block of tokens (the
value dot's reduction axis). Codes are read as 16-bit words: K words pair two neighbouring tokens
(the score dot runs on even and odd tokens), V words two neighbouring channels (the value dot
fills even and odd output channels), so one 32-bit mask unpacks two codes on the GPU.
Fields are unpacked in place (:func:`_unpack_raw`: a field at bit ``S`` becomes ``2^(10 - S) + code``
with no shift) and centered by one fp16 subtraction (head dims up to ``IN_PLACE_MAX_D``; above it,
shifted down a field at a time, :func:`_unpack`). With ``FOLD`` the K fields are not centered per code:
the offsets leave the zero-point term instead. V fields are always centered: folded, every value
product carries the offset (up to 1024 times a code step) with the same sign, and the tensor cores'
fp32 accumulation, which truncates, turned that into a bias that grows with the context (H200,
records-dominated synthetic caches, k4v2: 4.7e-2 of max |out| at 4 / 32K against 6e-4 centered;
``benchmarks/RESULTS.md``, session 26). The scores' products change sign with the query and stay within
the tolerances folded.

Tail and sink tiles (full precision in the pool) and the step's own keys and values (pool form):
fp16 pools in fp16 dots (:func:`_fp_rows`), bf16 pools in tf32 dots (exact for bf16 values).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import load_f32, pool_factor

FP16_1024 = tl.constexpr(0x6400)
"""fp16 bits of 1024.0. OR-ing an integer ``c < 1024`` into them gives the fp16 value ``1024 + c``."""
FP16_1024_PAIR = tl.constexpr(0x64006400)
"""``FP16_1024`` in both halves of a 32-bit word (1677747200): unpacks two codes in one ``lop3``."""
LOP3_AND_OR = tl.constexpr(0xEA)
"""``lop3`` truth table of ``(a & b) | c``."""
IN_PLACE_MAX_D = tl.constexpr(128)
"""Largest head dim whose centered codes :func:`_packed_dot` unpacks in place (one ``shr`` a code word for every
high-byte field, a fp16 subtraction a code pair) rather than a field at a time (a ``shr`` a code pair and field).
H200, session 27, two rounds each (``benchmarks/RESULTS.md``): k4v2 16 / 32K 159.0, 159.1 -> 152.7, 152.5 us,
64 / 32K 575.4 -> 547.8, 553.2, k2v2 16 / 32K 151.4, 151.9 -> 145.6, 145.9, k4v2_g64 167.9, 168.1 -> 161.9, 161.5,
D = 64 116.4, 117.1 -> 109.8, 109.9; 1 / 1K and 1 / 32K within noise. Not at ``D = 256``: 330.2, 331.2 ->
385.3, 384.9 us (at 255 registers already; 40 bytes of stack in place, offline)."""
FP_TILE_TOKENS = tl.constexpr(16)
"""Tokens per step of a full-precision pool tile (keeps the key and value blocks small in registers: at 32 the
one-warp kernel spills, offline)."""


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
    (``field @ a``; the tokens-as-M form of :func:`_quantized_tiles_t`).
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
    the zero-point term by the caller (:func:`_k_apply`).
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

    With ``CODES_LEFT`` ``sum_f field_f(w) @ a_f`` (``w: [M, K]`` int16, ``a_f: [K, N]`` fp16),
    else ``sum_f a_f @ field_f(w)`` (``a_f: [M, K]``, ``w: [K, N]``). Returns ``(even, odd)`` (codes
    of the low and of the high byte of each word), ``[M, N]`` fp32 each. Without ``CENTER`` each
    carries ``sum_f off_f sum_k a_f`` on top of the centered product, which the caller subtracts
    (``off_f = 2^(10 - f * BITS) + 2^(BITS - 1)``, :func:`_k_apply`; scores only, module doc); with
    it the codes are centered before the dot, as :func:`_packed_dot`'s.
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


@triton.jit
def _bf16_pairs(ptr):
    """The two bf16 of each 32-bit word at byte pointers ``ptr`` (4-aligned) as fp32: ``(low, high)``, exactly.

    One 32-bit load per pair: 16-bit loads are too narrow for Triton to pipeline (``cp.async`` needs
    4 bytes a thread), so they would wait in the loop for global memory each tile.
    """
    return _bf16_split(tl.load(ptr.to(tl.pointer_type(tl.int32))))


@triton.jit
def _bf16_split(w):
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _f16_pairs(ptr):
    """The two fp16 of each 32-bit word at byte pointers ``ptr`` (4-aligned) as fp32, as :func:`_bf16_pairs`."""
    return _f16_split(tl.load(ptr.to(tl.pointer_type(tl.int32))))


@triton.jit
def _f16_split(w):
    lo = w.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _k_operands(q_f, side, f: tl.constexpr, LAYOUT: tl.constexpr, FOLD: tl.constexpr = False):
    """Query block ``q_f: [BLOCK_M, DK]`` of K field ``f`` (channels ``f * DK ..``) against a tile's :func:`_key_side`.

    Returns the score dot's fp16 operand ``q * k_scale`` and the fp32 zero-point term
    ``q * (k_zero + 2^(K_BITS-1) k_scale)`` (the centering of :func:`_unpack`), ``[BLOCK_M, DK]`` each.
    ``FOLD``: the zero-point term also subtracts :func:`_unpack_raw`'s offset times the fp16
    operand (the very values the dot multiplies, so the offset cancels up to fp32 rounding).
    """
    ks, kz = _k_field(side, f, LAYOUT)  # [DK]
    return _k_apply(q_f, ks[None, :], kz[None, :], f, LAYOUT, FOLD)


@triton.jit
def _tile_scores(rec, query, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr = False, side=None):
    """Scores of one quantized tile, divided by the rows' power of two ``rf``: ``(even, odd)`` tokens, each
    ``[BLOCK_M, G // 2]`` fp32 (the caller applies ``rf`` in the softmax's max and ``exp2``).

    ``query = (q0, q1, q2, q3, rf)``: ``q0 .. q3: [BLOCK_M, DK]`` are the query's channel blocks of
    the K fields, divided by ``rf: [BLOCK_M]`` (a power of two) so ``|q| < 1`` (``q2, q3`` unused
    with two fields). The K code bytes are read as 16-bit words ``[DK, G // 2]`` (two neighbouring
    tokens), so a 32-bit register of the dot operand holds two channels' words and one mask
    unpacks two codes. ``FOLD``: unpack with :func:`_packed_dot_raw` (one shift per word, no
    subtraction) and take the codes' offsets out of the zero-point term instead. ``side``: the
    tile's :func:`_key_side` if the caller read it ahead (else it is read here).
    """
    q0, q1, q2, q3, _ = query
    PK: tl.constexpr = LAYOUT.K_PER_BYTE
    DK: tl.constexpr = LAYOUT.D // PK
    GH: tl.constexpr = LAYOUT.G // 2
    if side is None:
        side = _key_side(rec, LAYOUT)
    qs0, qz = _k_operands(q0, side, 0, LAYOUT, FOLD)  # [BLOCK_M, DK] fp16, fp32
    qs1, qz1 = _k_operands(q1, side, 1, LAYOUT, FOLD)
    qz += qz1
    qs2 = qs0
    qs3 = qs0
    if PK == 4:
        qs2, qz2 = _k_operands(q2, side, 2, LAYOUT, FOLD)
        qz += qz2
        qs3, qz3 = _k_operands(q3, side, 3, LAYOUT, FOLD)
        qz += qz3
    qz = tl.sum(qz, axis=1)  # [BLOCK_M]
    jk = tl.arange(0, DK)
    ti = tl.arange(0, GH)
    kw = tl.load((rec + LAYOUT.K_CODES).to(tl.pointer_type(tl.int16)) + jk[:, None] * GH + ti[None, :])  # [DK, GH]
    if FOLD:
        s_e, s_o = _packed_dot_raw(kw, qs0, qs1, qs2, qs3, PK, LAYOUT.K_BITS, USE_ASM, False)  # [BLOCK_M, GH] each
    else:
        s_e, s_o = _packed_dot(qs0, qs1, qs2, qs3, kw, PK, LAYOUT.K_BITS, USE_ASM, False, LAYOUT.D)
    kt_e, kt_o = _bf16_pairs(rec + LAYOUT.K_TOK + 4 * ti)  # [GH] k_tok of even, odd tokens
    s_e = (s_e + qz[:, None]) * kt_e[None, :]
    s_o = (s_o + qz[:, None]) * kt_o[None, :]
    return s_e, s_o


@triton.jit
def _split_fields(x, BM: tl.constexpr, PV: tl.constexpr, CT: tl.constexpr):
    """``x: [BM, PV * CT]`` (tokens in order) -> its ``PV`` token chunks ``[BM, CT]``.

    Always returns four; with ``PV = 2`` the last two repeat the first two.
    """
    x = tl.permute(tl.reshape(x, (BM, PV, CT)), (0, 2, 1))  # [BM, CT, PV]
    if PV == 2:
        a, b = tl.split(x)
        return a, b, a, b
    else:
        e, o = tl.split(tl.reshape(x, (BM, CT, 2, 2)))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3


@triton.jit
def _tile_values(
    rec,
    p_e,
    p_o,
    alpha,
    acc_e,
    acc_o,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    side=None,
):
    """Online-softmax value step of one quantized tile: ``acc * alpha + p @ V~``.

    ``p_e, p_o: [BLOCK_M, G // 2]`` are the probabilities of the even and odd tokens, ``alpha:
    [BLOCK_M]`` the rescale of the running accumulators ``acc_e, acc_o: [BLOCK_M, D // 2]`` (even
    and odd output channels; ``None``: no rescale). The V code bytes are read as 16-bit words ``[G // PV, D // 2]`` (two
    neighbouring channels), their fields centered (never folded: module doc).
    ``side``: the tile's :func:`_value_side` if the caller read it ahead (else it is read here).
    """
    BLOCK_M: tl.constexpr = p_e.shape[0]
    G: tl.constexpr = LAYOUT.G
    PV: tl.constexpr = LAYOUT.V_PER_BYTE
    CT: tl.constexpr = G // PV
    DH: tl.constexpr = LAYOUT.D // 2
    VC: tl.constexpr = 1 << (LAYOUT.V_BITS - 1)  # code centering, see _unpack
    th = tl.arange(0, G // 2)
    if side is None:
        side = _value_side(rec, LAYOUT)
    vz_w, vc_w = side
    vs_e, vs_o = _f16_pairs(rec + LAYOUT.V_SCALE + 4 * th)  # [G // 2] v_scale of even, odd tokens
    vz_e, vz_o = _f16_split(vz_w)
    vz_e += VC * vs_e
    vz_o += VC * vs_o
    pv_e = (p_e * vs_e[None, :]).to(tl.float16)
    pv_o = (p_o * vs_o[None, :]).to(tl.float16)
    zt = p_e * vz_e[None, :] + p_o * vz_o[None, :]  # [BLOCK_M, G // 2]
    z = tl.sum(zt, axis=1)  # [BLOCK_M]
    pv = tl.reshape(tl.join(pv_e, pv_o), (BLOCK_M, G))  # tokens in order
    pv0, pv1, pv2, pv3 = _split_fields(pv, BLOCK_M, PV, CT)  # [BLOCK_M, CT] each

    jv = tl.arange(0, CT)
    dh = tl.arange(0, DH)
    vw = tl.load((rec + LAYOUT.V_CODES).to(tl.pointer_type(tl.int16)) + jv[:, None] * DH + dh[None, :])  # [CT, DH]
    o_e, o_o = _packed_dot(pv0, pv1, pv2, pv3, vw, PV, LAYOUT.V_BITS, USE_ASM, False, LAYOUT.D)
    vc_e, vc_o = _bf16_split(vc_w)  # [DH] v_chan of even, odd channels
    if alpha is not None:
        acc_e = acc_e * alpha[:, None]
        acc_o = acc_o * alpha[:, None]
    acc_e += (o_e + z[:, None]) * vc_e[None, :]
    acc_o += (o_o + z[:, None]) * vc_o[None, :]
    return acc_e, acc_o


@triton.jit
def _key_side(rec, LAYOUT: tl.constexpr, ok=None):
    """A tile's K channel scales and zero points as raw fp16 bits, ``[DK]`` int16 per field, for the score step.

    ``(ks0, kz0, ks1, kz1, ks2, kz2, ks3, kz3)``; with two fields the last four repeat the first.
    ``ok``: a scalar mask (nothing is read where it is false).
    """
    DK: tl.constexpr = LAYOUT.D // LAYOUT.K_PER_BYTE
    j = tl.arange(0, DK)
    ks = (rec + LAYOUT.K_SCALE).to(tl.pointer_type(tl.int16)) + j
    kz = (rec + LAYOUT.K_ZERO).to(tl.pointer_type(tl.int16)) + j
    if ok is None:
        ok = j < DK  # all true (folded away)
    else:
        ok = j < ok.to(tl.int32) * DK  # as a block (the interpreter takes neither a scalar mask nor `block & scalar`)
    ks0 = tl.load(ks, mask=ok, other=0)
    kz0 = tl.load(kz, mask=ok, other=0)
    ks1 = tl.load(ks + DK, mask=ok, other=0)
    kz1 = tl.load(kz + DK, mask=ok, other=0)
    if LAYOUT.K_PER_BYTE == 4:
        ks2 = tl.load(ks + 2 * DK, mask=ok, other=0)
        kz2 = tl.load(kz + 2 * DK, mask=ok, other=0)
        return (
            ks0,
            kz0,
            ks1,
            kz1,
            ks2,
            kz2,
            tl.load(ks + 3 * DK, mask=ok, other=0),
            tl.load(kz + 3 * DK, mask=ok, other=0),
        )
    else:
        return ks0, kz0, ks1, kz1, ks0, kz0, ks1, kz1


@triton.jit
def _k_field(side, f: tl.constexpr, LAYOUT: tl.constexpr):
    """Field ``f``'s channel scales and centered zero points ``k_zero + 2^(K_BITS-1) k_scale``, ``[DK]`` fp32,
    from a :func:`_key_side`."""
    KC: tl.constexpr = 1 << (LAYOUT.K_BITS - 1)
    ks = side[2 * f].to(tl.float16, bitcast=True).to(tl.float32)
    return ks, side[2 * f + 1].to(tl.float16, bitcast=True).to(tl.float32) + KC * ks


@triton.jit
def _k_operands_t(q_f, side, f: tl.constexpr, LAYOUT: tl.constexpr, FOLD: tl.constexpr):
    """:func:`_k_operands` transposed: ``q_f: [DK, N]`` -> ``(q k_scale)`` fp16 and the zero-point term, ``[DK, N]``.

    ``side``: the tile's :func:`_key_side`. ``FOLD``: the zero-point term also subtracts
    :func:`_unpack_raw`'s offset times the fp16 operand (the very values the dot multiplies, so the
    offset cancels up to fp32 rounding).
    """
    ks, kz = _k_field(side, f, LAYOUT)
    return _k_apply(q_f, ks[:, None], kz[:, None], f, LAYOUT, FOLD)


@triton.jit
def _k_apply(q_f, ks, kz, f: tl.constexpr, LAYOUT: tl.constexpr, FOLD: tl.constexpr):
    """``(q k_scale)`` fp16 and the zero-point term of a query block ``q_f`` with scales ``ks, kz`` broadcast to it."""
    KC: tl.constexpr = 1 << (LAYOUT.K_BITS - 1)
    qs = (q_f * ks).to(tl.float16)  # [DK, N]
    qz = q_f * kz
    if FOLD:
        OFF: tl.constexpr = (1024 >> (f * LAYOUT.K_BITS)) + KC
        qz -= OFF * qs.to(tl.float32)
    return qs, qz


@triton.jit
def _tile_scores_t(rec, query_t, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr, FOLD: tl.constexpr = False, side=None):
    """:func:`_tile_scores` with the tokens as the dot's M: ``(even, odd)`` tokens, ``[G // 2, N]`` fp32 each,
    divided by the rows' power of two ``rf``.

    ``query_t = (q0, q1, q2, q3, rf)``: ``q_f: [DK, N]`` are the K fields' channel blocks of the
    ``N`` query rows, transposed (``rf: [N]`` as in :func:`_tile_scores`). The code words are read
    ``[G // 2, DK]`` (token pairs x channels) and are the left operand, so the 64 token pairs fill
    the MMA's rows and the query heads are its columns: no padded rows in the per-token work.
    ``FOLD``: unpack with :func:`_packed_dot_raw` (no shifts but one per word, no subtraction) and
    take the codes' offsets out of the zero-point term instead. ``rf`` is left out:
    :func:`~kvarn.kernels.attention_decode._quantized_tiles_t` applies it in the softmax's max and ``exp2``
    instead of an outer product with ``k_tok`` a tile (session 28, H200: k4v2 16 / 32K 152.1 -> 151.1 µs,
    k2v2 145.6 -> 140.5).
    """
    q0, q1, q2, q3, _ = query_t
    PK: tl.constexpr = LAYOUT.K_PER_BYTE
    DK: tl.constexpr = LAYOUT.D // PK
    GH: tl.constexpr = LAYOUT.G // 2
    if side is None:
        side = _key_side(rec, LAYOUT)
    qs0, qz = _k_operands_t(q0, side, 0, LAYOUT, FOLD)  # [DK, N] fp16, fp32
    qs1, qz1 = _k_operands_t(q1, side, 1, LAYOUT, FOLD)
    qz += qz1
    qs2 = qs0
    qs3 = qs0
    if PK == 4:
        qs2, qz2 = _k_operands_t(q2, side, 2, LAYOUT, FOLD)
        qz += qz2
        qs3, qz3 = _k_operands_t(q3, side, 3, LAYOUT, FOLD)
        qz += qz3
    qz = tl.sum(qz, axis=0)  # [N]
    jk = tl.arange(0, DK)
    ti = tl.arange(0, GH)
    kw = tl.load((rec + LAYOUT.K_CODES).to(tl.pointer_type(tl.int16)) + jk[None, :] * GH + ti[:, None])  # [GH, DK]
    if FOLD:
        s_e, s_o = _packed_dot_raw(kw, qs0, qs1, qs2, qs3, PK, LAYOUT.K_BITS, USE_ASM)  # [GH, N] each
    else:
        s_e, s_o = _packed_dot(qs0, qs1, qs2, qs3, kw, PK, LAYOUT.K_BITS, USE_ASM, True, LAYOUT.D)
    kt_e, kt_o = _bf16_pairs(rec + LAYOUT.K_TOK + 4 * ti)  # [GH]
    s_e = (s_e + qz[None, :]) * kt_e[:, None]
    s_o = (s_o + qz[None, :]) * kt_o[:, None]
    return s_e, s_o


@triton.jit
def _split_fields_t(x, PV: tl.constexpr, CT: tl.constexpr):
    """``x: [PV * CT, N]`` (tokens in order) -> its ``PV`` token chunks ``[CT, N]`` (four, as :func:`_split_fields`)."""
    N: tl.constexpr = x.shape[1]
    if PV == 2:
        a, b = tl.split(tl.permute(tl.reshape(x, (2, CT, N)), (1, 2, 0)))  # [CT, N, 2]
        return a, b, a, b
    else:
        e, o = tl.split(tl.permute(tl.reshape(x, (2, 2, CT, N)), (2, 3, 0, 1)))  # [CT, N, 2, 2]
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3


@triton.jit
def _value_side(rec, LAYOUT: tl.constexpr, ok=None):
    """A tile's V zero points and channel scales as 32-bit words (two tokens or channels each), for the value step.

    ``([G // 2], [D // 2])`` int32, as :func:`_tile_values` and :func:`_tile_values_t` take them.

    ``ok`` as in :func:`_key_side`.
    """
    th = tl.arange(0, LAYOUT.G // 2)
    dh = tl.arange(0, LAYOUT.D // 2)
    ok_t = th < LAYOUT.G // 2
    ok_d = dh < LAYOUT.D // 2
    if ok is not None:
        ok_t = th < ok.to(tl.int32) * (LAYOUT.G // 2)  # as in _key_side
        ok_d = dh < ok.to(tl.int32) * (LAYOUT.D // 2)
    vz = tl.load((rec + LAYOUT.V_ZERO + 4 * th).to(tl.pointer_type(tl.int32)), mask=ok_t, other=0)
    return vz, tl.load((rec + LAYOUT.V_CHAN + 4 * dh).to(tl.pointer_type(tl.int32)), mask=ok_d, other=0)


@triton.jit
def _value_side_st(base, off_a, off_b, LAYOUT: tl.constexpr, ok=None):
    """:func:`_value_side` of the two stacked tiles at ``base + off_a``, ``base + off_b``: ``(vz, vc_a, vc_b)``,
    the zero points' words ``[2, G // 2]`` (tile a's row first), the channel scales' ``[D // 2]`` each."""
    vz_a, vc_a = _value_side(base + off_a, LAYOUT, ok)
    vz_b, vc_b = _value_side(base + off_b, LAYOUT, ok)
    return tl.permute(tl.join(vz_a, vz_b), (1, 0)), vc_a, vc_b


@triton.jit
def _tile_values_t(
    rec,
    p_e,
    p_o,
    alpha,
    acc_e,
    acc_o,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    side=None,
):
    """:func:`_tile_values` transposed: ``p_e, p_o: [G // 2, N]``, ``acc_e, acc_o: [D // 2, N]``, ``alpha: [N]``.

    The value dot is ``V^T @ p``: the V code words ``[D // 2, G // PV]`` (channel pairs x tokens)
    are the left operand, the ``N`` query rows its columns.
    """
    N: tl.constexpr = p_e.shape[1]
    G: tl.constexpr = LAYOUT.G
    PV: tl.constexpr = LAYOUT.V_PER_BYTE
    CT: tl.constexpr = G // PV
    DH: tl.constexpr = LAYOUT.D // 2
    VC: tl.constexpr = 1 << (LAYOUT.V_BITS - 1)
    th = tl.arange(0, G // 2)
    vs_e, vs_o = _f16_pairs(rec + LAYOUT.V_SCALE + 4 * th)  # [G // 2]
    if side is None:
        side = _value_side(rec, LAYOUT)
    vz_w, vc_w = side
    vz_e, vz_o = _f16_split(vz_w)
    vz_e += VC * vs_e
    vz_o += VC * vs_o
    pv_e = (p_e * vs_e[:, None]).to(tl.float16)
    pv_o = (p_o * vs_o[:, None]).to(tl.float16)
    zt = p_e * vz_e[:, None] + p_o * vz_o[:, None]  # [G // 2, N]
    z = tl.sum(zt, axis=0)  # [N]
    pv = tl.reshape(tl.permute(tl.join(pv_e, pv_o), (0, 2, 1)), (G, N))  # tokens in order
    pv0, pv1, pv2, pv3 = _split_fields_t(pv, PV, CT)  # [CT, N] each
    jv = tl.arange(0, CT)
    dh = tl.arange(0, DH)
    vw = tl.load((rec + LAYOUT.V_CODES).to(tl.pointer_type(tl.int16)) + jv[None, :] * DH + dh[:, None])  # [DH, CT]
    o_e, o_o = _packed_dot(pv0, pv1, pv2, pv3, vw, PV, LAYOUT.V_BITS, USE_ASM, True, LAYOUT.D)
    vc_e, vc_o = _bf16_split(vc_w)  # [DH]
    if alpha is not None:
        acc_e = acc_e * alpha[None, :]
        acc_o = acc_o * alpha[None, :]
    acc_e += (o_e + z[None, :]) * vc_e[:, None]
    acc_o += (o_o + z[None, :]) * vc_o[:, None]
    return acc_e, acc_o


@triton.jit
def _by_column(second, a, b):
    """``[R, N]``: column ``c`` holds ``b: [R]`` where ``second[c]`` (its tile is the step's second), else ``a``."""
    return tl.where(second[None, :], b[:, None], a[:, None])


@triton.jit
def _pair(a, b):
    """Scalars ``a, b`` as a ``[2]`` tensor."""
    return a + (b - a) * tl.arange(0, 2)  # not tl.where: the compiler keeps the 16-byte alignment of a product


@triton.jit
def _tile_scores_st(
    base,
    off_a,
    off_b,
    has_b,
    query_t,
    second,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    FOLD: tl.constexpr,
    side_a,
    side_b,
):
    """:func:`_tile_scores_t` on two tiles stacked on the dot's M: ``(even, odd)`` tokens, ``[G, N]`` fp32 each,
    divided by the columns' power of two ``rf``.

    Rows ``0 .. G/2 - 1`` are the token pairs of the record at ``base + off_a``, the rest those of
    the record at ``base + off_b`` (byte offsets; ``has_b``: it is a real tile). Column ``c``
    scores tile b where ``second[c]``, else tile a, with that tile's channel scales; the other
    tile's rows of each column (and every row of a missing tile b) are ``-inf``. So one dot of
    ``G`` rows serves two tiles whose own M (``G / 2`` = 32 rows at 64-token tiles) four warps could
    not split without doing the unpack twice, and the columns the query heads leave free (``N = 8``
    at 4 heads) carry the second tile. The code words of both tiles are one ``[2, G / 2, DK]`` load
    from the two records (:func:`_pair`): a record chosen per row lost the 16-byte loads and spilled,
    and joining two loaded tiles cost ~200 more instructions a step (sm_90, RESULTS.md session 14).
    ``side_a``, ``side_b``: the two tiles' :func:`_key_side`, read a step ahead by the caller.
    """
    q0, q1, q2, q3, _ = query_t
    PK: tl.constexpr = LAYOUT.K_PER_BYTE
    DK: tl.constexpr = LAYOUT.D // PK
    GH: tl.constexpr = LAYOUT.G // 2
    qs0, qz = _k_operands_st(q0, side_a, side_b, second, 0, LAYOUT, FOLD)  # [DK, N]
    qs1, qz1 = _k_operands_st(q1, side_a, side_b, second, 1, LAYOUT, FOLD)
    qz += qz1
    qs2 = qs0
    qs3 = qs0
    if PK == 4:
        qs2, qz2 = _k_operands_st(q2, side_a, side_b, second, 2, LAYOUT, FOLD)
        qz += qz2
        qs3, qz3 = _k_operands_st(q3, side_a, side_b, second, 3, LAYOUT, FOLD)
        qz += qz3
    qz = tl.sum(qz, axis=0)  # [N]
    recs = base + _pair(off_a, off_b)  # [2]
    ti = tl.arange(0, GH)
    jk = tl.arange(0, DK)
    words = jk[None, None, :] * GH + ti[None, :, None]  # [1, GH, DK]
    kw = tl.load((recs[:, None, None] + LAYOUT.K_CODES).to(tl.pointer_type(tl.int16)) + words)
    kw = tl.reshape(kw, (2 * GH, DK))  # [G, DK]: tile a's token pairs, then tile b's
    if FOLD:
        s_e, s_o = _packed_dot_raw(kw, qs0, qs1, qs2, qs3, PK, LAYOUT.K_BITS, USE_ASM)  # [G, N] each
    else:
        s_e, s_o = _packed_dot(qs0, qs1, qs2, qs3, kw, PK, LAYOUT.K_BITS, USE_ASM, True, LAYOUT.D)
    kt_e, kt_o = _bf16_pairs(recs[:, None] + LAYOUT.K_TOK + 4 * ti[None, :])  # [2, GH]
    kt_e = tl.reshape(kt_e, (2 * GH,))  # [G]
    kt_o = tl.reshape(kt_o, (2 * GH,))
    i = tl.arange(0, 2 * GH)
    mine = ((i >= GH)[:, None] == second[None, :]) & ((i < GH) | has_b)[:, None]
    s_e = tl.where(mine, (s_e + qz[None, :]) * kt_e[:, None], float("-inf"))
    s_o = tl.where(mine, (s_o + qz[None, :]) * kt_o[:, None], float("-inf"))
    return s_e, s_o


@triton.jit
def _k_operands_st(q_f, side_a, side_b, second, f: tl.constexpr, LAYOUT: tl.constexpr, FOLD: tl.constexpr):
    """:func:`_k_operands_t`, column ``c`` scaled by tile b's field ``f`` where ``second[c]``, else tile a's
    (``side_a``, ``side_b``: the tiles' :func:`_key_side`)."""
    ks_a, kz_a = _k_field(side_a, f, LAYOUT)
    ks_b, kz_b = _k_field(side_b, f, LAYOUT)
    return _k_apply(q_f, _by_column(second, ks_a, ks_b), _by_column(second, kz_a, kz_b), f, LAYOUT, FOLD)


@triton.jit
def _split_fields_st(x, PV: tl.constexpr, CT: tl.constexpr):
    """``x: [2 PV CT, N]`` (two tiles' tokens in order) -> ``PV`` blocks ``[2 CT, N]``: field ``f``'s tokens of
    tile a, then of tile b (as :func:`_split_fields_t`, four returned)."""
    N: tl.constexpr = x.shape[1]
    if PV == 2:
        y = tl.reshape(tl.permute(tl.reshape(x, (2, 2, CT, N)), (0, 2, 3, 1)), (2 * CT, N, 2))
        a, b = tl.split(y)
        return a, b, a, b
    else:
        y = tl.reshape(tl.permute(tl.reshape(x, (2, 2, 2, CT, N)), (0, 3, 4, 1, 2)), (2 * CT, N, 2, 2))
        e, o = tl.split(y)
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3


@triton.jit
def _tile_values_st(
    base,
    off_a,
    off_b,
    p_e,
    p_o,
    alpha,
    acc,
    second,
    LAYOUT: tl.constexpr,
    USE_ASM: tl.constexpr,
    side,
):
    """:func:`_tile_values_t` on the two stacked tiles of :func:`_tile_scores_st`; ``p_e, p_o: [G, N]``.

    The value dot reduces over both tiles' tokens at once (V code words ``[D // 2, 2 G // PV]``, tile
    a's then tile b's of each field); a column's probabilities are 0 on the other tile's tokens, so
    column ``c`` gets its own tile's values, scaled by that tile's ``v_chan``. ``acc = (acc_e, acc_o)``;
    ``side``: the tiles' :func:`_value_side_st`, read a step ahead by the caller.
    """
    acc_e, acc_o = acc
    N: tl.constexpr = p_e.shape[1]
    G: tl.constexpr = LAYOUT.G
    PV: tl.constexpr = LAYOUT.V_PER_BYTE
    CT: tl.constexpr = G // PV
    GH: tl.constexpr = G // 2
    DH: tl.constexpr = LAYOUT.D // 2
    VC: tl.constexpr = 1 << (LAYOUT.V_BITS - 1)  # code centering, see _unpack
    recs = base + _pair(off_a, off_b)  # [2]
    ti = tl.arange(0, GH)
    vz_w, vc_a, vc_b = side
    vs_e, vs_o = _f16_pairs(recs[:, None] + LAYOUT.V_SCALE + 4 * ti[None, :])  # [2, GH]
    vs_e = tl.reshape(vs_e, (G,))
    vs_o = tl.reshape(vs_o, (G,))
    vz_e, vz_o = _f16_split(vz_w)
    vz_e = tl.reshape(vz_e, (G,)) + VC * vs_e
    vz_o = tl.reshape(vz_o, (G,)) + VC * vs_o
    pv_e = (p_e * vs_e[:, None]).to(tl.float16)
    pv_o = (p_o * vs_o[:, None]).to(tl.float16)
    zt = p_e * vz_e[:, None] + p_o * vz_o[:, None]  # [G, N]
    z = tl.sum(zt, axis=0)  # [N]
    pv = tl.reshape(tl.permute(tl.join(pv_e, pv_o), (0, 2, 1)), (2 * G, N))  # tile a's tokens, then tile b's
    pv0, pv1, pv2, pv3 = _split_fields_st(pv, PV, CT)  # [2 CT, N] each
    dh = tl.arange(0, DH)
    words = tl.arange(0, CT)[None, None, :] * DH + dh[:, None, None]  # [DH, 1, CT]
    vw = tl.load((recs[None, :, None] + LAYOUT.V_CODES).to(tl.pointer_type(tl.int16)) + words)
    vw = tl.reshape(vw, (DH, 2 * CT))  # tile a's tokens of each field, then tile b's
    o_e, o_o = _packed_dot(pv0, pv1, pv2, pv3, vw, PV, LAYOUT.V_BITS, USE_ASM, True, LAYOUT.D)
    vc_ae, vc_ao = _bf16_split(vc_a)  # [DH] v_chan of the even and odd channels, tile a
    vc_be, vc_bo = _bf16_split(vc_b)
    vc_e = _by_column(second, vc_ae, vc_be)  # [DH, N]
    vc_o = _by_column(second, vc_ao, vc_bo)
    acc_e = acc_e * alpha[None, :] + (o_e + z[None, :]) * vc_e
    acc_o = acc_o * alpha[None, :] + (o_o + z[None, :]) * vc_o
    return acc_e, acc_o


@triton.jit
def _causal(s_e, s_o, pos_q, key0, GH: tl.constexpr):
    """Mask keys past each row's query position; ``s_e, s_o`` hold the even and odd tokens from ``key0``."""
    kpos = key0 + 2 * tl.arange(0, GH)
    s_e = tl.where(kpos[None, :] <= pos_q[:, None], s_e, float("-inf"))
    s_o = tl.where(kpos[None, :] + 1 <= pos_q[:, None], s_o, float("-inf"))
    return s_e, s_o


@triton.jit
def _fp_rows(
    q_rows, state, k_ptr, v_ptr, base, tok_stride, n_valid, key0, pos_q, lo_q, POOL_BF16: tl.constexpr,
    table=None, blk_stride=0, ROWS: tl.constexpr = 0,
):  # fmt: skip
    """Online-softmax steps over ``n_valid`` full-precision keys and values at positions ``key0 ..``.

    ``q_rows = (qn, rf)``: the rows' rotated, scaled queries ``qn * rf[:, None]`` with ``qn: [BLOCK_M, D]``
    fp32, ``|qn| < 1``, and ``rf: [BLOCK_M]`` a power of two (:func:`_load_query`'s form); ``state = (m_i,
    l_i, acc)`` (``[BLOCK_M]``, ``[BLOCK_M]``, ``[BLOCK_M, D]``) in and out. The first token's ``D`` values
    (pool form, one KV head) are at ``k_ptr + base``, ``v_ptr + base`` (``base`` an int64 offset), the next
    ``tok_stride`` further. With ``ROWS > 0`` the tokens are rows of blocks instead: token ``t`` is row
    ``t % ROWS`` of block ``table[t // ROWS]``, at ``base + block * blk_stride + row * tok_stride``.
    Row ``r`` sees positions ``lo_q[r] .. pos_q[r]`` (``lo_q=None``: from 0). Walks the tokens
    ``FP_TILE_TOKENS`` at a time. (An offset rather than moved pointers: measured on the H200,
    k4v2 ``tokens_m`` decode at batch 16 / 32K, 212 against 223 us.)

    An fp16 pool's keys and values enter the dots as they are, with ``qn`` and the probabilities
    (times the pool factor, a power of two) rounded to fp16, the rounding the quantized tiles' dots
    make too; the pool factor and ``rf`` scale the fp32 scores. A bf16 pool's go through tf32 dots
    with the fp32 queries (bf16 keys are exact in tf32; bf16 queries would keep 8 bits).
    """
    m_i, l_i, acc = state
    qn, rf = q_rows
    D: tl.constexpr = qn.shape[1]
    if POOL_BF16:
        q_op = qn * rf[:, None]  # a bf16 pool holds the rotated values as they are (pool factor 1)
    else:
        unpool = pool_factor(D, POOL_BF16)  # the pool form back to the rotated values
        q_op = qn.to(tl.float16)
        s_scale = rf * unpool  # the scores' fp32 scale: the queries' and the pool's powers of two
    dd = tl.arange(0, D)
    ft = tl.arange(0, FP_TILE_TOKENS)
    for c in range(0, n_valid, FP_TILE_TOKENS):
        tt = c + ft
        tok_ok = tt < n_valid
        if ROWS > 0:
            blk = tl.load(table + tt // ROWS, mask=tok_ok, other=0).to(tl.int64)
            off = (base + blk * blk_stride + (tt % ROWS) * tok_stride)[:, None] + dd[None, :]
        else:
            off = base + tt[:, None] * tok_stride + dd[None, :]
        if POOL_BF16:
            kt = load_f32(k_ptr + off, tok_ok[:, None], POOL_BF16)  # [FP_TILE_TOKENS, D]
            vt = load_f32(v_ptr + off, tok_ok[:, None], POOL_BF16)
            s = tl.dot(q_op, tl.trans(kt), input_precision="tf32")  # [BLOCK_M, FP_TILE_TOKENS]
        else:
            kt = tl.load(k_ptr + off, mask=tok_ok[:, None], other=0.0)
            vt = tl.load(v_ptr + off, mask=tok_ok[:, None], other=0.0)
            s = tl.dot(q_op, tl.trans(kt)) * s_scale[:, None]
        ok = tok_ok[None, :] & ((key0 + tt)[None, :] <= pos_q[:, None])
        if lo_q is not None:
            ok = ok & ((key0 + tt)[None, :] >= lo_q[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if POOL_BF16:
            pv = tl.dot(p, vt, input_precision="tf32")
        else:
            pv = tl.dot((p * unpool).to(tl.float16), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fp_tile(q_rows, state, pool, slot, n_valid, key0, pos_q, POOL_BF16: tl.constexpr, lo_q=None):
    """:func:`_fp_rows` over the first ``n_valid`` tokens of pool slot ``slot`` (positions ``key0 ..``).

    ``pool = (tail_k, tail_v, slot_stride, token_stride, head_stride, kv_head)`` names the pool
    and the KV head.
    """
    tail_k, tail_v, p_slot, p_tok, p_head, kvh = pool
    base = slot.to(tl.int64) * p_slot + kvh.to(tl.int64) * p_head
    return _fp_rows(q_rows, state, tail_k, tail_v, base, p_tok, n_valid, key0, pos_q, lo_q, POOL_BF16)


@triton.jit
def _fp_block_tile(q_rows, state, pool, table, n_valid, key0, pos_q, ROWS: tl.constexpr, POOL_BF16: tl.constexpr):
    """:func:`_fp_rows` over the first ``n_valid`` tokens of a tile kept as rows of blocks (``ROWS`` a
    block; token ``t`` in block ``table[t // ROWS]``), ``pool`` as for :func:`_fp_tile` with the block
    view's strides."""
    tail_k, tail_v, p_slot, p_tok, p_head, kvh = pool
    base = kvh.to(tl.int64) * p_head
    return _fp_rows(
        q_rows, state, tail_k, tail_v, base, p_tok, n_valid, key0, pos_q, None, POOL_BF16, table, p_slot, ROWS
    )
