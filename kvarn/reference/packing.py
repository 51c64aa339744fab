"""Bit packing of codes, planar along the row axis, low bits first.

``codes: [..., R, C]`` with ``b`` bits per code (``p = 8 // b`` codes per byte) packs into
``packed: [..., R // p, C]`` uint8 where::

    packed[..., j, c] = sum_i codes[..., i * R/p + j, c] << (i * b)      for i in 0 .. p-1

The first of the ``p`` rows sharing a byte sits in the lowest bits. Unpacking field ``i`` of every
byte gives the contiguous row slice ``[i * R/p, (i + 1) * R/p)``, which is what a Triton kernel
wants: one shift and one mask per slice, no interleave. K tiles are packed along channels (their
rows), V tiles along tokens (theirs): in both cases along the reduction axis of the attention
dot that consumes them.
"""

from __future__ import annotations

import torch


def _per_byte(bits: int) -> int:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8 to pack whole codes into bytes, got {bits}")
    return 8 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes: [..., R, C]`` (uint8, each ``< 2^bits``) into ``[..., R * bits // 8, C]`` uint8."""
    per_byte = _per_byte(bits)
    if codes.shape[-2] % per_byte:
        raise ValueError(f"{codes.shape[-2]} rows do not pack {per_byte} to a byte")
    slices = codes.to(torch.uint8).unflatten(-2, (per_byte, -1))  # [..., p, R/p, C]
    out = torch.zeros_like(slices[..., 0, :, :])
    for i in range(per_byte):
        out |= slices[..., i, :, :] << (i * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., R', C]`` uint8 -> ``[..., R' * 8 // bits, C]`` uint8."""
    per_byte = _per_byte(bits)
    mask = (1 << bits) - 1
    fields = [(packed >> (i * bits)) & mask for i in range(per_byte)]
    return torch.cat(fields, dim=-2)
