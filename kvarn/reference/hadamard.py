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

    Computed as the fast Walsh-Hadamard transform: ``log2(D)`` butterfly stages ``(a, b) -> (a + b,
    a - b)`` on element pairs ``h`` apart (``h = 1, 2, 4, ...``), then one multiply by
    ``1 / sqrt(D)``. Elementwise only, so a token rotates to the same bits whatever else is in the
    batch (a BLAS matmul may not), which keeps the store paths byte-identical. Being its own
    inverse, the same function also un-rotates.
    """
    d = x.shape[-1]
    check_head_dim(d)
    y = x.to(torch.float32)
    h = 1
    while h < d:
        pairs = y.unflatten(-1, (d // (2 * h), 2, h))  # [..., blocks, 2, h]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return y * d**-0.5
