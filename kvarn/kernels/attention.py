"""Triton attention over the paged KVarN cache: decode and multi-query (causal within the chunk).

One program serves ``BLOCK_Q`` queries x all ``Hq / Hkv`` query heads of one KV head (rows of the
``[BLOCK_M, ...]`` blocks), so each tile is read from memory once per KV head. Per quantized tile
(ALGORITHM.md section 4, rotated frame, ``q`` pre-scaled by ``softmax_scale * log2(e)``)::

    s[t]  = k_tok[t] * ( sum_d (q_d k_scale[d]) code[d, t] + sum_d q_d k_zero[d] )
    o~   += v_chan * ( sum_t (p_t v_scale[t]) code[t, :] + sum_t p_t v_zero[t] )

The code products are ``tl.dot`` on codes converted to fp16 (exact for 2- and 4-bit integers),
centered (``code - 2^(b-1)``, with the mean folded into the fp32 zero-point term) so the dot and
the zero term do not cancel. Planar packing hands each bit field over as a contiguous slice: a K
field is a block of channels (the score dot's reduction axis), a V field a block of tokens (the
value dot's reduction axis). Codes are read as 16-bit words: K words pair two neighbouring tokens
(the score dot runs on even and odd tokens), V words two neighbouring channels (the value dot
fills even and odd output channels), so one 32-bit mask unpacks two codes on the GPU.

Each query row is divided by a power of two so ``|q| < 1``; the range guard keeps every row
parameter under ``2^15``, so ``q * k_scale`` and ``p * v_scale`` fit fp16 without a per-tile scale.
Their fp16 rounding is the kernel's main error against the fp32 reference (~2e-3 of max |out|).

Tail and sink tiles (full precision in the pool) use tf32 dots: fp16/bf16 keys and values are
exact in tf32. Long contexts are split over programs (split-K). Three launches per call: the
prologue rotates and scales the queries (tf32 dot with the +-1 Hadamard, exact products), the
attention kernel, and the epilogue, which merges the splits (log-sum-exp), un-rotates (two tf32
dots on a hi/lo split) and casts to the query dtype.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from kvarn.config import KVarNConfig
from kvarn.kernels._common import (
    bf16_to_f32,
    check_cache,
    check_dtype,
    frexp_exponent,
    inv_sqrt,
    load_f32,
    rotate_rows,
    rotate_rows_split,
    store_model,
)

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)

NUM_SPLITS_OVERRIDE: int | None = None
"""Force the split-K factor, a power of two (tests use it to exercise the combine on small inputs)."""

_empty = torch.empty
"""Allocator of outputs and workspaces (tests swap in one that fills with NaN)."""

ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
"""Launch configuration of the attention kernel (benchmarks sweep them)."""


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
    if USE_ASM:
        if SHIFT == 0:
            x = tl.inline_asm_elementwise(
                f"lop3.b32 $0, $1, {MASK | (MASK << 16)}, 1677747200, 0xea;",
                "=r,r",
                [w],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
        else:
            x = tl.inline_asm_elementwise(
                f"{{ .reg .b32 t; shr.b32 t, $1, {SHIFT}; lop3.b32 $0, t, {MASK | (MASK << 16)}, 1677747200, 0xea; }}",
                "=r,r",
                [w],
                dtype=tl.int16,
                is_pure=True,
                pack=2,
            )
    else:
        x = ((w >> SHIFT) & MASK) | 0x6400
    return x.to(tl.float16, bitcast=True) - (1024.0 + (1 << (BITS - 1)))


@triton.jit
def _load_f16(ptr):
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _load_bf16(ptr):
    return bf16_to_f32(tl.load(ptr.to(tl.pointer_type(tl.int16))))


@triton.jit
def _tile_scores(
    rec,
    qs0,
    qs1,
    qs2,
    qs3,
    qz,
    rf,
    G: tl.constexpr,
    DK: tl.constexpr,
    PK: tl.constexpr,
    KB: tl.constexpr,
    K_CODES: tl.constexpr,
    K_TOK: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Scores of one quantized tile: ``(even, odd)`` tokens, each ``[BLOCK_M, G // 2]``.

    The K code bytes are read as 16-bit words ``[DK, G // 2]`` (two neighbouring tokens), so a
    32-bit register of the dot operand holds two channels' words and one mask unpacks two codes.
    """
    GH: tl.constexpr = G // 2
    jk = tl.arange(0, DK)
    ti = tl.arange(0, GH)
    kw = tl.load((rec + K_CODES).to(tl.pointer_type(tl.int16)) + jk[:, None] * GH + ti[None, :])
    s_e = tl.dot(qs0, _unpack(kw, 0, KB, 0, USE_ASM))
    s_o = tl.dot(qs0, _unpack(kw, 0, KB, 1, USE_ASM))
    s_e = tl.dot(qs1, _unpack(kw, 1, KB, 0, USE_ASM), s_e)
    s_o = tl.dot(qs1, _unpack(kw, 1, KB, 1, USE_ASM), s_o)
    if PK == 4:
        s_e = tl.dot(qs2, _unpack(kw, 2, KB, 0, USE_ASM), s_e)
        s_o = tl.dot(qs2, _unpack(kw, 2, KB, 1, USE_ASM), s_o)
        s_e = tl.dot(qs3, _unpack(kw, 3, KB, 0, USE_ASM), s_e)
        s_o = tl.dot(qs3, _unpack(kw, 3, KB, 1, USE_ASM), s_o)
    kt_e = _load_bf16(rec + K_TOK + 4 * ti)
    kt_o = _load_bf16(rec + K_TOK + 4 * ti + 2)
    s_e = (s_e + qz[:, None]) * (rf[:, None] * kt_e[None, :])
    s_o = (s_o + qz[:, None]) * (rf[:, None] * kt_o[None, :])
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
def _causal(s_e, s_o, pos_q, key0, GH: tl.constexpr):
    """Mask keys past each row's query position; ``s_e, s_o`` hold the even and odd tokens from ``key0``."""
    kpos = key0 + 2 * tl.arange(0, GH)
    s_e = tl.where(kpos[None, :] <= pos_q[:, None], s_e, float("-inf"))
    s_o = tl.where(kpos[None, :] + 1 <= pos_q[:, None], s_o, float("-inf"))
    return s_e, s_o


