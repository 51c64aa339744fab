"""Dequantization of one tile half from its codes and stored parameters.

A tile half (the K or V part of a record) is a ``R x C`` matrix of codes with two parameters per
row and one scale per column::

    M~[i, j] = (code[i, j] * scale[i] + zero[i]) * col[j]

For K the rows are channels and the columns tokens; for V the rows are tokens and the columns
channels (``docs/internals/algorithm.md``). The result is in the rotated frame; un-rotate with
:func:`kvarn.reference.hadamard.rotate`.
"""

from __future__ import annotations

import torch


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``codes: [..., R, C]``, ``scale, zero: [..., R]``, ``col: [..., C]`` -> ``[..., R, C]`` fp32."""
    rows = codes.to(torch.float32) * scale.float()[..., None] + zero.float()[..., None]
    return rows * col.float()[..., None, :]
