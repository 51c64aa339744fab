"""The methods the harness compares: KVarN presets and baselines at comparable bits.

Every method keeps the same full-precision regions: tokens of a tile that is not full yet (the
tail) stay in the store dtype, and with ``sink=True`` the first tile of the sequence too; a tile is
quantized when its last token arrives. So two methods differ only in how a full tile is stored.

=========================  ===========================================================  =========
name                       what a full tile becomes                                     storage
=========================  ===========================================================  =========
``fp16``                   fp16 K and V                                                 real
``fp8_e4m3``               fp8 e4m3 at scale 1.0, values past +-448 saturate (vLLM's    real
                           default ``kv_cache_dtype="fp8"`` without scales)
``fp8_e4m3_amax``          fp8 e4m3 with one scale per layer for K and one for V,       real
                           amax / 448 of that layer on the evaluated text (calibrated)
``kvarn_k{K}v{V}_g{G}``    a KVarN record (Hadamard + Sinkhorn + RTN), the preset       KVarN
``kivi_k{K}v{V}_g{G}``     the same record layout, ``rotate=False, normalize=False``:   KVarN
                           per-channel K, per-token V asymmetric RTN (KIVI-style),
                           min/max ranges (``clip=False``)
``hadrtn_k{K}v{V}_g{G}``   ``normalize=False, clip=False``: Hadamard then               KVarN
                           min/max RTN (QuaRot-style)
``hadclip_k{K}v{V}_g{G}``  ``normalize=False``: Hadamard then RTN with KVarN's clipped     KVarN
                           2-bit ranges (the stage ablation: KVarN without Sinkhorn)
``sinkhorn_k{K}v{V}_g{G}`` ``rotate=False``: variance normalization without Hadamard    KVarN
``smooth_k{K}v{V}_g{G}``   ``smooth_keys=True``: KVarN with key smoothing (D bytes      KVarN
                           more per record; ``kvarn/reference/smooth.py``)
``seqsmooth_k{K}v{V}_g{G}`` ``smooth_scope="sequence"``: key smoothing with one vector    KVarN
                           per sequence, from its first tile (same bytes as ``smooth``)
=========================  ===========================================================  =========

A method of a family without smoothing may end in ``_ks``, as the preset names do
(:data:`kvarn.config.KEY_SMOOTH_SUFFIX`): ``kvarn_k4v2_g128_ks`` is ``seqsmooth_k4v2_g128``, and
``hadrtn_k4v2_g128_ks`` is Hadamard + RTN with per-sequence key smoothing.

Any KVarN-record method takes a per-layer policy (:class:`kvarn.config.LayerPolicy`) as a suffix:
``+first{N}`` keeps the first ``N`` layers, ``+last{M}`` the last ``M``, ``+layer{i}`` layer ``i``
(repeatable), unquantized in the store dtype, or with ``@k{K}v{V}`` as records of that preset (same
tile length, same switches). ``kvarn_k2v2_g128+first1+last1`` keeps layers 0 and L-1 in fp16;
``kvarn_k2v2_g128+first2@k4v4`` keeps layers 0 and 1 at ``kvarn_k4v4_g128``. Its bits per element
are the average over the model's layers.

"real" storage keeps fp8 / fp16 tensors in the cache (``SimpleTiledCache``); "KVarN" means
:class:`kvarn.integration.hf.KVarNCache` storing packed records. The three RTN variants use the
record layout of their preset, so they have exactly its bits per element; ``smooth_*`` and
``seqsmooth_*`` store one byte per channel more per record (its bits per element are reported as such).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kvarn
from kvarn.config import KEY_SMOOTH_SUFFIX, PRESETS, KVarNConfig, LayerPolicy, with_key_smoothing

FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""

FAMILIES = {
    "kvarn": ("KVarN", {}),
    "kivi": ("KIVI-style RTN", {"rotate": False, "normalize": False, "clip": False}),
    "hadrtn": ("Hadamard + RTN", {"normalize": False, "clip": False}),
    "hadclip": ("Hadamard + clipped RTN", {"normalize": False}),
    "sinkhorn": ("Sinkhorn w/o Hadamard", {"rotate": False}),
    "smooth": ("KVarN + key smoothing", {"smooth_keys": True}),
    "seqsmooth": ("KVarN + per-sequence key smoothing", {"smooth_keys": True, "smooth_scope": "sequence"}),
}
DEFAULT_METHODS = (
    "fp16",
    "fp8_e4m3",
    "fp8_e4m3_amax",
    "kvarn_k4v2_g128",
    "kivi_k4v2_g128",
    "hadrtn_k4v2_g128",
    "kvarn_k2v2_g128",
    "kivi_k2v2_g128",
)
GOAL_METHODS = (*DEFAULT_METHODS, "sinkhorn_k4v2_g128")
ALL_BASELINES = (
    "fp16",
    "fp8_e4m3",
    "fp8_e4m3_amax",
    *(f"{fam}_{p.removeprefix('kvarn_')}" for fam in FAMILIES for p in ("kvarn_k4v2_g128", "kvarn_k2v2_g128")),
)


@dataclass(frozen=True)
class Method:
    """One way of storing a full tile; see the module table."""

    name: str
    family: str
    config: KVarNConfig | None = None  # KVarN-record methods (head_dim is replaced per model)
    fp8: str | None = None  # "unit" or "amax" for the fp8 methods
    policy: LayerPolicy | None = None  # layers kept at a higher precision (KVarN-record methods)

    @property
    def group_size(self) -> int:
        return self.config.group_size if self.config else 128

    def for_head_dim(self, head_dim: int) -> KVarNConfig:
        return dataclasses.replace(self.config, head_dim=head_dim)

    def layer_config(self, layer: int, num_layers: int | None, head_dim: int) -> KVarNConfig | None:
        """The format of layer ``layer``: the method's config, a kept layer's, or None (store dtype)."""
        base = self.for_head_dim(head_dim)
        return base if self.policy is None else self.policy.config_for(layer, num_layers, base)

    def bits_per_element(self, head_dim: int, num_layers: int | None = None) -> float:
        """Stored bits per K or V element of a full tile, scales included (averaged over layers with a policy)."""
        if self.policy is not None:
            if num_layers is None:
                raise ValueError(f"method {self.name} keeps some layers: its bits per element need num_layers")
            return self.policy.bits_per_element(self.for_head_dim(head_dim), num_layers)
        if self.config is not None:
            return self.for_head_dim(head_dim).bits_per_element
        return 8.0 if self.fp8 else 16.0

    def capacity_vs_fp16(self, head_dim: int, num_layers: int | None = None) -> float:
        return 16.0 / self.bits_per_element(head_dim, num_layers)

    def make_cache(
        self,
        *,
        sink: bool,
        dtype: torch.dtype,
        scales=None,
        keep_decoded: bool = False,
        num_layers: int | None = None,
        paged: bool = False,
    ):
        """A fresh transformers cache storing full tiles this way (``paged``: ``KVarNCache(paged=True)``, for
        ``attn_implementation="kvarn"``; KVarN-record methods only)."""
        if self.config is not None:
            from kvarn.integration.hf import KVarNCache

            return KVarNCache(
                self.config,
                sink=sink,
                dtype=dtype,
                keep_decoded=keep_decoded,
                layer_policy=self.policy,
                num_layers=num_layers,
                paged=paged,
            )
        if paged:
            raise ValueError(f"method {self.name} stores tiles as {self.fp8 or 'fp16'} tensors: it has no paged cache")
        return SimpleTiledCache(self._codec(scales), self.group_size, sink=sink, dtype=dtype)

    def _codec(self, scales):
        if self.fp8 is None:
            return Codec(torch.float16, None)
        if self.fp8 == "amax" and scales is None:
            raise ValueError(f"method {self.name} needs per-layer amax scales (from the reference run)")
        return Codec(torch.float8_e4m3fn, scales if self.fp8 == "amax" else None)

    def roundtrip(self, k: torch.Tensor, v: torch.Tensor, layer: int, scales=None, num_layers: int | None = None):
        """Static mode: ``k, v: [T, Hkv, D]`` with every full tile stored and read back (rest exact)."""
        if self.config is not None:
            cfg = self.layer_config(layer, num_layers, k.shape[-1])
            if cfg is None:
                return k, v
            return kvarn.quantize((k, v), cfg).dequantize()
        codec = self._codec(scales)
        return codec.roundtrip(k, layer, 0), codec.roundtrip(v, layer, 1)


def parse_policy(suffix: str, group_size: int) -> LayerPolicy:
    """The :class:`LayerPolicy` of a method-name suffix such as ``+first1+last1`` or ``+first2@k4v4``.

    ``@k{K}v{V}`` names the preset ``kvarn_k{K}v{V}_g{group_size}`` (the method's tile length).
    """
    rest, _, keep = suffix.partition("@")
    first = last = 0
    layers: list[int] = []
    for part in rest.split("+")[1:]:
        for prefix in ("first", "last", "layer"):
            number = part.removeprefix(prefix)
            if number != part and number.lstrip("-").isdigit():
                if prefix == "first":
                    first = int(number)
                elif prefix == "last":
                    last = int(number)
                else:
                    layers.append(int(number))
                break
        else:
            raise ValueError(
                f"unknown layer policy part {part!r} in {suffix!r}: use +first<N>, +last<M>, +layer<i> and an "
                "optional @k<K>v<V> (e.g. kvarn_k2v2_g128+first1+last1@k4v4)"
            )
    if not (first or last or layers):
        raise ValueError(f"layer policy {suffix!r} keeps no layer: give +first<N>, +last<M> or +layer<i>")
    preset = f"kvarn_{keep}_g{group_size}" if keep else None
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"layer policy {suffix!r}: @{keep} names no preset with {group_size}-token tiles")
    return LayerPolicy(first=first, last=last, layers=tuple(layers), keep=preset)


def served_method(name: str) -> str:
    """The KVarN method ``name`` as kvarn's vLLM plugin serves it on a model with biased key projections:
    its preset with ``_ks`` (``kvarn_k4v2_g128`` -> ``kvarn_k4v2_g128_ks``, a layer policy kept); other
    methods unchanged."""
    base, plus, suffix = name.partition("+")
    return with_key_smoothing(base) + plus + suffix if base.startswith("kvarn_") else name


def with_served_methods(methods: list[str]) -> list[str]:
    """``methods`` with :func:`served_method` of each KVarN method right after it (once)."""
    out: list[str] = []
    for m in methods:
        out += [x for x in dict.fromkeys((m, served_method(m))) if x not in out]
    return out


def get_method(name: str) -> Method:
    """The :class:`Method` called ``name`` (see the module table)."""
    if name == "fp16":
        return Method(name, "fp16")
    if name == "fp8_e4m3":
        return Method(name, "fp8 e4m3 (scale 1)", fp8="unit")
    if name == "fp8_e4m3_amax":
        return Method(name, "fp8 e4m3 (per-layer amax)", fp8="amax")
    base, plus, suffix = name.partition("+")
    family, _, preset = base.partition("_")
    if family in FAMILIES and f"kvarn_{preset}".removesuffix(KEY_SMOOTH_SUFFIX) in PRESETS:
        label, switches = FAMILIES[family]
        if preset.endswith(KEY_SMOOTH_SUFFIX):  # the preset with one key smoothing vector per sequence
            if "smooth_keys" in switches:
                raise ValueError(f"method {name!r}: {family}_* already sets key smoothing; drop {KEY_SMOOTH_SUFFIX!r}")
            label = f"{label} + per-sequence key smoothing"
        config = KVarNConfig.from_preset(f"kvarn_{preset}", **switches)
        if not plus:
            return Method(name, label, config)
        policy = parse_policy(plus + suffix, config.group_size)
        kept = "fp16" if policy.keep is None else policy.keep
        return Method(name, f"{label}, layers kept in {kept}", config, policy=policy)
    valid = [
        "fp16",
        "fp8_e4m3",
        "fp8_e4m3_amax",
        *(f"{f}_{p.removeprefix('kvarn_')}" for f in FAMILIES for p in PRESETS),
    ]
    raise ValueError(
        f"unknown method {name!r}; valid methods are: {', '.join(valid)}, each KVarN-record method optionally "
        f"ending in {KEY_SMOOTH_SUFFIX!r} (per-sequence key smoothing, as the preset names) and followed by a "
        "layer policy such as +first1+last1 or +first2@k4v4"
    )


@dataclass(frozen=True)
class Codec:
    """Store a K or V tensor in ``dtype`` (fp16 or fp8 e4m3), with optional per-layer scales.

    ``scales[layer][0]`` scales K, ``[1]`` V; no scales = scale 1. fp8 values saturate at +-448
    (as vLLM's fp8 cache does) instead of turning into NaN.
    """

    dtype: torch.dtype
    scales: list[tuple[float, float]] | None

    def scale(self, layer: int, which: int) -> float:
        return 1.0 if self.scales is None else float(self.scales[layer][which])

    def encode(self, x: torch.Tensor, layer: int, which: int) -> torch.Tensor:
        y = x.float() / self.scale(layer, which)
        if self.dtype == torch.float8_e4m3fn:
            y = y.clamp(-FP8_MAX, FP8_MAX)
        return y.to(self.dtype)

    def decode(self, x: torch.Tensor, layer: int, which: int, dtype: torch.dtype) -> torch.Tensor:
        return (x.float() * self.scale(layer, which)).to(dtype)

    def roundtrip(self, x: torch.Tensor, layer: int, which: int, group_size: int = 128) -> torch.Tensor:
        n = x.shape[0] // group_size * group_size
        out = x.clone()
        out[:n] = self.decode(self.encode(x[:n], layer, which), layer, which, x.dtype)
        return out


class _TiledLayer:
    """One layer of :class:`SimpleTiledCache`: full tiles in the codec's dtype, tail (and sink) in ``dtype``."""

    def __init__(self, codec: Codec, layer: int, group_size: int, sink: bool, dtype: torch.dtype):
        self.codec, self.layer, self.g, self.sink, self.store_dtype = codec, layer, group_size, sink, dtype
        self.tiles_k = self.tiles_v = self.tail_k = self.tail_v = self.sink_k = self.sink_v = None
        self.length = 0
        self.is_initialized = False
        self.decoded: tuple[torch.Tensor, torch.Tensor] | None = None  # speed aid, not counted in nbytes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past = self.length
        if not self.is_initialized:
            self.model_dtype = key_states.dtype
            empty = key_states[:, :, :0]
            self.tiles_k = self.codec.encode(empty, self.layer, 0)
            self.tiles_v = self.codec.encode(empty, self.layer, 1)
            self.tail_k = empty.to(self.store_dtype)
            self.tail_v = empty.to(self.store_dtype)
            self.is_initialized = True
        hist = None if past == 0 else self.history()
        self.tail_k = torch.cat([self.tail_k, key_states.to(self.store_dtype)], dim=2)
        self.tail_v = torch.cat([self.tail_v, value_states.to(self.store_dtype)], dim=2)
        full = self.tail_k.shape[2] // self.g * self.g
        if full:
            lossless = self.codec.dtype == self.store_dtype and self.codec.scales is None
            if self.sink and not lossless and self.tiles_k.shape[2] == 0:
                self.sink_k, self.sink_v = self.tail_k[:, :, : self.g].clone(), self.tail_v[:, :, : self.g].clone()
            new_k = self.codec.encode(self.tail_k[:, :, :full], self.layer, 0)
            new_v = self.codec.encode(self.tail_v[:, :, :full], self.layer, 1)
            self.tiles_k = torch.cat([self.tiles_k, new_k], dim=2)
            self.tiles_v = torch.cat([self.tiles_v, new_v], dim=2)
            self.tail_k, self.tail_v = self.tail_k[:, :, full:].clone(), self.tail_v[:, :, full:].clone()
        self.length = past + key_states.shape[2]
        if hist is None:
            return key_states, value_states
        return torch.cat([hist[0], key_states], dim=2), torch.cat([hist[1], value_states], dim=2)

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        dt = self.model_dtype
        if self.decoded is None or self.decoded[0].shape[2] != self.tiles_k.shape[2]:
            k = self.codec.decode(self.tiles_k, self.layer, 0, dt)
            v = self.codec.decode(self.tiles_v, self.layer, 1, dt)
            if self.sink_k is not None:
                k[:, :, : self.g] = self.sink_k.to(dt)
                v[:, :, : self.g] = self.sink_v.to(dt)
            self.decoded = (k, v)
        k, v = self.decoded
        return torch.cat([k, self.tail_k.to(dt)], dim=2), torch.cat([v, self.tail_v.to(dt)], dim=2)

    def nbytes(self) -> int:
        parts = [self.tiles_k, self.tiles_v, self.tail_k, self.tail_v, self.sink_k, self.sink_v]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def SimpleTiledCache(codec: Codec, group_size: int, *, sink: bool, dtype: torch.dtype):
    """A transformers cache keeping full tiles as ``codec.dtype`` tensors (fp16 / fp8), tail and sink in ``dtype``."""
    from transformers.cache_utils import Cache, DynamicLayer

    class TiledLayer(DynamicLayer):
        def __init__(self, index: int):
            super().__init__()
            self.inner = _TiledLayer(codec, index, group_size, sink, dtype)

        def update(self, key_states, value_states, *args, **kwargs):
            self.is_initialized = True
            self.dtype, self.device = key_states.dtype, key_states.device
            return self.inner.update(key_states, value_states)

        def get_seq_length(self) -> int:
            return self.inner.length

        def nbytes(self) -> int:
            return self.inner.nbytes()

    class Tiled(Cache):
        def __init__(self):
            counter = iter(range(1 << 30))
            make: Callable = lambda: TiledLayer(next(counter))
            super().__init__(layer_class_to_replicate=make)

        def nbytes(self) -> dict[str, int]:
            return {"total": sum(layer.nbytes() for layer in self.layers)}

    return Tiled()
