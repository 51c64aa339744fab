"""Asymmetric round-to-nearest, one set of parameters per row.

For each row ``i`` of a balanced tile ``B: [..., R, C]`` and ``b`` bits (``qmax = 2^b - 1``)::

    lo_i   = min_j B_ij
    step_i = max((max_j B_ij - lo_i) / qmax, 1e-10)
    code_ij = clamp(round_half_even((B_ij - lo_i) / step_i), 0, qmax)

Clipped range (``clip=True``; KVarN uses it for 2-bit keys, ``KVarNConfig.clip_keys``). The
range ``[lo_i, lo_i + qmax step_i]`` may shrink symmetrically by a fraction ``s`` of the row's width
``w_i = hi_i - lo_i``, for ``s`` in :data:`CLIP_SHRINKS`::

    lo_i(s)   = lo_i + (s / 2) w_i
    step_i(s) = max(w_i ((1 - s) / qmax), 1e-10)        s > 0; s = 0 is the unclipped pair

and each row takes the ``s`` whose reconstruction ``code step + lo`` has the smallest squared error
over the row (the first, so the largest range, on a tie). Values outside the shrunk range saturate
to the end codes. Same bytes, same decoder: only the choice of ``(lo, step)`` changes.

Choosing the parameters (:func:`choose_qparams`) is split from applying them
(:func:`quantize_rows`) so codes can be compared exactly even where a parameter differs by an ulp.
"""

from __future__ import annotations

import torch

MIN_STEP = 1e-10
"""Floor of the quantization step: a constant row gets step 1e-10 and codes 0."""


CLIP_SHRINKS = tuple(i / 20 for i in range(10))
"""Fractions of a row's width a clipped range may give up: 0, 0.05, ..., 0.45 (0 first: ties keep it)."""


def choose_qparams(b: torch.Tensor, bits: int, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(lo: [..., R], step: [..., R])`` in fp32 for tiles ``b: [..., R, C]``.

    ``clip=True`` searches :data:`CLIP_SHRINKS` for the range with the smallest squared error.
    """
    b = b.to(torch.float32)
    qmax = 2**bits - 1
    lo = b.amin(dim=-1)
    hi = b.amax(dim=-1)
    width = hi - lo
    step = (width / qmax).clamp_min(MIN_STEP)
    if not clip:
        return lo, step
    best = _row_sq_error(b, lo, step, bits)
    best_lo, best_step = lo, step
    for s in CLIP_SHRINKS[1:]:
        lo_s = lo + width * (s / 2)
        step_s = (width * ((1 - s) / qmax)).clamp_min(MIN_STEP)
        err = _row_sq_error(b, lo_s, step_s, bits)
        take = err < best
        best = torch.where(take, err, best)
        best_lo = torch.where(take, lo_s, best_lo)
        best_step = torch.where(take, step_s, best_step)
    return best_lo, best_step


def _row_sq_error(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Squared error ``[..., R]`` of each row of ``b`` rounded with ``(lo, step)``."""
    codes = quantize_rows(b, lo, step, bits).to(torch.float32)
    return (codes * step[..., None] + lo[..., None] - b).square().sum(-1)


def quantize_rows(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., R, C]`` uint8 in ``[0, 2^bits - 1]`` of ``b: [..., R, C]`` given row parameters.

    ``torch.round`` rounds half to even.
    """
    q = torch.round((b.to(torch.float32) - lo[..., None]) / step[..., None])
    return q.clamp(0, 2**bits - 1).to(torch.uint8)
