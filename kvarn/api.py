"""The public API: ``kvarn.quantize`` and ``kvarn.dequantize`` for experiments on KV tensors.

Everything runs through :mod:`kvarn.ops`, so ``impl="auto"`` stores a CUDA fp16/bf16 pair with the
Triton kernels and ``QuantizedKV.records`` holds, tile for tile, the bytes the caches store
(:func:`kvarn.ops.store_tiles`). The one exception is a tile the caches would clip (fp16 values
whose rotation leaves fp16's range, values past ``2^24``, fp16 values under ``2^-14``): it is
divided by a power of two before it is stored and the power of two is folded into its column
scales, so it comes back at full range (``docs/guide/api.md`` lists every input class and its behaviour).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from kvarn import ops
from kvarn.config import DEFAULT_PRESET, SUPPORTED_HEAD_DIMS, KVarNConfig

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROLES = ("key", "value")
INPUT_LIMIT = 2.0**100
"""Largest ``|value|`` ``kvarn.quantize`` takes. A tile is stored divided by a power of two and
the power folded into its bf16 column scales; past ``2^100`` those scales (up to ~2^20 times the
largest value) could leave bf16's range, so larger values are refused."""
TINY_WARN = 2.0**-120
"""A full tile whose largest ``|value|`` is positive but below this gets a warning: its column
scales fall into bf16's subnormal range and keep fewer bits."""


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    return a == b


class _ValueEquality:
    """Value equality over dataclass fields (tensors: same dtype, shape, device and values); unhashable."""

    __hash__ = None  # equal values must hash equal, and tensors hash by identity

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))

    def __post_init__(self) -> None:
        self._check_fields()

    def __setstate__(self, state) -> None:
        # torch.load / pickle bypass __init__: check what was loaded as __post_init__ checks what is built
        if isinstance(state, tuple):
            state = state[0]
        self.__dict__.update(state)
        self._check_fields()

    def _expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
        raise NotImplementedError

    def _check_fields(self) -> None:
        """Raise a ``ValueError`` unless every tensor has the shape and dtype ``config`` and ``shape`` give it."""
        name = type(self).__name__
        problems = []
        if not isinstance(self.config, KVarNConfig):
            problems.append(f"config must be a KVarNConfig, got {type(self.config).__name__}")
        elif not isinstance(self.shape, torch.Size) or len(self.shape) < 3:
            problems.append(f"shape must be a torch.Size [..., T, H, D], got {self.shape!r}")
        elif self.shape[-1] != self.config.head_dim:
            d, want = self.shape[-1], self.config.head_dim
            problems.append(f"shape {tuple(self.shape)} ends in D={d}, config has head_dim {want}")
        elif self.dtype not in FLOAT_DTYPES:
            problems.append(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}")
        else:
            devices = set()
            for field, want in self._expected().items():
                got = getattr(self, field)
                if want is None:
                    if got is not None:
                        problems.append(f"{field} must be None for this config and role")
                    continue
                if not isinstance(got, torch.Tensor):
                    problems.append(f"{field} must be a tensor, got {type(got).__name__}")
                    continue
                devices.add(got.device)
                shape, dtype = want
                if tuple(got.shape) != shape or got.dtype != dtype:
                    problems.append(f"{field} is {tuple(got.shape)} {got.dtype}, the shape needs {shape} {dtype}")
            if len(devices) > 1:
                problems.append(f"tensors lie on several devices ({', '.join(sorted(map(str, devices)))})")
        if problems:
            raise ValueError(
                f"{name} fields disagree: {'; '.join(problems)}. kvarn.quantize builds them consistent with "
                f"{self.config.name if isinstance(self.config, KVarNConfig) else 'its config'} and shape: "
                "quantize the tensors again instead of editing a quantized object"
            )

    def _to_device(self, device) -> torch.device:
        """``device`` as a ``torch.device``; a dtype or anything else that names no device is refused."""
        name = type(self).__name__
        if isinstance(device, torch.dtype):
            raise TypeError(
                f"{name}.to() moves the quantized data between devices only; its packed bytes and its dtype "
                f"({self.dtype}) are fixed by kvarn.quantize: call dequantize() and convert what it returns "
                f"(k.to({device}))"
            )
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"{name}.to() takes a device ('cpu', 'cuda', 'cuda:1' or a torch.device), got {device!r}, "
                "which is not a device"
            ) from None


