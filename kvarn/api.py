"""The public API: ``kvarn.quantize`` and ``kvarn.dequantize`` for experiments on KV tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn.config import DEFAULT_PRESET, KVarNConfig
from kvarn.reference.hadamard import rotate
from kvarn.reference.packing import pack_codes, unpack_codes
from kvarn.reference.quantize import TileHalf, dequantize_half, prepare, quantize_half
from kvarn.reference.record import decode_records, encode_records
from kvarn.reference.tiling import merge_tiles, split_tiles

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROLES = ("key", "value")


@dataclass(frozen=True)
class QuantizedKV:
    """A quantized ``(k, v)`` pair: packed cache records plus the full-precision remainder.

    Attributes:
        config: the format.
        records: ``[..., N, H, record_bytes]`` uint8, one record per (tile, head).
        k_rest, v_rest: ``[..., T - N * G, H, D]`` in the input dtype, the tokens after the last
            full tile (kept as the method keeps its tail).
        shape: the shape of ``k`` (and ``v``); ``dtype``: their dtype; ``stacked``: whether the
            input was one ``[2, ..., T, H, D]`` tensor.
    """

    config: KVarNConfig
    records: torch.Tensor
    k_rest: torch.Tensor
    v_rest: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    stacked: bool = False

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """``(k, v)`` in the original shape and dtype (one stacked tensor if the input was)."""
        k, v = decode_records(self.records, self.config)  # [..., N, H, G, D] rotated fp32
        if self.config.rotate:
            k, v = rotate(k), rotate(v)
        k = merge_tiles(k.to(self.dtype), self.k_rest)
        v = merge_tiles(v.to(self.dtype), self.v_rest)
        return torch.stack([k, v]) if self.stacked else (k, v)

    @property
    def nbytes(self) -> int:
        """Bytes held: records plus the full-precision remainder."""
        rest = self.k_rest.numel() * self.k_rest.element_size() * 2
        return self.records.numel() + rest

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V element, scales and remainder included."""
        return 8 * self.nbytes / (2 * self.shape.numel())

    @property
    def capacity_vs_fp16(self) -> float:
        """How many times fewer bytes than the same K and V in fp16."""
        return 16 / self.bits_per_element


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantized K or V tensor: packed codes, parameters and the full-precision remainder.

    Attributes:
        config: the format (its group size and, for ``role``, its bit width apply).
        role: ``"key"`` (tiles ``[D, G]``: per-channel parameters, per-token scale) or ``"value"``
            (tiles ``[G, D]``: per-token parameters, per-channel scale).
        packed: ``[..., N, H, R * bits // 8, C]`` uint8; ``scale, zero: [..., N, H, R]`` fp16;
            ``col: [..., N, H, C]`` bf16; ``rest: [..., T - N * G, H, D]``.
    """

    config: KVarNConfig
    role: str
    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    col: torch.Tensor
    rest: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def bits(self) -> int:
        return self.config.k_bits if self.role == "key" else self.config.v_bits

    def dequantize(self) -> torch.Tensor:
        """The tensor in its original shape and dtype."""
        half = TileHalf(unpack_codes(self.packed, self.bits), self.scale, self.zero, self.col)
        tiles = dequantize_half(half)
        if self.role == "key":
            tiles = tiles.transpose(-1, -2)
        if self.config.rotate:
            tiles = rotate(tiles)
        return merge_tiles(tiles.to(self.dtype), self.rest)

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scale, self.zero, self.col, self.rest)
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / self.shape.numel()

    @property
    def capacity_vs_fp16(self) -> float:
        return 16 / self.bits_per_element


def _check_tensor(name: str, x: object, min_rank: int = 3) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < min_rank:
        raise ValueError(f"{name} must have shape [..., T, H, D] (rank >= {min_rank}), got {tuple(x.shape)}")
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(
            f"{name} holds {bad} NaN/inf values; kvarn.quantize refuses non-finite input "
            "(the cache store path maps NaN to 0 and saturates inf instead, see docs/api.md)"
        )
    return x


def _config(preset: str | KVarNConfig, head_dim: int, **overrides) -> KVarNConfig:
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return KVarNConfig.from_preset(preset, head_dim=head_dim, **overrides)


def quantize(
    kv,
    preset: str | KVarNConfig = DEFAULT_PRESET,
    *,
    role: str | None = None,
    bits: int | None = None,
    sinkhorn_iters: int | None = None,
) -> QuantizedKV | QuantizedTensor:
    """Quantize a KV cache (or one K or V tensor) with KVarN.

    Args:
        kv: a ``(k, v)`` pair of ``[..., T, H, D]`` tensors, or one stacked ``[2, ..., T, H, D]``
            tensor; with ``role`` set, a single ``[..., T, H, D]`` tensor. Any leading dims,
            fp16/bf16/fp32, CPU or CUDA. ``T`` need not be a multiple of the tile length: the
            last ``T % G`` tokens stay in full precision.
        preset: a preset name (``kvarn_k4v2_g128``, ...) or a :class:`KVarNConfig`.
        role: ``"key"`` or ``"value"`` to quantize a single tensor.
        bits: code width for the single-tensor form (default: the preset's for that role).
        sinkhorn_iters: normalization iterations (default: the preset's, 8).

    Returns:
        :class:`QuantizedKV` for a pair, :class:`QuantizedTensor` for a single tensor.

    Raises:
        TypeError / ValueError naming the argument for non-float tensors, a wrong rank, a k/v
        shape mismatch, an unsupported head_dim, an unknown preset, or NaN/inf values.

    Example:
        >>> import torch, kvarn
        >>> k, v = torch.randn(2, 256, 8, 128, dtype=torch.float16).unbind(0)
        >>> q = kvarn.quantize((k, v), "kvarn_k4v2_g128")
        >>> k2, v2 = q.dequantize()
        >>> k2.shape, k2.dtype, round(q.capacity_vs_fp16, 2)
        (torch.Size([256, 8, 128]), torch.float16, 4.74)
    """
    if role is not None:
        if role not in ROLES:
            raise ValueError(f"role must be 'key' or 'value', got {role!r}")
        x = _check_tensor("kv", kv)
        bits_key = "k_bits" if role == "key" else "v_bits"
        cfg = _config(preset, x.shape[-1], sinkhorn_iters=sinkhorn_iters, **{bits_key: bits})
        return _quantize_one(x, role, cfg)
    if bits is not None:
        raise ValueError("bits= applies to the single-tensor form only; pass role='key' or 'value'")
    stacked = isinstance(kv, torch.Tensor)
    if stacked:
        x = _check_tensor("kv", kv, min_rank=4)
        if x.shape[0] != 2:
            raise ValueError(f"a stacked kv must have shape [2, ..., T, H, D], got {tuple(x.shape)}")
        k, v = x[0], x[1]
    elif isinstance(kv, (tuple, list)) and len(kv) == 2:
        k, v = _check_tensor("k", kv[0]), _check_tensor("v", kv[1])
    else:
        raise TypeError(f"kv must be a (k, v) pair or a stacked [2, ..., T, H, D] tensor, got {type(kv).__name__}")
    if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"k and v must match in shape, dtype and device, got k {tuple(k.shape)} {k.dtype} "
            f"{k.device} and v {tuple(v.shape)} {v.dtype} {v.device}"
        )
    cfg = _config(preset, k.shape[-1], sinkhorn_iters=sinkhorn_iters)
    k_tiles, k_rest = split_tiles(k, cfg.group_size)  # [..., N, H, G, D]
    v_tiles, v_rest = split_tiles(v, cfg.group_size)
    kr = prepare(k_tiles, k.dtype, cfg.rotate)
    vr = prepare(v_tiles, v.dtype, cfg.rotate)
    records = encode_records(kr, vr, cfg)
    return QuantizedKV(cfg, records, k_rest.clone(), v_rest.clone(), k.shape, k.dtype, stacked)


def _quantize_one(x: torch.Tensor, role: str, cfg: KVarNConfig) -> QuantizedTensor:
    tiles, rest = split_tiles(x, cfg.group_size)
    m = prepare(tiles, x.dtype, cfg.rotate)
    bits = cfg.k_bits if role == "key" else cfg.v_bits
    if role == "key":
        m = m.transpose(-1, -2)
    half = quantize_half(m, bits, cfg.sinkhorn_iters, cfg.normalize)
    packed = pack_codes(half.codes, bits)
    return QuantizedTensor(cfg, role, packed, half.scale, half.zero, half.col, rest.clone(), x.shape, x.dtype)


def dequantize(q: QuantizedKV | QuantizedTensor):
    """The tensors ``q`` was made from, reconstructed: same shape and dtype as the input."""
    if not isinstance(q, (QuantizedKV, QuantizedTensor)):
        raise TypeError(f"dequantize takes what kvarn.quantize returned, got {type(q).__name__}")
    return q.dequantize()
