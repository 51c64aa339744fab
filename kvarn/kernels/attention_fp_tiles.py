"""Full-precision tiles of paged attention: the sink, the own tile and the step's own keys and values.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_decode` (Triton inlines them). Tail and
sink tiles (full precision in the pool) and the step's own keys and values (pool form): fp16 pools
in fp16 dots, bf16 pools in tf32 dots (exact for bf16 values), :func:`_fp_rows`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import load_f32, pool_factor

FP_TILE_TOKENS = tl.constexpr(16)
"""Tokens per step of a full-precision pool tile (keeps the key and value blocks small in registers: at 32 the
one-warp kernel spills)."""


@triton.jit
def _fp_rows(
    q_rows, state, k_ptr, v_ptr, base, tok_stride, n_valid, key0, pos_q, lo_q, POOL_BF16: tl.constexpr,
    table=None, blk_stride=0, ROWS: tl.constexpr = 0,
):  # fmt: skip
    """Online-softmax steps over ``n_valid`` full-precision keys and values at positions ``key0 ..``.

    ``q_rows = (qn, rf)``: the rows' rotated, scaled queries ``qn * rf[:, None]`` with ``qn: [BLOCK_M, D]`` fp32,
    ``|qn| < 1``, and ``rf: [BLOCK_M]`` a power of two (:func:`~kvarn.kernels.attention_query._load_query`'s form);
    ``state = (m_i, l_i, acc)`` (``[BLOCK_M]``, ``[BLOCK_M]``, ``[BLOCK_M, D]``) in and out. The first token's ``D``
    values (pool form, one KV head) are at ``k_ptr + base``, ``v_ptr + base`` (``base`` an int64 offset), the next
    ``tok_stride`` further. With ``ROWS > 0`` the tokens are rows of blocks instead: token ``t`` is row ``t % ROWS`` of
    block ``table[t // ROWS]``, at ``base + block * blk_stride + row * tok_stride``. Row ``r`` sees positions
    ``lo_q[r] .. pos_q[r]`` (``lo_q=None``: from 0). Walks the tokens ``FP_TILE_TOKENS`` at a time (at an offset rather
    than moved pointers: fewer registers, faster).

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
def _fp_block_tile(
    q_rows, state, pool, table, n_valid, key0, pos_q, ROWS: tl.constexpr, POOL_BF16: tl.constexpr, lo_q=None
):
    """:func:`_fp_rows` over the first ``n_valid`` tokens of a tile kept as rows of blocks (``ROWS`` a
    block; token ``t`` in block ``table[t // ROWS]``), ``pool`` as for :func:`_fp_tile` with the block
    view's strides."""
    tail_k, tail_v, p_slot, p_tok, p_head, kvh = pool
    base = kvh.to(tl.int64) * p_head
    return _fp_rows(
        q_rows, state, tail_k, tail_v, base, p_tok, n_valid, key0, pos_q, lo_q, POOL_BF16, table, p_slot, ROWS
    )
