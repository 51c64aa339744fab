"""Key smoothing: a per-channel scale applied to a K tile before the rotation (an option).

Why. Attention scores are ``q . k``. Some models (Qwen2.5 among them) have query channels tens of
times larger than the rest in exactly the channels where the keys vary little within a tile.
Quantizing keys per channel without a rotation (KIVI-style) gives those channels a small step
and so a small error, which the large query then multiplies. The Hadamard rotation spreads the
rounding error of every channel evenly over all channels, so those channels receive the average
error and the score error grows with the large query: on Qwen2.5-Coder-0.5B layer 0, 4-bit keys,
the attention output error is 0.71 rotated against 0.06 unrotated (``docs/guide/fidelity.md``).

What. Before the rotation each model-frame channel ``d`` of the tile is divided by::

    s_d = clamp((std_d / max_e std_e) ^ SMOOTH_EXP, SMOOTH_MIN, 1)      rounded to fp8 e4m3

with ``std_d`` the standard deviation of channel ``d`` over the tile's tokens. Channels that vary
little are scaled up, so after the rotation they take a larger share of every rotated channel's
range and come back with an error about ``s_d`` times the average: between the rotated method
(``SMOOTH_EXP = 0``: equal errors) and per-channel RTN (``SMOOTH_EXP = 1``: errors in
proportion to each channel's own spread). The decode multiplies by ``s`` again after leaving the
rotated frame, with the same stored bytes, so the smoothing itself adds no error; its only
costs are ``D`` bytes per record and, for a kernel, one more rotation per tile on the query side
(``q . k~ = ((q * s) H) . (codes-frame K)``).

Per sequence (``smooth_scope="sequence"``). Per-tile vectors make the decode rotate the query once
per tile. A sequence can instead take one vector from its first tile, leaving out the first
:data:`SEQ_SMOOTH_SKIP` token (a BOS or attention sink, whose key is unlike the rest), and
divide every tile by it: each record still stores it (the records stay self-contained and the
decoder is unchanged), and a kernel reads it from the sequence's first record and rotates the
query once. It depends only on the first tile's tokens, so a shared prefix shares it (prefix
caching stays exact). On the report's text later tiles' own vectors stay within about one fp8
step of it (``docs/guide/fidelity.md``, "One smoothing vector per sequence").

In the rotated frame the store uses (the cache keeps K rotated)::

    k~  = rotate(rotate(k_rot) / s)     before quantizing
    k_rot ~ rotate(rotate(k~) * s)      after dequantizing
"""

from __future__ import annotations

import torch

from kvarn.reference.hadamard import rotate

SMOOTH_EXP = 0.5
"""Exponent of the relative channel std: 0 = no smoothing, 1 = every channel to the same spread."""
SMOOTH_MIN = 2.0**-6
"""Floor of a smoothing factor (the smallest normal fp8 e4m3 number): a channel is scaled up at most 64x."""
SMOOTH_DTYPE = torch.float8_e4m3fn
"""Storage dtype of the smoothing vector (one byte per channel)."""
SEQ_SMOOTH_SKIP = 1
"""Tokens at the start of a sequence that its smoothing vector leaves out (``smooth_scope="sequence"``)."""


def smoothing_vector(k_rot: torch.Tensor) -> torch.Tensor:
    """The smoothing vector ``s: [..., D]`` of rotated K tiles ``[..., G, D]``: fp32, exact in fp8 e4m3.

    A tile whose channels all have zero spread (constant or empty) gets ``s = 1``.
    """
    x = rotate(k_rot.to(torch.float32))
    std = x.std(dim=-2, correction=0) if x.shape[-2] > 1 else torch.zeros_like(x[..., 0, :])
    top = std.amax(-1, keepdim=True)
    rel = torch.where(top > 0, std / torch.where(top > 0, top, torch.ones_like(top)), torch.ones_like(std))
    return stored_smoothing_vector(rel.pow(SMOOTH_EXP))


def stored_smoothing_vector(s: torch.Tensor) -> torch.Tensor:
    """``s`` as the store uses a given vector: fp32 values of fp8 e4m3 in ``[SMOOTH_MIN, 1]``.

    :func:`smoothing_vector` ends in it, so the vectors it makes pass unchanged. Anything else
    (a vector read from a record that was never written, or one a caller built) is clamped, a NaN
    or non-positive entry to ``SMOOTH_MIN``, then rounded to fp8, so a record never stores, and a
    tile is never divided by, a value its decoder would not reproduce.
    """
    s = s.float()
    s = torch.where(s >= SMOOTH_MIN, s.clamp(max=1.0), torch.full_like(s, SMOOTH_MIN))
    return s.to(SMOOTH_DTYPE).to(torch.float32)


def sequence_smoothing_vector(first_tiles: torch.Tensor) -> torch.Tensor:
    """The smoothing vector ``[..., D]`` of the sequences whose rotated first tiles are ``first_tiles: [..., G, D]``.

    :func:`smoothing_vector` of the tile without its first :data:`SEQ_SMOOTH_SKIP` tokens.
    """
    return smoothing_vector(first_tiles[..., SEQ_SMOOTH_SKIP:, :])


def smooth(k_rot: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotated K tiles ``[..., G, D]`` with their model-frame channels divided by ``s: [..., D]`` (fp32)."""
    return rotate(rotate(k_rot.to(torch.float32)) / s[..., None, :].float())


def unsmooth(k_rot: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`smooth`: model-frame channels multiplied by ``s`` (fp32, rotated frame)."""
    return rotate(rotate(k_rot.to(torch.float32)) * s[..., None, :].float())
