"""Presets and the byte layout of one KVarN cache record.

A *record* holds one tile (``G`` consecutive tokens) of one KV head of one layer: the packed K
codes, the packed V codes and the six scale vectors that dequantize them. In vLLM one cache block
is one tile, so the paged cache is ``cache: [num_blocks, Hkv, record_bytes] uint8``.

Record layout (byte offsets grow downwards; ``D`` = head_dim, ``G`` = group_size,
``pk = 8 // k_bits`` and ``pv = 8 // v_bits`` codes per byte)::

    offset                      field      shape            dtype   meaning
    0                           k_codes    [D // pk, G]     uint8   K codes, channel-major, packed
                                                                    along channels (planar)
    k_codes_bytes               v_codes    [G // pv, D]     uint8   V codes, token-major, packed
                                                                    along tokens (planar)
    scales_offset               k_scale    [D]              fp16    per channel: r_d * step_d
                                k_zero     [D]              fp16    per channel: r_d * lo_d
                                k_tok      [G]              bf16    per token:   c_t
                                v_scale    [G]              fp16    per token:   r_t * step_t
                                v_zero     [G]              fp16    per token:   r_t * lo_t
                                v_chan     [D]              bf16    per channel: c_d
                                k_smooth   [D]              fp8     per model-frame channel: s_d
                                                                    (only with smooth_keys=True)
    record_bytes

Planar packing: in a tile ``M`` of ``R`` rows (K: channels, V: tokens), byte ``[j, c]`` holds
the codes of rows ``j, j + R/p, j + 2R/p, ...`` in bit fields ``[0, b), [b, 2b), ...``: the
first of them in the lowest bits. A kernel unpacks with one shift and one mask per field and
gets ``p`` contiguous row slices, each ready for ``tl.dot`` without interleaving.

Reconstruction in the rotated frame (see ``docs/internals/algorithm.md``)::

    K~[t, d] = (k_codes[d, t] * k_scale[d] + k_zero[d]) * k_tok[t]
    V~[t, d] = (v_codes[t, d] * v_scale[t] + v_zero[t]) * v_chan[d]

With ``smooth_keys=True`` (an option, off in every preset) the K tile is divided by ``s`` along
its model-frame channels before the rotation and multiplied back after it (``docs/internals/algorithm.md``,
"Key smoothing"); ``k_smooth`` adds ``D`` bytes to the record.

Column scales are stored in bf16 and row parameters in fp16. Each tile moves a power of two
from its row parameters to its column scale so that the largest row parameter lies in
``[0.5, 1)``: fp16 then keeps its full precision for the row parameters and bf16 carries any
magnitude a finite fp16 or bf16 input can reach, so no finite input stores ``inf``.

For ``kvarn_k4v2_g128`` at ``D = 128``: 8192 + 4096 + 6 * 256 = 13 824 bytes per record,
108 bytes per token per KV head against 512 for fp16 (4.74x) and 256 for fp8 (2.37x).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple


class Preset(NamedTuple):
    """What a preset name fixes: code widths and tile length (read them by name)."""

    k_bits: int
    v_bits: int
    group_size: int


PRESETS: dict[str, Preset] = {
    "kvarn_k4v2_g128": Preset(4, 2, 128),
    "kvarn_k4v2_g64": Preset(4, 2, 64),
    "kvarn_k4v4_g128": Preset(4, 4, 128),
    "kvarn_k4v4_g64": Preset(4, 4, 64),
    "kvarn_k2v2_g128": Preset(2, 2, 128),
}
KEY_SMOOTH_SUFFIX = "_ks"
"""A preset name ending in it (``kvarn_k4v2_g128_ks``) is the preset with key smoothing, one vector per
sequence (``smooth_keys=True, smooth_scope="sequence"``): for models whose rotated keys lose to plain
RTN, such as Qwen2.5 (``docs/guide/fidelity.md``)."""
SINK_SUFFIX = "_sink"
"""A cache-dtype name ending in it (``kvarn_k4v2_g128_sink``) also keeps the first tile of every sequence in
full precision (vLLM only); the records are those of the name without it."""
CACHE_DTYPES: tuple[str, ...] = tuple(
    preset + ks + sink for preset in PRESETS for ks in ("", KEY_SMOOTH_SUFFIX) for sink in ("", SINK_SUFFIX)
)
"""Every KVarN cache-dtype name (vLLM's ``--kv-cache-dtype``): each preset, optionally with ``_ks`` (key
smoothing, one vector per sequence) and then ``_sink`` (the first tile of every sequence also kept in
full precision), see ``docs/guide/vllm.md``."""
KEY_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_audio"})
"""Hugging Face ``model_type`` values whose q/k/v projections always carry biases (Qwen1.5, Qwen2,
Qwen2.5 and their variants; Qwen3 dropped them). On Qwen2.5-Coder-0.5B those biases give key channels
means up to ~150 and make rotated keys lose to plain RTN (``docs/guide/fidelity.md``)."""
DEFAULT_PRESET = "kvarn_k4v2_g128"
DEFAULT_HEAD_DIM = 128
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BITS = (2, 4)
SUPPORTED_GROUP_SIZES = (64, 128)
DEFAULT_SINKHORN_ITERS = 8

KEY_CLIP = (20, 10)
"""Clipped-range grid of 2-bit K rows, ``(unit, count)``: a row may give up ``k / 20`` of its width,
``k = 0 .. 9`` (up to 45%), whichever rounds it with the smallest squared error (``rtn.choose_qparams``)."""
VALUE_CLIP = (40, 9)
"""Clipped-range grid of 2-bit V rows: up to ``8 / 40`` (20%) of the width. V rows stop short of the
squared-error optimum (about 40% on Gaussian rows): attention averages V over tokens, where rounding
errors cancel and a clipping bias does not; measured in ``docs/guide/fidelity.md``."""

SCALE_FIELDS = ("k_scale", "k_zero", "k_tok", "v_scale", "v_zero", "v_chan")
SMOOTH_FIELD = "k_smooth"
"""The optional per-channel key smoothing vector (one fp8 byte per channel), last in the record."""
SMOOTH_SCOPES = ("tile", "sequence")
"""Where a smoothed format's vector comes from: each tile's own tokens, or the sequence's first tile."""


