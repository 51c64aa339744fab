"""The paged-attention prologue: queries into the rotated frame, pre-scaled for ``exp2``.

One launch before :mod:`kvarn.kernels.attention_decode` (launched by :mod:`kvarn.kernels.attention`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import load_f32, rotate_rows, rotate_rows_split


@triton.jit
def _prologue_kernel(
    query,
    q_out,
    s_q,
    s_qh,
    n_heads,
    BLOCK_H: tl.constexpr,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
):
    """Grid ``(Nq,)``: ``q_out[t] = (query[t] @ H) * FACTOR`` in fp32 (``FACTOR = scale * log2(e) / sqrt(D)``).

    ``query: [Nq, Hq, D]`` fp16/bf16, ``q_out: [Nq, Hq, D]`` fp32 contiguous; ``BLOCK_H >= Hq``.
    ``H`` is the +-1 Hadamard (tf32 products of fp16/bf16 queries are exact; fp32 accumulation).
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
    tl.store(q_out + t * n_heads * D + heads[:, None] * D + dd[None, :], x, mask=hmask[:, None] & (dd[None, :] < D))
