"""Hypothesis strategies for tiles: supported shapes and the value distributions that matter."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

KINDS = ("gaussian", "outlier_channel", "heavy_tokens", "constant", "zero", "tiny", "huge")


def make_tile(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """A ``[rows, cols]`` fp32 tile of the given kind (rows = K channels or V tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if kind == "outlier_channel":
        # one channel (a V column / a K row) 1000x the rest, with an offset
        x[:, cols // 3] = x[:, cols // 3] * 1000 + 50
    elif kind == "heavy_tokens":
        x = x * (torch.randn(1, cols, generator=g) / torch.rand(1, cols, generator=g).sqrt()).abs()
    elif kind == "constant":
        x = torch.full_like(x, float(torch.randn(1, generator=g)) * 10)
    elif kind == "zero":
        x = torch.zeros_like(x)
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "huge":
        x = x * 1e5
    return x


@st.composite
def tiles(draw, kinds=KINDS):
    """``(tile [R, C], kind)`` with R, C in {64, 128, 256} and one of ``kinds``."""
    rows = draw(st.sampled_from([64, 128, 256]))
    cols = draw(st.sampled_from([64, 128]))
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**16))
    return make_tile(rows, cols, kind, seed), kind
