"""The paged-attention prologue: queries into the rotated frame, pre-scaled for ``exp2``.

One launch before :mod:`kvarn.kernels.attention_decode` (launched by :mod:`kvarn.kernels.attention`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import fp8e4m3_to_f32, load_f32, rotate_rows, rotate_rows_split
from kvarn.kernels.attention_merge import _unrotate


@triton.jit
def _prologue_kernel(
    query,
    q_out,
    s_q,
    s_qh,
    n_heads,
    q_out_s,
    cache,
    block_table,
    seq_lens,
    s_cb,
    s_ch,
    s_bt,
    BLOCK_H: tl.constexpr,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
    GQ: tl.constexpr = 1,
    SMOOTH: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
):
    """Grid ``(Nq,)``: ``q_out[t] = (query[t] @ H) * FACTOR`` in fp32 (``FACTOR = scale * log2(e) / sqrt(D)``).

    ``query: [Nq, Hq, D]`` fp16/bf16, ``q_out: [Nq, Hq, D]`` fp32 contiguous; ``BLOCK_H >= Hq``.
    ``H`` is the +-1 Hadamard (tf32 products of fp16/bf16 queries are exact; fp32 accumulation).
    With ``SMOOTH`` (``SEQ_SMOOTH`` records, decode: query ``t`` is sequence ``t``) it also writes
    the queries the sequence's records are scored with, ``((query[t] * s) @ H) * FACTOR``, to
    ``q_out_s`` (laid out as ``q_out``): ``s`` of each head's KV head (``GQ`` query heads each)
    from the sequence's first record, ``cache[block_table[t, 0]]`` (strides ``s_cb, s_ch, s_bt``);
    ``H`` as two tf32 dots on a hi/lo split (``x * s`` is not exact in tf32). Unused otherwise. With a
    sliding window of ``WINDOW > 0`` keys, ``s`` comes from the first record in the query's window instead
    (every record of a sequence carries it; the entries before the window are never read).
    """
    D: tl.constexpr = LAYOUT.D
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    src = query + t * s_q + heads[:, None] * s_qh  # [BLOCK_H, 1]
    HALF: tl.constexpr = D // 2
    if ROTATE and D > 128:
        ch = tl.arange(0, HALF)
        m2 = hmask[:, None] & (ch[None, :] < HALF)
        x1 = load_f32(src + ch[None, :], m2, IN_BF16)  # [BLOCK_H, HALF]
        x2 = load_f32(src + HALF + ch[None, :], m2, IN_BF16)
        x = rotate_rows_split(x1, x2, HALF, FACTOR)
    else:
        ch = tl.arange(0, D)
        x = load_f32(src + ch[None, :], hmask[:, None] & (ch[None, :] < D), IN_BF16)  # [BLOCK_H, D]
        if ROTATE:
            x = rotate_rows(x, D, FACTOR)
        else:
            x = x * FACTOR
    dd = tl.arange(0, D)
    m_out = hmask[:, None] & (dd[None, :] < D)
    tl.store(q_out + t * n_heads * D + heads[:, None] * D + dd[None, :], x, mask=m_out)
    if SMOOTH:
        if WINDOW > 0:  # the first record in the window: the entries before it are never read
            seq_len = tl.load(seq_lens + t)
            first = tl.maximum(seq_len - WINDOW, 0) // LAYOUT.G
            has_rec = (seq_len - 1) // LAYOUT.G > first
            blk0 = tl.load(block_table + t * s_bt + first, mask=has_rec, other=0).to(tl.int64)
        else:
            has_rec = tl.load(seq_lens + t) >= LAYOUT.G
            blk0 = tl.load(block_table + t * s_bt, mask=has_rec, other=0).to(tl.int64)
        kvh = (heads // GQ).to(tl.int64)
        rec = cache + blk0 * s_cb + kvh[:, None] * s_ch + LAYOUT.K_SMOOTH + dd[None, :]
        m_rec = hmask[:, None] & (dd[None, :] < D * has_rec.to(tl.int32))
        s = fp8e4m3_to_f32(tl.load(rec, mask=m_rec, other=0x38))  # [BLOCK_H, D]; 1 without a record
        xm = load_f32(src + dd[None, :], m_out, IN_BF16)
        if ROTATE:
            xs = _unrotate(xm * s, FACTOR)
        else:
            xs = xm * s * FACTOR
        tl.store(q_out_s + t * n_heads * D + heads[:, None] * D + dd[None, :], xs, mask=m_out)
