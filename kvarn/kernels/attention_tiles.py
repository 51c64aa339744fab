"""One quantized tile's share of paged attention: its scores and its values' weighted sum.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_walk` (Triton inlines them). A program
holds ``BLOCK_M`` rows, each one (query, query head) pair of one KV head. Per quantized tile, in
the rotated frame with ``q`` pre-scaled by ``softmax_scale * log2(e)`` (``docs/internals/algorithm.md``,
"Attention over the cache")::

    s[t]  = k_tok[t] * ( sum_d (q_d k_scale[d]) code[d, t] + sum_d q_d k_zero[d] )
    o~   += v_chan * ( sum_t (p_t v_scale[t]) code[t, :] + sum_t p_t v_zero[t] )

The code products are the dots of :mod:`kvarn.kernels.attention_codes`. Planar packing hands each
bit field over as a contiguous slice: a K field is a block of channels (the score dot's reduction
axis), a V field a block of tokens (the value dot's reduction axis). Codes are read as 16-bit
words: K words pair two neighbouring tokens (the score dot runs on even and odd tokens), V words two
neighbouring channels (the value dot fills even and odd output channels). With ``FOLD`` the K
fields are not centered per code: the offsets leave the zero-point term instead. V fields are
always centered: folded, every value product carries the offset (up to 1024 times a code step)
with the same sign, and the tensor cores' truncating fp32 accumulation turned that into a bias that
grows with the context. The scores' products change sign with the query and stay within the
tolerances folded.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.attention_codes import _packed_dot, _packed_dot_raw


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
    ``q * (k_zero + 2^(K_BITS-1) k_scale)`` (the centering of :func:`~kvarn.kernels.attention_codes._unpack`),
    ``[BLOCK_M, DK]`` each. ``FOLD``: the zero-point term also subtracts
    :func:`~kvarn.kernels.attention_codes._unpack_raw`'s offset times the fp16 operand (the very values the dot
    multiplies, so the offset cancels up to fp32 rounding).
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
    :func:`~kvarn.kernels.attention_codes._unpack_raw`'s offset times the fp16 operand (the very values the dot
    multiplies, so the offset cancels up to fp32 rounding).
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
    :func:`~kvarn.kernels.attention_walk._quantized_tiles_t` applies it in the softmax's max and ``exp2``,
    cheaper than an outer product with ``k_tok`` a tile.
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
    and joining two loaded tiles cost more instructions a step.
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
def _in_window(s_e, s_o, win_lo, key0, GH: tl.constexpr):
    """Mask keys before each row's window (positions below ``win_lo: [BLOCK_M]``); ``s_e, s_o: [BLOCK_M, GH]`` hold the
    even and odd tokens from ``key0``, as for :func:`_causal`."""
    kpos = key0 + 2 * tl.arange(0, GH)
    s_e = tl.where(kpos[None, :] >= win_lo[:, None], s_e, float("-inf"))
    s_o = tl.where(kpos[None, :] + 1 >= win_lo[:, None], s_o, float("-inf"))
    return s_e, s_o


@triton.jit
def _in_window_t(s_e, s_o, win_lo, key0, GH: tl.constexpr):
    """:func:`_in_window` with the tokens on the first axis: ``s_e, s_o: [GH, N]``, ``win_lo: [N]`` (two stacked
    tiles are ``GH = G`` rows from ``key0``, tile a's token pairs then tile b's: the positions run on)."""
    kpos = key0 + 2 * tl.arange(0, GH)
    s_e = tl.where(kpos[:, None] >= win_lo[None, :], s_e, float("-inf"))
    s_o = tl.where(kpos[:, None] + 1 >= win_lo[None, :], s_o, float("-inf"))
    return s_e, s_o