@dataclass(frozen=True)
class KVarNConfig:
    """One KVarN format: bit widths, tile length, head dim and the derived record layout.

    Build it from a preset name with :meth:`from_preset`. ``rotate`` and ``normalize`` switch
    off the Hadamard and the variance-normalization stages; the presets keep both on, and the
    switches exist for ablations and baselines (with both off the format is KIVI-style RTN:
    per-channel K, per-token V). The byte layout does not depend on them. ``smooth_keys`` divides
    each K tile by a per-channel vector before the rotation (an option measured in
    ``docs/guide/fidelity.md``; it adds ``D`` bytes per record). ``smooth_scope`` says where the vector
    comes from: ``"tile"``, each tile's own tokens (decode several times slower than unsmoothed: the
    kernel rotates the query once per tile, ``docs/internals/kernels.md``), or ``"sequence"``, the sequence's first
    tile without its first token (``reference/smooth.py``): every record of a sequence then carries
    the same vector and the decode rotates the query once (near the speed of unsmoothed); the
    ``_ks`` preset names select it.
    ``clip`` (on by default) lets the rows of a 2-bit half pick a clipped RTN range by squared
    error (:func:`kvarn.reference.rtn.choose_qparams`, grids :data:`KEY_CLIP` and
    :data:`VALUE_CLIP`; same bytes and decoder; no effect on 4-bit halves; ``docs/guide/fidelity.md``).

    Example:
        >>> cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
        >>> cfg.record_bytes, cfg.bytes_per_token, round(cfg.capacity_vs_fp16, 2)
        (13824, 108.0, 4.74)
    """

    k_bits: int = 4
    v_bits: int = 2
    group_size: int = 128
    head_dim: int = DEFAULT_HEAD_DIM
    sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS
    rotate: bool = True
    normalize: bool = True
    smooth_keys: bool = False
    clip: bool = True
    smooth_scope: str = "tile"

    def __post_init__(self) -> None:
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} tokens, got {self.group_size!r}")
        check_head_dim(self.head_dim)
        if self.smooth_keys and not self.rotate:
            raise ValueError("smooth_keys=True needs rotate=True: without the rotation there is nothing to smooth")
        if self.smooth_scope not in SMOOTH_SCOPES:
            raise ValueError(f"smooth_scope must be one of {SMOOTH_SCOPES}, got {self.smooth_scope!r}")
        if self.smooth_scope != "tile" and not self.smooth_keys:
            raise ValueError(f"smooth_scope={self.smooth_scope!r} needs smooth_keys=True")
        if not isinstance(self.sinkhorn_iters, int) or self.sinkhorn_iters < 0:
            raise ValueError(f"sinkhorn_iters must be a non-negative int, got {self.sinkhorn_iters!r}")

    @classmethod
    def from_preset(
        cls, name: str | KVarNConfig = DEFAULT_PRESET, head_dim: int | None = None, **overrides
    ) -> KVarNConfig:
        """The config of preset ``name`` (e.g. ``"kvarn_k4v2_g128"``, or ``"kvarn_k4v2_g128_ks"`` for
        the same preset with per-sequence key smoothing), or a copy of config ``name``.

        ``head_dim`` defaults to 128 for a name and to the config's own for a config; ``overrides``
        replace any other field. Raises ``TypeError`` for anything but a name or a config and
        ``ValueError`` (listing the valid presets) for an unknown name.
        """
        check_preset(name)
        if head_dim is not None:
            overrides["head_dim"] = head_dim
        if isinstance(name, KVarNConfig):
            return dataclasses.replace(name, **overrides)
        base = name.removesuffix(KEY_SMOOTH_SUFFIX)
        fields = {**PRESETS[base]._asdict(), "head_dim": DEFAULT_HEAD_DIM}
        if base != name:
            fields.update(smooth_keys=True, smooth_scope="sequence")
        return cls(**{**fields, **overrides})

    @property
    def k_clip(self) -> tuple[int, int] | None:
        """The K half's clipped-range grid ``(unit, count)``: :data:`KEY_CLIP` at 2 bits with ``clip``, else None."""
        return KEY_CLIP if self.clip and self.k_bits == 2 else None

    @property
    def v_clip(self) -> tuple[int, int] | None:
        """The V half's clipped-range grid: :data:`VALUE_CLIP` at 2 bits with ``clip``, else None."""
        return VALUE_CLIP if self.clip and self.v_bits == 2 else None

    @property
    def seq_smooth(self) -> bool:
        """Whether every record of a sequence carries the sequence's smoothing vector (``smooth_scope="sequence"``)."""
        return self.smooth_keys and self.smooth_scope == "sequence"

    @property
    def name(self) -> str:
        """The preset name of this format, e.g. ``kvarn_k4v2_g128``; ``_ks`` ends it for per-sequence
        key smoothing (``from_preset(cfg.name)`` then has the same bits, tile and smoothing)."""
        ks = KEY_SMOOTH_SUFFIX if self.seq_smooth else ""
        return f"kvarn_k{self.k_bits}v{self.v_bits}_g{self.group_size}{ks}"

    @property
    def k_per_byte(self) -> int:
        return 8 // self.k_bits

    @property
    def v_per_byte(self) -> int:
        return 8 // self.v_bits

    @property
    def k_codes_bytes(self) -> int:
        return self.head_dim * self.group_size * self.k_bits // 8

    @property
    def v_codes_bytes(self) -> int:
        return self.head_dim * self.group_size * self.v_bits // 8

    @property
    def scales_offset(self) -> int:
        return self.k_codes_bytes + self.v_codes_bytes

    @property
    def field_lengths(self) -> dict[str, int]:
        """Number of 2-byte elements of each scale field, in record order."""
        d, g = self.head_dim, self.group_size
        return {"k_scale": d, "k_zero": d, "k_tok": g, "v_scale": g, "v_zero": g, "v_chan": d}

    @property
    def smooth_bytes(self) -> int:
        """Bytes of the key smoothing vector: ``D`` with ``smooth_keys``, else 0."""
        return self.head_dim if self.smooth_keys else 0

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of every field of the record (``k_smooth`` only with ``smooth_keys``)."""
        out = {"k_codes": 0, "v_codes": self.k_codes_bytes}
        pos = self.scales_offset
        for field, n in self.field_lengths.items():
            out[field] = pos
            pos += 2 * n
        if self.smooth_keys:
            out[SMOOTH_FIELD] = pos
        return out

    @property
    def record_bytes(self) -> int:
        """Bytes of one record: one tile of one KV head, K and V."""
        return self.scales_offset + 2 * sum(self.field_lengths.values()) + self.smooth_bytes

    @property
    def bytes_per_token(self) -> float:
        """Cache bytes per token per KV head (K and V together)."""
        return self.record_bytes / self.group_size

    @property
    def bits_per_element(self) -> float:
        """Average stored bits per K or V element, scales included."""
        return 8 * self.record_bytes / (2 * self.group_size * self.head_dim)

    @property
    def capacity_vs_fp16(self) -> float:
        """How many more tokens fit than with an fp16 cache of the same size."""
        return 2 * 2 * self.head_dim / self.bytes_per_token

    @property
    def capacity_vs_fp8(self) -> float:
        """How many more tokens fit than with an fp8 cache of the same size."""
        return 2 * self.head_dim / self.bytes_per_token


def key_bias_reason(model_config) -> str | None:
    """Why a model's keys likely carry large per-channel offsets, read from its Hugging Face config, or ``None``.

    Biased q/k/v projections (``attention_bias=True``, ``qkv_bias=True``, or a model type of
    :data:`KEY_BIAS_MODEL_TYPES`) add the same vector to every key of a head, which a rotation spreads
    over all channels; such models want the ``_ks`` presets. A config nesting its language model
    (``text_config``) is read there too.
    """
    for cfg in (model_config, getattr(model_config, "text_config", None)):
        if cfg is None:
            continue
        for flag in ("attention_bias", "qkv_bias"):
            if getattr(cfg, flag, False) is True:
                return f"its config sets {flag}=True (biased key projections)"
        model_type = getattr(cfg, "model_type", None)
        if model_type in KEY_BIAS_MODEL_TYPES:
            return f"model type {model_type!r} has biased key projections"
    return None


def recommended_preset(model_config, base: str = DEFAULT_PRESET) -> str:
    """``base``, or ``base`` with key smoothing (``_ks``) when :func:`key_bias_reason` finds a reason.

    >>> recommended_preset(transformers.AutoConfig.from_pretrained("Qwen/Qwen2.5-7B-Instruct"))
    'kvarn_k4v2_g128_ks'
    """
    if not isinstance(base, str):
        raise TypeError(f"base must be a preset name, got {type(base).__name__}")
    check_preset(base)
    if key_bias_reason(model_config) is None:
        return base
    return with_key_smoothing(base)


def check_head_dim(head_dim: int) -> None:
    """Raise a ``ValueError`` unless ``head_dim`` is a supported power of two."""
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Hadamard stage, got {head_dim!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")


def check_preset(preset: object) -> None:
    """Raise unless ``preset`` names a preset or is a :class:`KVarNConfig`.

    ``TypeError`` for another type (e.g. ``KVarNCache(4)``), ``ValueError`` listing the valid
    presets for an unknown name. For constructors that keep a preset and resolve it later.
    """
    if isinstance(preset, KVarNConfig):
        return
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a preset name or a KVarNConfig, got {type(preset).__name__}")
    if preset.removesuffix(KEY_SMOOTH_SUFFIX) not in PRESETS:
        valid = ", ".join(PRESETS)
        raise ValueError(
            f"unknown KVarN preset {preset!r}; valid presets are: {valid} "
            f"(each also with {KEY_SMOOTH_SUFFIX!r}: key smoothing, one vector per sequence)"
        )


def is_cache_dtype(name: object) -> bool:
    """Whether ``name`` is a KVarN cache-dtype name (:data:`CACHE_DTYPES`), the test for "a kvarn preset" in vLLM."""
    return name in CACHE_DTYPES


def has_sink(name: str) -> bool:
    """Whether cache-dtype name ``name`` keeps a full-precision sink (ends in :data:`SINK_SUFFIX`)."""
    return name.endswith(SINK_SUFFIX)


def without_sink(name: str) -> str:
    """``name`` without :data:`SINK_SUFFIX`: the preset whose records a ``_sink`` name stores."""
    return name.removesuffix(SINK_SUFFIX)


def has_key_smoothing(name: str) -> bool:
    """Whether preset or cache-dtype name ``name`` smooths keys with one vector per sequence (``_ks``)."""
    return without_sink(name).endswith(KEY_SMOOTH_SUFFIX)


def with_key_smoothing(name: str) -> str:
    """``name`` with ``_ks`` (before any ``_sink``): the same preset with one key smoothing vector per sequence."""
    if has_key_smoothing(name):
        return name
    return without_sink(name) + KEY_SMOOTH_SUFFIX + (SINK_SUFFIX if has_sink(name) else "")


@functools.cache
def cache_dtype_config(name: str, head_dim: int = DEFAULT_HEAD_DIM) -> KVarNConfig:
    """The record format of cache-dtype name ``name`` (a :data:`CACHE_DTYPES` name) at ``head_dim``, parsed once.

    The ``_sink`` suffix does not change the record format: ``kvarn_k4v2_g128_sink`` stores the
    records of ``kvarn_k4v2_g128``. ``_ks`` stores the records of
    ``KVarNConfig(smooth_keys=True, smooth_scope="sequence")`` (``D`` bytes more each).
    """
    if not is_cache_dtype(name):
        raise ValueError(f"unknown KVarN cache dtype {name!r}; valid: {', '.join(CACHE_DTYPES)}")
    return KVarNConfig.from_preset(without_sink(name), head_dim=head_dim)


@dataclass(frozen=True)
class LayerPolicy:
    """Which attention layers keep their KV cache at a higher precision than the cache's preset.

    The first ``first`` layers, the last ``last`` layers and any index in ``layers`` (negative
    indices count from the end) are *kept*: with ``keep=None`` stored unquantized in the cache's
    store dtype (the model dtype in a deployment), with ``keep="kvarn_k4v4_g128"`` (a preset of the
    same tile length) as records of that preset, with the ablation switches (``rotate``,
    ``normalize``, ``smooth_keys``, ``sinkhorn_iters``) of the main format. Every other layer
    uses the main format.

    Other low-bit caches keep boundary layers for the same reason: vLLM's TurboQuant keeps the first
    and last two attention layers in the model dtype through ``--kv-cache-dtype-skip-layers``,
    whose value for a ``keep=None`` policy is :meth:`skip_layers`.

    Example:
        >>> policy = LayerPolicy(first=1, last=1)
        >>> policy.kept(30), policy.skip_layers(30)
        ((0, 29), ['0', '29'])
        >>> base = KVarNConfig.from_preset("kvarn_k2v2_g128", head_dim=64)
        >>> round(policy.bits_per_element(base, 30), 3)  # 28 layers at 2.5625 bits, 2 at 16
        3.458
    """

    first: int = 0
    last: int = 0
    layers: tuple[int, ...] = ()
    keep: str | None = None

    def __post_init__(self) -> None:
        for name in ("first", "last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LayerPolicy.{name} must be a non-negative number of layers, got {value!r}")
        layers = tuple(self.layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"LayerPolicy.layers must be layer indices (ints), got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        if self.keep is not None and self.keep not in PRESETS:
            raise ValueError(
                f"LayerPolicy.keep must be None (the store dtype) or a preset, got {self.keep!r}; "
                f"valid presets are: {', '.join(PRESETS)}"
            )

    @property
    def needs_num_layers(self) -> bool:
        """True when the kept layers depend on the model's layer count (``last`` or negative indices)."""
        return self.last > 0 or any(i < 0 for i in self.layers)

    def kept(self, num_layers: int | None = None) -> tuple[int, ...]:
        """The kept layer indices, sorted; ``num_layers`` may be None only without ``last`` and negative indices.

        With ``num_layers``, indices outside the model and ``first`` or ``last`` above it raise ``ValueError``.
        """
        if num_layers is None:
            if self.needs_num_layers:
                raise ValueError(
                    f"{self} counts layers from the end and needs the model's layer count "
                    "(e.g. KVarNCache(..., num_layers=model.config.num_hidden_layers))"
                )
            return tuple(sorted(set(range(self.first)) | set(self.layers)))
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        bad = [i for i in self.layers if not -num_layers <= i < num_layers]
        if bad:
            raise ValueError(f"LayerPolicy.layers {bad} are outside a model of {num_layers} layers")
        for name in ("first", "last"):
            count = getattr(self, name)
            if count > num_layers:
                raise ValueError(
                    f"LayerPolicy.{name}={count} keeps more layers than the model's {num_layers}: "
                    f"give at most {num_layers}"
                )
        out = set(range(min(self.first, num_layers))) | set(range(max(num_layers - self.last, 0), num_layers))
        return tuple(sorted(out | {i % num_layers for i in self.layers}))

    def kept_config(self, base: KVarNConfig) -> KVarNConfig | None:
        """The format of a kept layer: ``None`` (store dtype) or preset ``keep`` with ``base``'s switches."""
        if self.keep is None:
            return None
        preset = PRESETS[self.keep]
        if preset.group_size != base.group_size:
            raise ValueError(
                f"LayerPolicy.keep={self.keep!r} has {preset.group_size}-token tiles, the main format "
                f"{base.name} {base.group_size}-token tiles: every layer of one cache shares the tile length"
            )
        return dataclasses.replace(base, k_bits=preset.k_bits, v_bits=preset.v_bits)

    def config_for(self, layer: int, num_layers: int | None, base: KVarNConfig) -> KVarNConfig | None:
        """The format of layer ``layer``: ``base``, the kept preset, or ``None`` for the store dtype."""
        return self.kept_config(base) if layer in self.kept(num_layers) else base

    def bits_per_element(self, base: KVarNConfig, num_layers: int, store_bits: int = 16) -> float:
        """Stored bits per K or V element of full tiles, averaged over the ``num_layers`` layers."""
        kept = len(self.kept(num_layers))
        cfg = self.kept_config(base)
        kept_bits = store_bits if cfg is None else cfg.bits_per_element
        return ((num_layers - kept) * base.bits_per_element + kept * kept_bits) / num_layers

    def skip_layers(self, num_layers: int) -> list[str]:
        """The value of vLLM's ``--kv-cache-dtype-skip-layers`` for this policy (layer indices as strings)."""
        if self.keep is not None:
            raise ValueError(
                f"vLLM's --kv-cache-dtype-skip-layers keeps layers in the model dtype only; this policy keeps "
                f"them at {self.keep}"
            )
        return [str(i) for i in self.kept(num_layers)]