def _ratio(nbytes: int, elements: int) -> float:
    """Stored bits per element; ``nan`` for no elements (0 / 0, as ``torch.tensor([]).mean()``)."""
    return 8 * nbytes / elements if elements else math.nan


@dataclass(frozen=True, eq=False)
class QuantizedKV(_ValueEquality):
    """A quantized ``(k, v)`` pair: packed cache records plus the full-precision remainder.

    Compares by value (``==`` is true for equal copies on one device) and is not hashable.
    ``torch.save`` / ``torch.load`` work with the default ``weights_only=True``: ``import kvarn``
    registers this class, :class:`QuantizedTensor` and :class:`~kvarn.KVarNConfig` as safe globals.
    Building or loading one checks that every tensor has the shape and dtype ``config`` and
    ``shape`` give it (a ``ValueError`` otherwise); :meth:`to` moves it between devices only.

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

    def dequantize(self, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """``(k, v)`` in the original shape and dtype (one stacked tensor if the input was)."""
        k, v = ops.decode_records(self.records, self.config, impl=impl)  # [..., N, H, G, D] rotated fp32
        k = _from_tiles(k, self.k_rest, self.dtype, self.config.rotate)
        v = _from_tiles(v, self.v_rest, self.dtype, self.config.rotate)
        return torch.stack([k, v]) if self.stacked else (k, v)

    def to(self, device: torch.device | str) -> QuantizedKV:
        """A copy with every tensor on ``device`` (a device only: the dtype is fixed at quantize time)."""
        device = self._to_device(device)
        return dataclasses.replace(
            self, records=self.records.to(device), k_rest=self.k_rest.to(device), v_rest=self.v_rest.to(device)
        )

    def _expected(self):
        cfg, lead, (t, h, d) = self.config, tuple(self.shape[:-3]), tuple(self.shape[-3:])
        n = t // cfg.group_size
        rest = ((*lead, t - n * cfg.group_size, h, d), self.dtype)
        return {"records": ((*lead, n, h, cfg.record_bytes), torch.uint8), "k_rest": rest, "v_rest": rest}

    @property
    def nbytes(self) -> int:
        """Bytes held: records plus the full-precision remainder."""
        rest = self.k_rest.numel() * self.k_rest.element_size() * 2
        return self.records.numel() + rest

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V element, scales and remainder included (``nan`` for an empty input)."""
        return _ratio(self.nbytes, 2 * self.shape.numel())

    @property
    def capacity_vs_fp16(self) -> float:
        """How many times fewer bytes than the same K and V in fp16 (``nan`` for an empty input)."""
        return 16 / self.bits_per_element


