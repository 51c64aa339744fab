"""K and V tiles to and from the bytes of a cache record (layout: :mod:`kvarn.config`).

``encode_records`` takes tiles that :func:`kvarn.reference.quantize.prepare` already rotated and
rounded, in the pool form (read back with :func:`~kvarn.reference.quantize.from_pool`):
``k, v: [..., G, D]`` (tokens, channels) for one (tile, head) each. K is transposed to
``[D, G]`` so its rows are channels (per-channel parameters, per-token scale); V stays ``[G, D]``
(per-token parameters, per-channel scale). Both halves are quantized by the same routine.
:func:`encode_half` and :func:`decode_half` hold this orientation for one role; everything that
quantizes a K or a V half on its own (``kvarn.quantize(x, role=...)``) goes through them.
"""

from __future__ import annotations

import torch

from kvarn.config import SCALE_FIELDS, SMOOTH_FIELD, KVarNConfig
from kvarn.reference.packing import pack_codes, unpack_codes
from kvarn.reference.quantize import (
    COL_DTYPE,
    ROW_DTYPE,
    TileHalf,
    dequantize_half,
    from_pool,
    quantize_half,
    scale_half,
)
from kvarn.reference.smooth import (
    SMOOTH_DTYPE,
    sequence_smoothing_vector,
    smooth,
    smoothing_vector,
    stored_smoothing_vector,
    unsmooth,
)

ROLES = ("key", "value")

_FIELD_DTYPES = {
    "k_scale": ROW_DTYPE,
    "k_zero": ROW_DTYPE,
    "k_tok": COL_DTYPE,
    "v_scale": ROW_DTYPE,
    "v_zero": ROW_DTYPE,
    "v_chan": COL_DTYPE,
}


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be 'key' or 'value', got {role!r}")


def encode_half(tiles: torch.Tensor, role: str, cfg: KVarNConfig, smooth_vec: torch.Tensor | None = None) -> TileHalf:
    """Quantize prepared tiles ``[..., G, D]`` as the K (``role="key"``) or V half of a record.

    Returns the K half ``[..., D, G]`` (rows: channels) with ``cfg.k_bits`` codes, or the V half
    ``[..., G, D]`` (rows: tokens) with ``cfg.v_bits`` codes. With ``cfg.smooth_keys`` the K half
    is quantized from the smoothed tiles and carries its smoothing vector (``reference/smooth.py``):
    ``smooth_vec: [..., D]`` (broadcast over the tiles' leading axes, passed through
    :func:`~kvarn.reference.smooth.stored_smoothing_vector`) where given, else each tile's own (with
    ``smooth_scope="sequence"``: each tile taken as the first of its sequence, which is what a
    sequence's first tile stores; records of later tiles need their sequence's vector, through
    ``smooth_vec`` or ``store_tiles``' ``smooth_src``).
    """
    _check_role(role)
    tiles = from_pool(tiles)
    if smooth_vec is not None and not (cfg.smooth_keys and role == "key"):
        raise ValueError("smooth_vec applies to the K half of a smooth_keys format only")
    if role == "key":
        if not cfg.smooth_keys:
            return quantize_half(tiles.transpose(-1, -2), cfg.k_bits, cfg.sinkhorn_iters, cfg.normalize, cfg.k_clip)
        if smooth_vec is not None:
            s = stored_smoothing_vector(smooth_vec).expand(*tiles.shape[:-2], tiles.shape[-1])
        elif cfg.seq_smooth:
            s = sequence_smoothing_vector(tiles)
        else:
            s = smoothing_vector(tiles)
        half = quantize_half(
            smooth(tiles, s).transpose(-1, -2), cfg.k_bits, cfg.sinkhorn_iters, cfg.normalize, cfg.k_clip
        )
        return half._replace(smooth=s.to(SMOOTH_DTYPE))
    return quantize_half(tiles, cfg.v_bits, cfg.sinkhorn_iters, cfg.normalize, cfg.v_clip)


def decode_half(half: TileHalf, role: str) -> torch.Tensor:
    """Inverse of :func:`encode_half`: tiles ``[..., G, D]`` fp32 in the rotated frame."""
    _check_role(role)
    half = TileHalf(*half)
    tiles = dequantize_half(half)
    if role == "value":
        return tiles
    tiles = tiles.transpose(-1, -2)
    return tiles if half.smooth is None else unsmooth(tiles, half.smooth.float())


