"""Asymmetric round-to-nearest, one set of parameters per row.

For each row ``i`` of a balanced tile ``B: [..., R, C]`` and ``b`` bits (``qmax = 2^b - 1``)::

    lo_i   = min_j B_ij
    step_i = max((max_j B_ij - lo_i) / qmax, 1e-10)
    code_ij = clamp(round_half_even((B_ij - lo_i) / step_i), 0, qmax)

Clipped range (``clip=(unit, count)``; KVarN uses it at 2 bits, see ``KVarNConfig.clip``). The
range ``[lo_i, lo_i + qmax step_i]`` may shrink symmetrically by a fraction ``s = k / unit``
(``k = 1 .. count - 1``) of the row's width ``w_i = hi_i - lo_i``::

    lo_i(s)   = lo_i + (s / 2) w_i
    step_i(s) = max(w_i ((1 - s) / qmax), 1e-10)        s > 0; s = 0 is the unclipped pair

and each row takes the ``s`` whose reconstruction ``code step + lo`` has the smallest squared error
over the row (the first, so the largest range, on a tie), taken in steps as
``step^2 sum_j (t_j - code_j)^2`` with ``t = (b - lo) * (1 / step)`` (:func:`_row_sq_error`).
Values outside the shrunk range saturate to the end codes. Same bytes, same decoder: only the
choice of ``(lo, step)`` changes.

Choosing the parameters (:func:`choose_qparams`) is split from applying them
(:func:`quantize_rows`) so codes can be compared exactly even where a parameter differs by an ulp.
"""

from __future__ import annotations

import torch

MIN_STEP = 1e-10
"""Floor of the quantization step: a constant row gets step 1e-10 and codes 0."""


def clip_shrinks(clip: tuple[int, int] | None) -> tuple[float, ...]:
    """The fractions of a row's width a ``clip=(unit, count)`` search tries: ``k / unit``, ``k < count``."""
    if clip is None:
        return (0.0,)
    unit, count = clip
    if unit < 1 or not 1 <= count <= unit:
        raise ValueError(f"clip must be (unit, count) with 1 <= count <= unit, got {clip!r}")
    return tuple(k / unit for k in range(count))


def choose_qparams(
    b: torch.Tensor, bits: int, clip: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(lo: [..., R], step: [..., R])`` in fp32 for tiles ``b: [..., R, C]``.

    ``clip=(unit, count)`` tries the ranges shrunk by :func:`clip_shrinks` and keeps, per row, the
    one of smallest squared error (the first on a tie); ``None``: the min/max range.
    """
    b = b.to(torch.float32)
    qmax = 2**bits - 1
    lo = b.amin(dim=-1)
    hi = b.amax(dim=-1)
    width = hi - lo
    step = (width / qmax).clamp_min(MIN_STEP)
    shrinks = clip_shrinks(clip)
    if len(shrinks) == 1:
        return lo, step
    best = _row_sq_error(b, lo, step, bits)
    best_lo, best_step = lo, step
    for s in shrinks[1:]:
        lo_s = lo + width * (s / 2)
        step_s = (width * ((1 - s) / qmax)).clamp_min(MIN_STEP)
        err = _row_sq_error(b, lo_s, step_s, bits)
        take = err < best
        best = torch.where(take, err, best)
        best_lo = torch.where(take, lo_s, best_lo)
        best_step = torch.where(take, step_s, best_step)
    return best_lo, best_step


def _row_sq_error(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Squared error ``[..., R]`` of each row of ``b`` rounded with ``(lo, step)``, taken in steps.

    ``sum_j (code_j step + lo - b_j)^2 = step^2 sum_j (t_j - code_j)^2`` with ``t = (b - lo) / step``
    and ``code = clamp(round(t), 0, qmax)``. For the pick only, ``t`` is ``(b - lo) * (1 / step)``
    (a reciprocal multiply, as the kernels take it: the same fp32 ``t``, one multiply per element
    and shrink instead of a division); :func:`quantize_rows` divides.
    """
    t = (b - lo[..., None]) * (1.0 / step)[..., None]
    e = t - torch.round(t.clamp(0, 2**bits - 1))
    return step.square() * e.square().sum(-1)


def quantize_rows(b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., R, C]`` uint8 in ``[0, 2^bits - 1]`` of ``b: [..., R, C]`` given row parameters.

    ``torch.round`` rounds half to even.
    """
    q = torch.round((b.to(torch.float32) - lo[..., None]) / step[..., None])
    return q.clamp(0, 2**bits - 1).to(torch.uint8)