@dataclass(frozen=True, eq=False)
class QuantizedTensor(_ValueEquality):
    """One quantized K or V tensor: packed codes, parameters and the full-precision remainder.

    Compares by value, is not hashable, and loads with ``weights_only=True`` (as :class:`QuantizedKV`).

    Attributes:
        config: the format (its group size and, for ``role``, its bit width apply).
        role: ``"key"`` (tiles ``[D, G]``: per-channel parameters, per-token scale) or ``"value"``
            (tiles ``[G, D]``: per-token parameters, per-channel scale).
        packed: ``[..., N, H, R * bits // 8, C]`` uint8; ``scale, zero: [..., N, H, R]`` fp16;
            ``col: [..., N, H, C]`` bf16; ``rest: [..., T - N * G, H, D]``.
        smooth: ``[..., N, H, D]`` fp8, the key smoothing vectors (keys of a ``smooth_keys``
            config only, else ``None``).
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
    smooth: torch.Tensor | None = None

    @property
    def bits(self) -> int:
        return self.config.k_bits if self.role == "key" else self.config.v_bits

    def dequantize(self, *, impl: str = "auto") -> torch.Tensor:
        """The tensor in its original shape and dtype."""
        half = (ops.unpack_codes(self.packed, self.bits), self.scale, self.zero, self.col, self.smooth)
        tiles = ops.decode_half(half, self.role, impl=impl)  # [..., N, H, G, D] rotated fp32
        return _from_tiles(tiles, self.rest, self.dtype, self.config.rotate)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """A copy with every tensor on ``device`` (a device only: the dtype is fixed at quantize time)."""
        device = self._to_device(device)
        names = ("packed", "scale", "zero", "col", "rest", "smooth")
        moved = {name: getattr(self, name).to(device) for name in names if getattr(self, name) is not None}
        return dataclasses.replace(self, **moved)

    def _expected(self):
        if self.role not in ROLES:
            raise ValueError(f"QuantizedTensor fields disagree: role must be 'key' or 'value', got {self.role!r}")
        cfg, lead, (t, h, d) = self.config, tuple(self.shape[:-3]), tuple(self.shape[-3:])
        g = cfg.group_size
        n = t // g
        rows, cols = (d, g) if self.role == "key" else (g, d)  # K tiles [D, G], V tiles [G, D]
        tile = (*lead, n, h)
        smooth = ((*tile, d), torch.float8_e4m3fn) if cfg.smooth_keys and self.role == "key" else None
        return {
            "packed": ((*tile, rows * self.bits // 8, cols), torch.uint8),
            "scale": ((*tile, rows), torch.float16),
            "zero": ((*tile, rows), torch.float16),
            "col": ((*tile, cols), torch.bfloat16),
            "rest": ((*lead, t - n * g, h, d), self.dtype),
            "smooth": smooth,
        }

    @property
    def nbytes(self) -> int:
        parts = (self.packed, self.scale, self.zero, self.col, self.rest, self.smooth)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def bits_per_element(self) -> float:
        return _ratio(self.nbytes, self.shape.numel())

    @property
    def capacity_vs_fp16(self) -> float:
        return 16 / self.bits_per_element


torch.serialization.add_safe_globals([QuantizedKV, QuantizedTensor, KVarNConfig])


def _check_tensor(name: str, x: object, min_rank: int = 3) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.is_meta:
        raise ValueError(
            f"{name} is a meta tensor (device='meta'), which holds no values to quantize: create it on a real device"
        )
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, but kvarn.quantize passes no gradient: its codes are rounded integers, and only "
            f"the last T % G tokens (kept in full precision) would get one. Quantize {name}.detach(), or call "
            "kvarn.quantize under torch.no_grad()"
        )
    if x.dim() < min_rank:
        raise ValueError(f"{name} must have shape [..., T, H, D] (rank >= {min_rank}), got {tuple(x.shape)}")
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise ValueError(
            f"{name} holds {bad} NaN/inf values; kvarn.quantize refuses non-finite input "
            "(the cache store path maps NaN to 0 and saturates inf instead, see docs/guide/api.md)"
        )
    amax = float(x.abs().amax()) if x.numel() else 0.0
    if amax > INPUT_LIMIT:
        raise ValueError(
            f"{name} holds values up to {amax:.3g}; kvarn.quantize takes |values| up to 2^100 "
            f"(~{INPUT_LIMIT:.3g}), past which the stored column scales could overflow: scale the input down"
        )
    return x


def _check_head_dim(name: str, x: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the supported head dims unless ``x``'s last dim is one."""
    d = x.shape[-1]
    if d in SUPPORTED_HEAD_DIMS:
        return
    dims = f"{', '.join(map(str, SUPPORTED_HEAD_DIMS[:-1]))} or {SUPPORTED_HEAD_DIMS[-1]}"
    if d <= 0 or d & (d - 1):
        raise ValueError(
            f"head_dim must be a power of two for the Hadamard stage, got {d} (the last dim of {name}); "
            f"kvarn supports head_dim {dims}"
        )
    raise ValueError(f"head_dim must be {dims}, got {d} (the last dim of {name})")


