"""The Hadamard rotation of K/V vectors read back from the cache, one launch: :func:`rotate`.

The readers that leave the rotated frame (a tail read back, tiles decoded for a transformers cache)
rotate a few tokens a layer a step; as the reference's ``log2(D)`` butterfly stages that is a few
dozen small launches each time, here it is one. The butterflies are the reference's
(:func:`~kvarn.kernels._common.fwht_rows`), so the result equals :func:`kvarn.reference.rotate` bit
for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn.config import check_head_dim
from kvarn.kernels._common import STEP_COUNTS, cdiv, fwht_rows, inv_sqrt, load_f32

ROTATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes of :func:`rotate`: the pool's, and the fp32 of decoded tiles and ``from_pool``."""
ROWS = 16
"""Vectors per program."""


@triton.jit(do_not_specialize=STEP_COUNTS)
def _rotate_kernel(
    x, out, n_rows, D: tl.constexpr, ROWS: tl.constexpr, IS_BF16: tl.constexpr, INV_SQRT_D: tl.constexpr
):
    """Grid ``(cdiv(n_rows, ROWS),)``: rows ``x: [n_rows, D]`` (contiguous) -> ``x @ H`` fp32 into ``out``."""
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ch = tl.arange(0, D)
    ok = (r < n_rows)[:, None] & (ch[None, :] < D)
    at = r[:, None] * D + ch[None, :]
    tl.store(out + at, fwht_rows(load_f32(x + at, ok, IS_BF16), INV_SQRT_D), mask=ok)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last axis, fp32: ``x: [..., D]`` fp16, bf16 or fp32 -> ``[..., D]`` fp32.

    :func:`kvarn.reference.rotate`'s result, bit for bit.
    """
    d = x.shape[-1]
    check_head_dim(d)
    if x.dtype not in ROTATE_DTYPES:
        raise ValueError(f"rotate takes float16, bfloat16 or float32 vectors, got {x.dtype}")
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n_rows = src.numel() // d
    if n_rows:
        _rotate_kernel[(cdiv(n_rows, ROWS),)](
            src, out, n_rows, D=d, ROWS=ROWS, IS_BF16=x.dtype == torch.bfloat16, INV_SQRT_D=inv_sqrt(d), num_warps=4
        )
    return out
