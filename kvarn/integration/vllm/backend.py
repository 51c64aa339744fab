"""The KVarN attention backend for vLLM: backend classes, metadata builder and impl.

One backend class per preset (``KVarNBackend_k4v2_g128``, ...), so that every class knows its
record layout without looking at the run's config: :meth:`KVarNBackend.customize_spec` turns the
layer's KV-cache spec into one of ``G``-token blocks whose page holds one record per KV head
(``state_content_bytes = record_bytes / G`` per head and token slot, layout ``LBHNC``, so each
``(block, head)`` record is contiguous). vLLM sizes the pool from that page and hands each layer
a ``[num_blocks, Hkv, G, record_bytes / G]`` uint8 view, which the impl reads as
``cache: [num_blocks, Hkv, record_bytes]``.

The builder plans each step with :class:`~kvarn.paged.TilePlanner`; the impl's ``forward``
stores the step's K/V and then attends through :class:`~kvarn.paged.PagedKV`, which calls
``kvarn.ops`` (the reference on CPU, the Triton kernels on CUDA). This module holds no math.

The first tile of a sequence is quantized like every other tile (no full-precision sink): a sink
would be per-request state for the request's whole life, shared through the prefix cache and lost
on preemption, and it would not be recoverable from its own page (see ``docs/vllm.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvarn.config import PRESETS, SUPPORTED_HEAD_DIMS, KVarNConfig
from kvarn.paged import PagedKV, TilePlan, TilePlanner

logger = logging.getLogger("vllm.kvarn")

BACKEND_NAME = "KVARN"
TAIL_SLOTS_ENV = "KVARN_TAIL_SLOTS"
SUPPORTED_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_logged_capacity: set[tuple] = set()


def tail_slot_count(vllm_config) -> int:
    """Tail slots per layer: ``$KVARN_TAIL_SLOTS`` or twice ``max_num_seqs``.

    A running request holds at most one incomplete tile; the second half of the pool absorbs the
    tails of finished requests until their blocks are recycled.
    """
    env = os.environ.get(TAIL_SLOTS_ENV)
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{TAIL_SLOTS_ENV} must be a positive integer, got {env!r}") from None
        if value < 1:
            raise ValueError(f"{TAIL_SLOTS_ENV} must be a positive integer, got {env!r}")
        return value
    return 2 * int(vllm_config.scheduler_config.max_num_seqs)


class KVarNBackend(AttentionBackend):
    """Base of the per-preset KVarN backends; ``preset`` names the cache format."""

    preset: ClassVar[str] = ""
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(PRESETS)

    @classmethod
    def config(cls, head_size: int) -> KVarNConfig:
        """The record layout of this backend's preset for ``head_size``."""
        return KVarNConfig.from_preset(cls.preset, head_dim=head_size)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVarNAttentionImpl]:
        return KVarNAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype == cls.preset

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PRESETS[cls.preset][2]

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        """Exactly one tile: a larger cache block (a multiple of G) is split into tiles by vLLM."""
        return [PRESETS[cls.preset][2]]

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One record per (block, KV head): ``record_bytes / G`` bytes per head and token slot."""
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"{cls.preset} needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v}; "
                "serve this model with --kv-cache-dtype auto"
            )
        cfg = cls.config(spec.head_size)
        per_slot, rest = divmod(cfg.record_bytes, cfg.group_size)
        assert rest == 0, "record_bytes is a multiple of the tile length for every preset"
        return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=per_slot, tokens_per_state=1)


def _backend_for(preset: str) -> type[KVarNBackend]:
    name = f"KVarNBackend_{preset.removeprefix('kvarn_')}"
    return type(name, (KVarNBackend,), {"preset": preset, "__module__": __name__, "__qualname__": name})


BACKENDS: dict[str, type[KVarNBackend]] = {preset: _backend_for(preset) for preset in PRESETS}
globals().update({cls.__name__: cls for cls in BACKENDS.values()})


def backend_path(preset: str) -> str:
    """The importable path of the backend class of ``preset``."""
    cls = BACKENDS[preset]
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class KVarNMetadata(AttentionMetadata):
    """One step of one KV-cache group: the tile plan plus what attention reads.

    ``query_start_loc: [B + 1]``, ``seq_lens: [B]``, ``block_table: [B, max_blocks]`` as vLLM
    gives them; ``plan`` from :meth:`TilePlanner.plan`; ``num_slots`` tail slots per layer.
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: TilePlan
    num_slots: int


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    """Builds :class:`KVarNMetadata`; owns the tail-slot table of its KV-cache group."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        preset = vllm_config.cache_config.cache_dtype
        if preset not in PRESETS:
            raise ValueError(f"the KVarN backend serves kvarn_* cache dtypes, got {preset!r}")
        self.cfg = KVarNConfig.from_preset(preset, head_dim=kv_cache_spec.head_size)
        if kv_cache_spec.block_size != self.cfg.group_size:
            raise ValueError(
                f"{preset} needs kernel blocks of {self.cfg.group_size} tokens, vLLM gave {kv_cache_spec.block_size}"
            )
        self.num_slots = tail_slot_count(vllm_config)
        self.planner = TilePlanner(self.num_slots, self.cfg.group_size)
        self._log_capacity(vllm_config, kv_cache_spec, len(layer_names))

    def _log_capacity(self, vllm_config, spec, num_layers: int) -> None:
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        key = (num_blocks, spec.num_kv_heads, spec.head_size, num_layers, self.cfg.name)
        if not num_blocks or key in _logged_capacity:
            return
        _logged_capacity.add(key)
        cfg = self.cfg
        tokens = num_blocks * cfg.group_size
        cache_bytes = num_blocks * num_layers * spec.num_kv_heads * cfg.record_bytes
        fp16_tokens = cache_bytes // (num_layers * spec.num_kv_heads * 4 * cfg.head_dim)
        dtype_bytes = torch.tensor([], dtype=vllm_config.model_config.dtype).element_size()
        tail_bytes = self.num_slots * cfg.group_size * spec.num_kv_heads * cfg.head_dim * 2 * dtype_bytes * num_layers
        logger.info(
            "KVarN %s KV cache: %d blocks of %d tokens = %d tokens in %.1f MiB (%d layers, %d KV heads, %d B "
            "per record); an fp16 cache of the same size holds %d tokens: %.2fx the capacity. Full-precision "
            "tail pool: %d slots, %.1f MiB.",
            cfg.name,
            num_blocks,
            cfg.group_size,
            tokens,
            cache_bytes / 2**20,
            num_layers,
            spec.num_kv_heads,
            cfg.record_bytes,
            fp16_tokens,
            tokens / max(fp16_tokens, 1),
            self.num_slots,
            tail_bytes / 2**20,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVarNMetadata:
        cam = common_attn_metadata
        batch = cam.num_reqs
        seq_lens_cpu = cam.seq_lens_cpu_upper_bound
        seq_lens_cpu = cam.seq_lens[:batch].cpu() if seq_lens_cpu is None else seq_lens_cpu[:batch]
        block_table = cam.block_table_tensor[:batch]
        plan = self.planner.plan(
            cam.query_start_loc_cpu[: batch + 1],
            seq_lens_cpu,
            block_table.cpu(),
            cam.num_actual_tokens,
            self.device,
        )
        return KVarNMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc[: batch + 1],
            seq_lens=cam.seq_lens[:batch],
            block_table=block_table,
            plan=plan,
            num_slots=self.num_slots,
        )


class KVarNAttentionImpl(AttentionImpl[KVarNMetadata]):
    """Stores K/V as KVarN tiles and attends over them, through ``kvarn.ops`` only."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs,
    ) -> None:
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "a logits soft cap": logits_soft_cap not in (None, 0, 0.0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            "learned attention sinks": kwargs.get("sinks") is not None,
        }
        for what, present in refused.items():
            if present:
                raise ValueError(
                    f"--kv-cache-dtype {kv_cache_dtype}: this layer uses {what}, which KVarN does not serve; "
                    "use --kv-cache-dtype auto for this model"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.cfg = KVarNConfig.from_preset(kv_cache_dtype, head_dim=head_size)
        self.attn_type = attn_type
        from vllm.config import get_current_vllm_config_or_none

        from kvarn.integration.vllm.plugin import check_run

        config = get_current_vllm_config_or_none()
        if config is not None:
            check_run(config, kv_cache_dtype)
        self.num_slots = tail_slot_count(config) if config is not None else 1

    def _pool(self, layer, num_slots: int, dtype: torch.dtype, device: torch.device):
        """The layer's ``tail_k, tail_v: [num_slots, G, Hkv, D]``, allocated on first use."""
        pool = getattr(layer, "_kvarn_tail", None)
        if pool is None or pool[0].shape[0] != num_slots or pool[0].dtype != dtype or pool[0].device != device:
            shape = (num_slots, self.cfg.group_size, self.num_kv_heads, self.head_size)
            pool = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            layer._kvarn_tail = pool
        return pool

    @staticmethod
    def _records(kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's ``[num_blocks, Hkv, G, C]`` page view as ``[num_blocks, Hkv, record_bytes]``."""
        return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVarNMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend over the records, the tail and the tokens just stored.

        The store runs here, inside vLLM's attention op, rather than in ``do_kv_cache_update``:
        vLLM keeps the attention op out of CUDA graphs in every compilation mode, and the planner's
        Python bookkeeping must run every step.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KVarN backend")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        if attn_metadata is None:
            self._pool(layer, self.num_slots, query.dtype, query.device)
            return output.fill_(0)
        meta = attn_metadata
        n = meta.num_actual_tokens
        tail_k, tail_v = self._pool(layer, meta.num_slots, query.dtype, query.device)
        paged = PagedKV(self.cfg, self._records(kv_cache), tail_k, tail_v)
        if kv_cache.numel() and key is not None and value is not None:
            k = key[:n].view(n, self.num_kv_heads, self.head_size)
            v = value[:n].view(n, self.num_kv_heads, self.head_size)
            paged.store(meta.plan, k, v)
        out = paged.attend(
            meta.plan,
            query[:n].view(n, self.num_heads, self.head_size),
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
        )
        output[:n] = out.view(output[:n].shape)
        return output