def _config(preset: str | KVarNConfig, head_dim: int, **overrides) -> KVarNConfig:
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return KVarNConfig.from_preset(preset, head_dim=head_dim, **overrides)


def _tiles(x: torch.Tensor, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [..., T, H, D]`` -> full tiles ``[M, G, H, D]`` (``M = prod(...) * (T // G)``) and the rest."""
    g = cfg.group_size
    t, h, d = x.shape[-3:]
    n = t // g
    m = math.prod(x.shape[:-3]) * n
    return x[..., : n * g, :, :].reshape(m, g, h, d), x[..., n * g :, :, :].clone()


def _range_scaled(tiles: torch.Tensor, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles ``[M, G, H, D]``, each (tile, head) divided by ``2^s`` where storing it as is would clip; ``s: [M, H]``."""
    per_head = tiles.transpose(1, 2)  # [M, H, G, D]
    amax = per_head.abs().amax((-2, -1))
    tiny = int(((amax > 0) & (amax < TINY_WARN)).sum())
    if tiny:
        warnings.warn(
            f"kvarn.quantize: {tiny} tile(s) have no value above 2^-120 (~{TINY_WARN:.2g}); their column "
            "scales are bf16 subnormals and keep fewer bits than the format's (docs/guide/api.md)",
            RuntimeWarning,
            stacklevel=3,
        )
    exp = ops.input_exponent(per_head, tiles.dtype, cfg.rotate)
    if not bool(exp.any()):
        return tiles, exp
    scaled = torch.ldexp(tiles.float(), -exp[:, None, :, None].float())
    return scaled.to(tiles.dtype), exp


def _from_tiles(tiles: torch.Tensor, rest: torch.Tensor, dtype: torch.dtype, rotated: bool) -> torch.Tensor:
    """Rotated fp32 tiles ``[..., N, H, G, D]`` and the rest ``[..., R, H, D]`` -> ``[..., N*G + R, H, D]``."""
    if rotated:
        tiles = ops.rotate(tiles)
    finite = torch.finfo(dtype).max  # a reconstruction a rounding step past the dtype's range saturates
    full = tiles.clamp(-finite, finite).to(dtype).transpose(-3, -2).flatten(-4, -3)
    return torch.cat([full, rest.to(full.device, dtype)], dim=-3)


def quantize(
    kv,
    preset: str | KVarNConfig = DEFAULT_PRESET,
    *,
    role: str | None = None,
    bits: int | None = None,
    sinkhorn_iters: int | None = None,
    impl: str = "auto",
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
        impl: ``"auto"`` (Triton for CUDA fp16/bf16 pairs, else the reference), ``"reference"``
            or ``"triton"`` (see :mod:`kvarn.ops`; the single-tensor form has no kernel).

    Returns:
        :class:`QuantizedKV` for a pair, :class:`QuantizedTensor` for a single tensor.

    Gradients: none. The codes are rounded integers, so an input that requires grad is refused
    while grad mode is on (a ``ValueError`` saying so) rather than given a gradient that is zero for
    every quantized token: quantize ``k.detach()``, or call it under ``torch.no_grad()``.

    Raises:
        TypeError / ValueError naming the argument for non-float tensors, a wrong rank, a single
        tensor that is not a stacked ``[2, ..., T, H, D]`` pair, a k/v shape mismatch, an
        unsupported head_dim (naming the supported ones), an unknown preset, NaN/inf values,
        values past ``2^100``, meta tensors, inputs that require grad (see above), and
        ``impl="triton"`` for tensors off CUDA. Warns (``RuntimeWarning``) for tiles whose values
        all lie below ``2^-120``.

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
        _check_head_dim("kv", x)
        bits_key = "k_bits" if role == "key" else "v_bits"
        cfg = _config(preset, x.shape[-1], sinkhorn_iters=sinkhorn_iters, **{bits_key: bits})
        return _quantize_one(x, role, cfg, impl)
    if bits is not None:
        raise ValueError("bits= applies to the single-tensor form only; pass role='key' or 'value'")
    stacked = isinstance(kv, torch.Tensor)
    if stacked:
        if kv.dim() < 4:
            raise ValueError(
                f"a single tensor must be a stacked [2, T, H, D] K/V pair (or [2, ..., T, H, D]), got shape "
                f"{tuple(kv.shape)}: pass a (k, v) tuple, or role='key' or role='value' to quantize one tensor"
            )
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
    _check_head_dim("kv" if stacked else "k", k)
    cfg = _config(preset, k.shape[-1], sinkhorn_iters=sinkhorn_iters)
    k_tiles, k_rest = _tiles(k, cfg)  # [M, G, H, D]
    v_tiles, v_rest = _tiles(v, cfg)
    k_tiles, k_exp = _range_scaled(k_tiles, cfg)
    v_tiles, v_exp = _range_scaled(v_tiles, cfg)
    m, _, h, _ = k_tiles.shape
    records = torch.empty(m, h, cfg.record_bytes, dtype=torch.uint8, device=k.device)
    if records.numel():
        block_ids = torch.arange(m, dtype=torch.int32, device=k.device)
        n_row = k.shape[-3] // cfg.group_size  # tiles per sequence: block 0 of each is its first
        smooth_src = (block_ids // n_row) * n_row if cfg.seq_smooth else None
        ops.store_tiles(k_tiles, v_tiles, block_ids, records, cfg, smooth_src, impl=impl)
        if bool(k_exp.any() or v_exp.any()):
            records = ops.scale_records(records, k_exp, v_exp, cfg)
    n = k.shape[-3] // cfg.group_size
    records = records.reshape(*k.shape[:-3], n, h, cfg.record_bytes)
    return QuantizedKV(cfg, records, k_rest, v_rest, k.shape, k.dtype, stacked)


def _quantize_one(x: torch.Tensor, role: str, cfg: KVarNConfig, impl: str) -> QuantizedTensor:
    tiles, rest = _tiles(x, cfg)  # [M, G, H, D]
    tiles, exp = _range_scaled(tiles, cfg)
    prepared = ops.prepare(tiles.transpose(1, 2), x.dtype, cfg.rotate)  # [M, H, G, D]
    smooth_vec = None
    if cfg.seq_smooth and role == "key" and prepared.shape[0]:
        per_seq = prepared.unflatten(0, (-1, x.shape[-3] // cfg.group_size))  # [B, n, H, G, D]
        s = ops.sequence_smoothing_vector(ops.from_pool(per_seq[:, 0]))  # [B, H, D]
        smooth_vec = s[:, None].expand(*per_seq.shape[:3], s.shape[-1]).reshape(*prepared.shape[:2], -1)
    half = ops.encode_half(prepared, role, cfg, smooth_vec, impl=impl)
    if bool(exp.any()):
        half = ops.scale_half(half, exp)
    bits = cfg.k_bits if role == "key" else cfg.v_bits
    lead = (*x.shape[:-3], x.shape[-3] // cfg.group_size, x.shape[-2])
    packed = ops.pack_codes(half.codes, bits)
    parts = [t.reshape(*lead, *t.shape[2:]) for t in (packed, half.scale, half.zero, half.col)]
    smooth = None if half.smooth is None else half.smooth.reshape(*lead, cfg.head_dim)
    return QuantizedTensor(cfg, role, *parts, rest, x.shape, x.dtype, smooth)


def dequantize(q: QuantizedKV | QuantizedTensor, *, impl: str = "auto"):
    """The tensors ``q`` was made from, reconstructed: same shape and dtype as the input."""
    if not isinstance(q, (QuantizedKV, QuantizedTensor)):
        raise TypeError(f"dequantize takes what kvarn.quantize returned, got {type(q).__name__}")
    return q.dequantize(impl=impl)
