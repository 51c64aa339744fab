"""Token tiling: cut a ``[..., T, H, D]`` tensor into tiles of ``G`` tokens and a remainder.

A tile is the ``G`` consecutive tokens of one head. Tiles are laid out ``[..., N, H, G, D]`` so a
tile is one contiguous ``[G, D]`` matrix per (tile, head), the unit every later stage works on.
The ``T - N * G`` tokens that do not fill a tile stay apart, in full precision, as the method's
tail does.
"""

from __future__ import annotations

import torch
from einops import rearrange


def split_tiles(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x: [..., T, H, D]`` into ``tiles: [..., N, H, G, D]`` and ``rest: [..., T % G, H, D]``.

    ``N = T // G``. Both outputs keep the dtype of ``x``; ``tiles`` is a copy, ``rest`` a view.
    """
    t = x.shape[-3]
    n = t // group_size
    full = x[..., : n * group_size, :, :]
    tiles = rearrange(full, "... (n g) h d -> ... n h g d", g=group_size).contiguous()
    return tiles, x[..., n * group_size :, :, :]


def merge_tiles(tiles: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_tiles`: ``[..., N, H, G, D]`` and ``[..., R, H, D]`` -> ``[..., N*G + R, H, D]``."""
    full = rearrange(tiles, "... n h g d -> ... (n g) h d")
    return torch.cat([full, rest.to(full.dtype)], dim=-3)
