"""The Hadamard rotation.

``H`` is the normalized Sylvester Hadamard matrix of size ``D`` (a power of two)::

    H_1 = [1],   H_2n = [[H_n, H_n], [H_n, -H_n]],   H = H_D / sqrt(D)

``H`` is symmetric and orthonormal, so ``H = H^T = H^-1``: rotating twice is the identity. Each
token's K or V vector is rotated along the channel axis (``x_rot = x @ H``), which spreads an
outlier channel over all channels. Attention is unchanged, ``(qH)(kH)^T = qk^T``, and an output
computed from rotated values leaves the rotated frame with one more ``@ H``. No random signs.
"""

from __future__ import annotations

import functools

import torch

from kvarn.config import check_head_dim


@functools.cache
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / d**0.5).to(torch.float32)


def hadamard_matrix(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``H: [d, d]`` in fp32 on ``device``."""
    check_head_dim(d)
    return _hadamard_cpu(d).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` along the last axis, in fp32. ``x: [..., D]`` -> ``[..., D]`` fp32.

    Being its own inverse, the same function also un-rotates.
    """
    h = hadamard_matrix(x.shape[-1], x.device)
    return x.to(torch.float32) @ h
