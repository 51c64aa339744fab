"""Asymmetric round-to-nearest, one set of parameters per row.

For each row ``i`` of a balanced tile ``B: [..., R, C]`` and ``b`` bits (``qmax = 2^b - 1``)::

    lo_i   = min_j B_ij
    step_i = max((max_j B_ij - lo_i) / qmax, 1e-10)
    code_ij = clamp(round_half_even((B_ij - lo_i) / step_i), 0, qmax)

Choosing the parameters (:func:`choose_qparams`) is split from applying them
(:func:`quantize_rows`) so codes can be compared exactly even where a parameter differs by an ulp.
"""

from __future__ import annotations

import torch

MIN_STEP = 1e-10
"""Floor of the quantization step: a constant row gets step 1e-10 and codes 0."""


def choose_qparams(b: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(lo: [..., R], step: [..., R])`` in fp32 for tiles ``b: [..., R, C]``."""
    b = b.to(torch.float32)
    lo = b.amin(dim=-1)
    hi = b.amax(dim=-1)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(MIN_STEP)
    return lo, step


def quantize_rows(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., R, C]`` uint8 in ``[0, 2^bits - 1]`` of ``b: [..., R, C]`` given row parameters.

    ``torch.round`` rounds half to even.
    """
    q = torch.round((b.to(torch.float32) - lo[..., None]) / step[..., None])
    return q.clamp(0, 2**bits - 1).to(torch.uint8)