@triton.jit
def _attn_kernel(
    q,
    cache,
    block_table,
    seq_lens,
    tail_k,
    tail_v,
    tail_slots,
    sink_slots,
    query_start_loc,
    out,
    ws_m,
    ws_l,
    num_seqs,
    s_q,
    s_qh,
    s_cb,
    s_ch,
    s_bt,
    p_slot,
    p_tok,
    p_head,
    s_ws,
    num_splits,
    GQ: tl.constexpr,
    GQP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_CODES: tl.constexpr,
    V_CODES: tl.constexpr,
    K_SCALE: tl.constexpr,
    K_ZERO: tl.constexpr,
    K_TOK: tl.constexpr,
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    V_CHAN: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_SINK: tl.constexpr,
    POOL_BF16: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Grid ``(query blocks, Hkv, NUM_SPLITS)``; writes ``out`` (one split) or the split partials."""
    PK: tl.constexpr = 8 // K_BITS
    PV: tl.constexpr = 8 // V_BITS
    DK: tl.constexpr = D // PK
    CT: tl.constexpr = G // PV
    KC: tl.constexpr = 1 << (K_BITS - 1)  # code centering, see _unpack
    VC: tl.constexpr = 1 << (V_BITS - 1)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if MULTI_Q:
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
    else:
        seq = pid
        q_start = pid
        n_q = 1
        q_first = 0

    if q_first < n_q:
        seq_len = tl.load(seq_lens + seq)
        rows = tl.arange(0, BLOCK_M)
        qi = rows // GQP
        hj = rows % GQP
        q_local = q_first + qi
        row_ok = (hj < GQ) & (q_local < n_q)
        q_row = (q_start + q_local).to(tl.int64)
        head = kvh * GQ + hj
        pos_q = seq_len - n_q + q_local  # [BLOCK_M]

        q_base = q + q_row[:, None] * s_q + head[:, None] * s_qh
        qmax = tl.max(tl.abs(tl.load(q_base + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)), axis=1)
        e = frexp_exponent(qmax)
        q_norm = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e: |q| * 2^-e < 1
        rf = ((127 + e) << 23).to(tl.float32, bitcast=True)
        dk = tl.arange(0, DK)
        q0 = tl.load(q_base + dk[None, :], mask=row_ok[:, None], other=0.0) * q_norm[:, None]
        q1 = tl.load(q_base + DK + dk[None, :], mask=row_ok[:, None], other=0.0) * q_norm[:, None]
        if PK == 4:
            q2 = tl.load(q_base + 2 * DK + dk[None, :], mask=row_ok[:, None], other=0.0) * q_norm[:, None]
            q3 = tl.load(q_base + 3 * DK + dk[None, :], mask=row_ok[:, None], other=0.0) * q_norm[:, None]

        n_full = seq_len // G
        rem = seq_len % G
        n_units = n_full + (rem > 0).to(tl.int32)
        if MULTI_Q:
            last_pos = seq_len - n_q + tl.minimum(n_q, q_first + BLOCK_Q) - 1
            n_units = tl.minimum(n_units, last_pos // G + 1)
        per = tl.cdiv(n_units, num_splits)
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
        qt1 = tl.minimum(u1, n_full)

        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_e = tl.zeros([BLOCK_M, G // 2], tl.float32)
        acc_e = tl.zeros([BLOCK_M, D // 2], tl.float32)
        acc_o = tl.zeros([BLOCK_M, D // 2], tl.float32)
        dd = tl.arange(0, D)
        dh = tl.arange(0, D // 2)
        jv = tl.arange(0, CT)
        th = tl.arange(0, G // 2)
        bt_row = block_table + seq.to(tl.int64) * s_bt

        for u in range(qt0, qt1):
            blk = tl.load(bt_row + u).to(tl.int64)
            rec = cache + blk * s_cb + kvh.to(tl.int64) * s_ch
            ks = _load_f16(rec + K_SCALE + 2 * dk)
            kz = _load_f16(rec + K_ZERO + 2 * dk) + KC * ks
            qs0 = (q0 * ks[None, :]).to(tl.float16)
            qz_e = q0 * kz[None, :]
            ks = _load_f16(rec + K_SCALE + 2 * (DK + dk))
            kz = _load_f16(rec + K_ZERO + 2 * (DK + dk)) + KC * ks
            qs1 = (q1 * ks[None, :]).to(tl.float16)
            qz_e += q1 * kz[None, :]
            qs2 = qs0
            qs3 = qs0
            if PK == 4:
                ks = _load_f16(rec + K_SCALE + 2 * (2 * DK + dk))
                kz = _load_f16(rec + K_ZERO + 2 * (2 * DK + dk)) + KC * ks
                qs2 = (q2 * ks[None, :]).to(tl.float16)
                qz_e += q2 * kz[None, :]
                ks = _load_f16(rec + K_SCALE + 2 * (3 * DK + dk))
                kz = _load_f16(rec + K_ZERO + 2 * (3 * DK + dk)) + KC * ks
                qs3 = (q3 * ks[None, :]).to(tl.float16)
                qz_e += q3 * kz[None, :]
            qz = tl.sum(qz_e, axis=1)

            s_e, s_o = _tile_scores(rec, qs0, qs1, qs2, qs3, qz, rf, G, DK, PK, K_BITS, K_CODES, K_TOK, USE_ASM)
            if MULTI_Q:
                s_e, s_o = _causal(s_e, s_o, pos_q, u * G, G // 2)
            m_new = tl.maximum(m_i, tl.max(tl.maximum(s_e, s_o), axis=1))
            alpha = tl.exp2(m_i - m_new)
            p_e = tl.exp2(s_e - m_new[:, None])
            p_o = tl.exp2(s_o - m_new[:, None])
            l_e = l_e * alpha[:, None] + (p_e + p_o)
            vs_e = _load_f16(rec + V_SCALE + 4 * th)
            vs_o = _load_f16(rec + V_SCALE + 4 * th + 2)
            vz_e = _load_f16(rec + V_ZERO + 4 * th) + VC * vs_e
            vz_o = _load_f16(rec + V_ZERO + 4 * th + 2) + VC * vs_o
            z = tl.sum(p_e * vz_e[None, :] + p_o * vz_o[None, :], axis=1)
            pv_e = (p_e * vs_e[None, :]).to(tl.float16)
            pv_o = (p_o * vs_o[None, :]).to(tl.float16)
            pv = tl.reshape(tl.join(pv_e, pv_o), (BLOCK_M, G))  # tokens in order
            pv0, pv1, pv2, pv3 = _split_fields(pv, BLOCK_M, PV, CT)

            vw = tl.load((rec + V_CODES).to(tl.pointer_type(tl.int16)) + jv[:, None] * (D // 2) + dh[None, :])
            o_e = tl.dot(pv0, _unpack(vw, 0, V_BITS, 0, USE_ASM))
            o_o = tl.dot(pv0, _unpack(vw, 0, V_BITS, 1, USE_ASM))
            o_e = tl.dot(pv1, _unpack(vw, 1, V_BITS, 0, USE_ASM), o_e)
            o_o = tl.dot(pv1, _unpack(vw, 1, V_BITS, 1, USE_ASM), o_o)
            if PV == 4:
                o_e = tl.dot(pv2, _unpack(vw, 2, V_BITS, 0, USE_ASM), o_e)
                o_o = tl.dot(pv2, _unpack(vw, 2, V_BITS, 1, USE_ASM), o_o)
                o_e = tl.dot(pv3, _unpack(vw, 3, V_BITS, 0, USE_ASM), o_e)
                o_o = tl.dot(pv3, _unpack(vw, 3, V_BITS, 1, USE_ASM), o_o)
            vc_e = _load_bf16(rec + V_CHAN + 4 * dh)
            vc_o = _load_bf16(rec + V_CHAN + 4 * dh + 2)
            acc_e = acc_e * alpha[:, None] + (o_e + z[:, None]) * vc_e[None, :]
            acc_o = acc_o * alpha[:, None] + (o_o + z[:, None]) * vc_o[None, :]
            m_i = m_new

        l_i = tl.sum(l_e, axis=1)
        acc = tl.reshape(tl.join(acc_e, acc_o), (BLOCK_M, D))
        if (has_sink & (u0 == 0)) | ((rem > 0) & (u0 <= n_full) & (n_full < u1)):
            q_full = tl.load(q_base + dd[None, :], mask=row_ok[:, None], other=0.0)
            if has_sink & (u0 == 0):
                m_i, l_i, acc = _fp_tile(
                    q_full,
                    m_i,
                    l_i,
                    acc,
                    tail_k,
                    tail_v,
                    sink_slot,
                    G,
                    pos_q,
                    0,
                    p_slot,
                    p_tok,
                    p_head,
                    kvh,
                    dd,
                    16,
                    POOL_BF16,
                )
            if (rem > 0) & (u0 <= n_full) & (n_full < u1):
                slot = tl.load(tail_slots + seq)
                m_i, l_i, acc = _fp_tile(
                    q_full,
                    m_i,
                    l_i,
                    acc,
                    tail_k,
                    tail_v,
                    slot,
                    rem,
                    pos_q,
                    n_full * G,
                    p_slot,
                    p_tok,
                    p_head,
                    kvh,
                    dd,
                    16,
                    POOL_BF16,
                )

        out_rows = q_row[:, None] * s_q + head[:, None] * s_qh + dd[None, :]
        if not SPLIT:
            res = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(out + out_rows, res, mask=row_ok[:, None])
        else:
            ws_rows = split.to(tl.int64) * s_ws + q_row * (s_q // D) + head
            tl.store(ws_m + ws_rows, m_i, mask=row_ok)
            tl.store(ws_l + ws_rows, l_i, mask=row_ok)
            tl.store(out + split.to(tl.int64) * s_ws * D + out_rows, acc, mask=row_ok[:, None])


@triton.jit
def _fp_tile(
    q_full,
    m_i,
    l_i,
    acc,
    tail_k,
    tail_v,
    slot,
    n_valid,
    pos_q,
    key0,
    p_slot,
    p_tok,
    p_head,
    kvh,
    dd,
    FT: tl.constexpr,
    POOL_BF16: tl.constexpr,
):
    """Online-softmax steps over one full-precision pool tile: ``n_valid`` tokens at positions ``key0 ..``.

    Walks the tile ``FT`` tokens at a time so the tf32 operands stay small in registers.
    """
    base = slot.to(tl.int64) * p_slot + kvh.to(tl.int64) * p_head
    ft = tl.arange(0, FT)
    for c in range(0, n_valid, FT):
        tt = c + ft
        ptr = base + tt[:, None] * p_tok + dd[None, :]
        tok_ok = tt < n_valid
        kt = load_f32(tail_k + ptr, tok_ok[:, None], POOL_BF16)  # [FT, D]
        vt = load_f32(tail_v + ptr, tok_ok[:, None], POOL_BF16)
        s = tl.dot(q_full, tl.trans(kt), input_precision="tf32")  # [BLOCK_M, FT]
        ok = tok_ok[None, :] & ((key0 + tt)[None, :] <= pos_q[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="tf32")
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _prologue_kernel(
    query,
    q_out,
    s_q,
    s_qh,
    n_heads,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
):
    """Grid ``(Nq,)``: ``q_out[t] = (query[t] @ H) * FACTOR`` in fp32 (``FACTOR = scale * log2(e) / sqrt(D)``).

    ``H`` is the +-1 Hadamard (tf32 products of fp16/bf16 queries are exact; fp32 accumulation).
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    src = query + t * s_q + heads[:, None] * s_qh
    HALF: tl.constexpr = D // 2
    if ROTATE and D > 128:
        ch = tl.arange(0, HALF)
        m2 = hmask[:, None] & (ch[None, :] < HALF)
        x1 = load_f32(src + ch[None, :], m2, IN_BF16)
        x2 = load_f32(src + HALF + ch[None, :], m2, IN_BF16)
        x = rotate_rows_split(x1, x2, HALF, FACTOR)
    else:
        ch = tl.arange(0, D)
        x = load_f32(src + ch[None, :], hmask[:, None] & (ch[None, :] < D), IN_BF16)
        if ROTATE:
            x = rotate_rows(x, D, FACTOR)
        else:
            x = x * FACTOR
    dd = tl.arange(0, D)
    tl.store(q_out + t * n_heads * D + heads[:, None] * D + dd[None, :], x, mask=hmask[:, None] & (dd[None, :] < D))


@triton.jit
def _split_tf32(x):
    """``x`` (fp32) as ``hi + lo`` with ``hi`` exact in tf32 (low 13 mantissa bits cleared)."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _epilogue_kernel(
    part,
    ws_m,
    ws_l,
    out,
    n_rows,
    num_splits,
    n_heads,
    s_o,
    s_oh,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTATE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Grid ``(Nq,)``: merge the split partials (log-sum-exp), un-rotate, cast and store one query's heads.

    Un-rotation runs as two tf32 dots with the +-1 Hadamard on ``hi + lo`` parts of ``o~``
    (``hi`` exact in tf32, ``lo`` below 2^-11 of it), so it keeps ~22 bits.
    """
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    dd = tl.arange(0, D)
    rows = t * n_heads + heads
    m2 = hmask[:, None] & (dd[None, :] < D)
    if SPLIT:
        m_max = tl.full([BLOCK_H], -1.0e30, tl.float32)
        for sp in range(num_splits):
            m_max = tl.maximum(m_max, tl.load(ws_m + sp * n_rows + rows, mask=hmask, other=-1.0e30))
        den = tl.zeros([BLOCK_H], tl.float32)
        o = tl.zeros([BLOCK_H, D], tl.float32)
        for sp in range(num_splits):
            w = tl.exp2(tl.load(ws_m + sp * n_rows + rows, mask=hmask, other=-1.0e30) - m_max)
            den += w * tl.load(ws_l + sp * n_rows + rows, mask=hmask, other=0.0)
            a = tl.load(part + (sp * n_rows + rows)[:, None] * D + dd[None, :], mask=m2, other=0.0)
            o += a * w[:, None]
        o = o / tl.where(den > 0.0, den, 1.0)[:, None]
    else:
        o = tl.load(part + rows[:, None] * D + dd[None, :], mask=m2, other=0.0)
    if ROTATE:
        HALF: tl.constexpr = D // 2
        if D > 128:
            o3 = tl.permute(tl.reshape(o, (BLOCK_H, 2, HALF)), (0, 2, 1))
            o1, o2 = tl.split(o3)
            h1, l1 = _split_tf32(o1)
            h2, l2 = _split_tf32(o2)
            o = rotate_rows_split(h1, h2, HALF, INV_SQRT_D) + rotate_rows_split(l1, l2, HALF, INV_SQRT_D)
        else:
            hi, lo = _split_tf32(o)
            o = rotate_rows(hi, D, INV_SQRT_D) + rotate_rows(lo, D, INV_SQRT_D)
    dst = out + t * s_o + heads[:, None] * s_oh + dd[None, :]
    store_model(dst, o, m2, OUT_BF16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _choose_splits(programs: int, max_units: int, device: torch.device) -> int:
    """Split-K factor: enough programs for ~8 waves (3 resident per SM), at least 2 tiles per split.

    Each program walks its tiles one after another, so short splits also cut the latency of small
    batches; the epilogue merges the partials.
    """
    if NUM_SPLITS_OVERRIDE is not None:
        return NUM_SPLITS_OVERRIDE
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    want = triton.cdiv(8 * 3 * sms, programs)
    return max(1, min(want, max_units // 2, 64))


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    cfg: KVarNConfig,
    query_start_loc: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``query: [Nq, Hq, D]`` over the paged cache -> ``[Nq, Hq, D]`` in ``query.dtype``.

    Same contract as :func:`kvarn.reference.paged_attention`: ``cache: [num_blocks, Hkv, record_bytes]``,
    ``block_table: [B, max_blocks]``, ``seq_lens: [B]``, ``tail_k, tail_v: [num_slots, G, Hkv, D]``,
    ``tail_slots: [B]``, ``query_start_loc: [B + 1]`` or ``None`` (one query per sequence),
    ``sink_slots: [B]`` or ``None``, ``scale`` default ``1 / sqrt(D)``.
    """
    check_dtype("query", query)
    check_cache(cache, cfg)
    check_dtype("tail_k", tail_k)
    nq, hq, d = query.shape
    hkv = cache.shape[1]
    if d != cfg.head_dim:
        raise ValueError(f"query head_dim {d} does not match the config's {cfg.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if (
        tail_k.shape[1:] != (cfg.group_size, hkv, d)
        or tail_v.shape != tail_k.shape
        or tail_v.stride() != tail_k.stride()
    ):
        raise ValueError(
            f"tail_k, tail_v must both be [num_slots, {cfg.group_size}, {hkv}, {d}], got {tuple(tail_k.shape)}"
        )
    batch = seq_lens.shape[0]
    multi_q = query_start_loc is not None
    if not multi_q and nq != batch:
        raise ValueError(f"without query_start_loc there is one query per sequence: {nq} queries for {batch} sequences")
    if multi_q and query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < batch or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be [B, max_blocks] with unit last stride, got {tuple(block_table.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out_dtype = query.dtype
    if query.stride(-1) != 1:
        query = query.contiguous()
    if nq == 0:
        return torch.empty_like(query)

    block_h = max(16, triton.next_power_of_2(hq))
    q = _empty(nq, hq, d, dtype=torch.float32, device=query.device)
    _prologue_kernel[(nq,)](
        query,
        q,
        query.stride(0),
        query.stride(1),
        hq,
        D=d,
        BLOCK_H=block_h,
        ROTATE=cfg.rotate,
        IN_BF16=query.dtype == torch.bfloat16,
        FACTOR=scale * LOG2E * (inv_sqrt(d) if cfg.rotate else 1.0),
        num_warps=4,
    )

    group = hq // hkv
    gqp = triton.next_power_of_2(group)
    if multi_q:
        block_q = max(1, 16 // gqp)
        n_blocks = triton.cdiv(nq, block_q) + batch
    else:
        block_q = 1
        n_blocks = batch
    block_m = max(16, block_q * gqp)
    max_units = block_table.shape[1] + 1
    splits = _choose_splits(n_blocks * hkv, max_units, q.device)

    rows = nq * hq
    part = _empty(splits, nq, hq, d, dtype=torch.float32, device=q.device)
    if splits > 1:
        ws_m = _empty(splits, nq, hq, dtype=torch.float32, device=q.device)
        ws_l = _empty(splits, nq, hq, dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = part
    off = cfg.offsets
    if tail_slots.dtype != torch.int32:
        tail_slots = tail_slots.to(torch.int32)
    sinks = tail_slots if sink_slots is None else sink_slots
    if sinks.dtype != torch.int32:
        sinks = sinks.to(torch.int32)
    _attn_kernel[(n_blocks, hkv, splits)](
        q,
        cache,
        block_table,
        seq_lens,
        tail_k,
        tail_v,
        tail_slots,
        sinks,
        query_start_loc if multi_q else seq_lens,
        part,
        ws_m,
        ws_l,
        batch,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        rows,
        splits,
        GQ=group,
        GQP=gqp,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        D=d,
        G=cfg.group_size,
        K_BITS=cfg.k_bits,
        V_BITS=cfg.v_bits,
        K_CODES=off["k_codes"],
        V_CODES=off["v_codes"],
        K_SCALE=off["k_scale"],
        K_ZERO=off["k_zero"],
        K_TOK=off["k_tok"],
        V_SCALE=off["v_scale"],
        V_ZERO=off["v_zero"],
        V_CHAN=off["v_chan"],
        MULTI_Q=multi_q,
        HAS_SINK=sink_slots is not None,
        POOL_BF16=tail_k.dtype == torch.bfloat16,
        SPLIT=splits > 1,
        USE_ASM=not _interpreting(),
        num_warps=ATTN_NUM_WARPS,
        num_stages=ATTN_NUM_STAGES,
    )
    out = _empty(nq, hq, d, dtype=out_dtype, device=q.device)
    _epilogue_kernel[(nq,)](
        part,
        ws_m,
        ws_l,
        out,
        rows,
        splits,
        hq,
        out.stride(0),
        out.stride(1),
        D=d,
        BLOCK_H=block_h,
        SPLIT=splits > 1,
        ROTATE=cfg.rotate,
        OUT_BF16=out_dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(d),
        num_warps=4,
    )
    return out