def quantize_kv_tiles(
    k: torch.Tensor, v: torch.Tensor, cfg: KVarNConfig, smooth_vec: torch.Tensor | None = None
) -> tuple[TileHalf, TileHalf]:
    """Quantize prepared tiles ``k, v: [..., G, D]`` -> (K half ``[..., D, G]``, V half ``[..., G, D]``).

    ``smooth_vec`` as in :func:`encode_half`.
    """
    return encode_half(k, "key", cfg, smooth_vec), encode_half(v, "value", cfg)


def pack_record(k_half: TileHalf, v_half: TileHalf, cfg: KVarNConfig) -> torch.Tensor:
    """Lay two tile halves out as records ``[..., record_bytes]`` uint8."""
    lead = k_half.codes.shape[:-2]
    parts = [
        pack_codes(k_half.codes, cfg.k_bits).flatten(-2),
        pack_codes(v_half.codes, cfg.v_bits).flatten(-2),
    ]
    fields = dict(zip(SCALE_FIELDS, (*k_half[1:4], *v_half[1:4]), strict=True))
    for name in SCALE_FIELDS:
        t = fields[name].to(_FIELD_DTYPES[name]).contiguous()
        parts.append(t.view(torch.uint8).reshape(*lead, 2 * t.shape[-1]))
    if (k_half.smooth is not None) != cfg.smooth_keys:
        raise ValueError(f"the K half {'lacks' if cfg.smooth_keys else 'has'} a smoothing vector for this config")
    if cfg.smooth_keys:
        parts.append(k_half.smooth.to(SMOOTH_DTYPE).contiguous().view(torch.uint8))
    out = torch.cat(parts, dim=-1)
    assert out.shape[-1] == cfg.record_bytes
    return out


def unpack_record(records: torch.Tensor, cfg: KVarNConfig) -> tuple[TileHalf, TileHalf]:
    """Records ``[..., record_bytes]`` uint8 -> (K half ``[..., D, G]``, V half ``[..., G, D]``)."""
    if records.dtype != torch.uint8 or records.shape[-1] != cfg.record_bytes:
        raise ValueError(
            f"records must be uint8 [..., {cfg.record_bytes}] for {cfg.name} at head_dim "
            f"{cfg.head_dim}, got {records.dtype} {tuple(records.shape)}"
        )
    d, g = cfg.head_dim, cfg.group_size
    lead = records.shape[:-1]
    off = cfg.offsets
    k_packed = records[..., : cfg.k_codes_bytes].reshape(*lead, d // cfg.k_per_byte, g)
    v_packed = records[..., off["v_codes"] : cfg.scales_offset].reshape(*lead, g // cfg.v_per_byte, d)
    fields = {}
    for name, n in cfg.field_lengths.items():
        raw = records[..., off[name] : off[name] + 2 * n].contiguous()
        fields[name] = raw.view(_FIELD_DTYPES[name])
    smooth_vec = None
    if cfg.smooth_keys:
        start = off[SMOOTH_FIELD]
        smooth_vec = records[..., start : start + cfg.smooth_bytes].contiguous().view(SMOOTH_DTYPE)
    k_codes = unpack_codes(k_packed, cfg.k_bits)
    k_half = TileHalf(k_codes, fields["k_scale"], fields["k_zero"], fields["k_tok"], smooth_vec)
    v_half = TileHalf(unpack_codes(v_packed, cfg.v_bits), fields["v_scale"], fields["v_zero"], fields["v_chan"])
    return k_half, v_half


def encode_records(
    k: torch.Tensor, v: torch.Tensor, cfg: KVarNConfig, smooth_vec: torch.Tensor | None = None
) -> torch.Tensor:
    """Prepared tiles ``k, v: [..., G, D]`` (rotated, pool form) -> records ``[..., record_bytes]`` uint8.

    ``smooth_vec`` as in :func:`encode_half`.
    """
    return pack_record(*quantize_kv_tiles(k, v, cfg, smooth_vec), cfg)


def decode_records(records: torch.Tensor, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``[..., record_bytes]`` -> ``(k, v): [..., G, D]`` fp32 in the rotated frame."""
    k_half, v_half = unpack_record(records, cfg)
    return decode_half(k_half, "key"), decode_half(v_half, "value")


def scale_records(records: torch.Tensor, k_exp: torch.Tensor, v_exp: torch.Tensor, cfg: KVarNConfig) -> torch.Tensor:
    """Records ``[..., record_bytes]`` whose K and V tiles reconstruct ``2^k_exp`` and ``2^v_exp`` times larger.

    ``k_exp, v_exp: [...]`` int. The powers of two go into the column scales (``k_tok``,
    ``v_chan``): exact while those stay normal bf16 numbers. Returns a new tensor.
    """
    k_half, v_half = unpack_record(records, cfg)
    return pack_record(scale_half(k_half, k_exp), scale_half(v_half, v_exp), cfg)
