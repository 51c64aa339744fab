"""The KVarN attention backend's class and a run's cache layout: pages of records, and pools of tails.

:class:`KVarNBackend` is the base of one backend class per cache dtype
(:mod:`kvarn.integration.vllm.registry`), so every class knows its format from its own preset and
never from the run's ``cache_dtype`` (:func:`kvarn.config.cache_dtype_config`).
:meth:`KVarNBackend.customize_spec` turns the layer's KV-cache spec into one of ``G``-token blocks
whose page holds one record per KV head: on vLLM with ``state_content_bytes`` (0.32, 0.33) it sets
:func:`page_slot_bytes` (``record_bytes / G`` rounded up to whole bytes: only a key-smoothed record
at D < G needs the rounding) bytes per head and token slot (layout ``LBHNC``); on vLLM without it
(0.26) it returns a ``TQFullAttentionSpec`` with ``tq_slot_size`` that many bytes, and
:meth:`KVarNBackend.get_kv_cache_shape` gives the matching ``[num_blocks, Hkv, G, slot bytes]``
uint8 view. The impl reads it as ``cache: [num_blocks, Hkv, record_bytes]`` (the first
``record_bytes`` of each head's page).

Each running request's incomplete tile is kept in full precision, in one of three places a run
decides at start-up:

- **In vLLM's blocks** (:func:`tail_blocks_enabled`; the default on vLLM's GPU runner, V2;
  ``KVARN_TAIL_BLOCKS=1`` on the CPU runner; not with ``_sink``): ``N`` more blocks per request
  (:mod:`kvarn.integration.vllm.tail_blocks`) and one step pool of ``max_num_seqs`` slots shared by
  all layers.
- **In a pool by request index** (:func:`per_request_slots`: the GPU runner with the plugin's step
  hook): exactly ``max_num_seqs`` slots plus one scratch slot for CUDA-graph padding; a slot can never
  be lost.
- **In a pool by block id** (the CPU runner by default): the release hook
  (:func:`~kvarn.integration.vllm.hooks.install_release_hook`) frees the tails of finished and
  preempted requests before the step that may hand their blocks to others is planned, so a request
  holds at most one slot (two with speculative decoding) and ``max_num_seqs`` slots (twice that) never
  run dry.

A ``_sink`` cache dtype adds sink slots to the pool (:func:`check_sink` refuses a run that cannot keep
them exactly). :func:`pool_slots` is the result.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend

try:
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:  # vLLM 0.26: pages are laid out by get_kv_cache_shape
    KVCacheLayout = None

from kvarn.config import CACHE_DTYPES, SUPPORTED_HEAD_DIMS, KVarNConfig, cache_dtype_config, has_sink, without_sink
from kvarn.integration.vllm.checks import (
    SUPPORTED_MODEL_DTYPES,
    TAIL_BLOCKS_ENV,
    freed_window_problems,
    full_pages_reason,
    has_window_layers,
    sink_slot_count,
    tail_slot_count,
)
from kvarn.integration.vllm.hooks import install_block_pool_hook, install_release_hook
from kvarn.integration.vllm.state import serving
from kvarn.integration.vllm.tail_blocks import tail_spec
from kvarn.integration.vllm.window_spec import window_page_spec_class
from kvarn.paged import tail_geometry

BACKEND_NAME = "KVARN"


def freed_window(kv_cache_spec) -> int | None:
    """The group's sliding window where vLLM frees its blocks as the window moves (a ``SlidingWindowSpec``: its
    manager drops the blocks before the window), else ``None`` (a full-attention spec keeps every block, and a
    window layer in it is masked by attention alone). A ``_ks`` format's spec window is a tile wider than its
    layers' (:meth:`KVarNBackend._record_page_spec`)."""
    try:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
    except ImportError:
        return None
    return int(kv_cache_spec.sliding_window) if isinstance(kv_cache_spec, SlidingWindowSpec) else None


def page_slot_bytes(cfg) -> int:
    """Bytes per (KV head, token slot) of a vLLM page: the record over ``G`` slots, rounded up.

    Exact for every preset; the records of a smoothed format with ``D < G`` (``D`` bytes more)
    end in up to ``G - 1`` bytes of padding, which the cache view cuts off
    (:meth:`~kvarn.integration.vllm.impl.KVarNAttentionImpl._records`).
    """
    return -(-cfg.record_bytes // cfg.group_size)


def per_request_slots(vllm_config) -> bool:
    """Whether tail slots follow vLLM's request indices: the GPU model runner (V2) with the step hook."""
    if not serving.rows_hooked or not getattr(vllm_config, "use_v2_model_runner", False):
        return False
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return device in (None, "cuda")


def departures_reported(per_request: bool) -> bool:
    """Whether a pool keyed by block id hears of finished and preempted requests (installs the release hook)."""
    return not per_request and install_release_hook()


def check_sink(vllm_config, preset: str) -> None:
    """Refuse a ``_sink`` cache dtype where the sink cannot be kept exactly."""
    if not has_sink(preset) or vllm_config is None:
        return
    if per_request_slots(vllm_config) and not serving.scheduler_hooked:
        raise ValueError(
            f"--kv-cache-dtype {preset}: the full-precision sink on vLLM's GPU model runner needs each step's "
            "scheduler output, and the plugin found no GPUModelRunner.execute_model to hook; use --kv-cache-dtype "
            f"{without_sink(preset)}"
        )
    if not install_block_pool_hook():
        raise ValueError(
            f"--kv-cache-dtype {preset}: this vLLM has no vllm.v1.core.block_pool.BlockPool, which the sink "
            f"needs to know which blocks are held; use --kv-cache-dtype {without_sink(preset)}"
        )


def tail_blocks_enabled(vllm_config, preset: str) -> bool:
    """Whether this run keeps tails in vLLM's own blocks (``docs/internals/vllm_backend.md``).

    Each running request then holds ``N`` more blocks (:func:`kvarn.paged.tail_geometry`, counted by
    vLLM's scheduler through :mod:`kvarn.integration.vllm.tail_blocks`) instead of a slot of a pool
    of ``max_num_seqs`` or more tiles per layer. Decode steps read and write the tails in the blocks
    directly (:func:`kvarn.paged.block_tails`; CUDA graphs on the GPU); other steps gather the partial
    tiles into one step pool that all layers share and scatter them back
    (:meth:`kvarn.paged.PagedKV.gather_tails`). Built for vLLM's CPU engine and for the GPU engine's V2
    model runner (block tables widened by :func:`kvarn.integration.vllm.hooks.install_block_table_hook`),
    without the sink, with cache blocks of one tile, without ``--kv-cache-dtype-skip-layers`` and without
    speculative decoding. Sliding-window layers whose blocks vLLM frees take them too: a request's tail blocks
    follow its last tile (:mod:`kvarn.integration.vllm.tail_blocks`).

    ``$KVARN_TAIL_BLOCKS``: unset, the default, takes them on the GPU engine wherever they are built
    (else the pool); ``1`` asks for them anywhere and refuses, saying why, a run they are not built for;
    ``0`` keeps the pool.
    """
    env = os.environ.get(TAIL_BLOCKS_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{TAIL_BLOCKS_ENV} must be 0 or 1 (or unset), got {env!r}")
    if env == "0":
        return False
    problems = []
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device in (None, "cuda") and not _gpu_tables_widened(vllm_config):
        problems.append(
            "on a GPU it needs vLLM's V2 model runner with block tables kvarn can widen by the tail blocks "
            "(kvarn.integration.vllm.hooks.install_block_table_hook found no such runner)"
        )
    if has_sink(preset):
        problems.append(f"it does not keep a sink yet (use {without_sink(preset)})")
    dcp = getattr(getattr(vllm_config, "parallel_config", None), "decode_context_parallel_size", 1) or 1
    if dcp > 1:
        problems.append(f"its block addressing assumes whole blocks per rank, not decode context parallelism ({dcp})")
    cache_config = getattr(vllm_config, "cache_config", None)
    block = getattr(cache_config, "block_size", None)
    if block is not None and block != (group := cache_dtype_config(preset).group_size):
        why = ""
        hybrid = getattr(getattr(vllm_config, "model_config", None), "is_hybrid", False) is True
        if hybrid and not getattr(cache_config, "user_specified_block_size", False):
            why = " (vLLM raises a hybrid model's block size until an attention page holds a Mamba layer's state)"
        problems.append(f"it needs cache blocks of one tile ({group} tokens), not {block}{why}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append(
            "with speculative decoding a tile filled with an unverified draft keeps its tail while the next tile "
            "starts, and a request's tail blocks hold one tile"
        )
    smooth = cache_dtype_config(preset).seq_smooth
    if smooth and has_window_layers(vllm_config) and not freed_window_problems(preset, vllm_config):
        problems.append(
            "its planner reads a sequence's key smoothing vector from the first tile's record, which a "
            "sliding-window layer frees"
        )
    skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None)
    if skipped:
        # vLLM groups the skipped layers' plain spec with KVarN's, and a group's block table has one width
        problems.append(f"--kv-cache-dtype-skip-layers ({', '.join(map(str, skipped))}) puts other layers in its group")
    if env == "":
        return device == "cuda" and not problems
    if problems:
        raise ValueError(
            f"{TAIL_BLOCKS_ENV}=1 with --kv-cache-dtype {preset}: " + "; ".join(problems) + f"; unset {TAIL_BLOCKS_ENV}"
        )
    return True


def _gpu_tables_widened(vllm_config) -> bool:
    """Whether a GPU run's block tables take the tail blocks: vLLM's V2 model runner with the block-table hook."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False)) and serving.block_tables_widened


def pool_itemsize(vllm_config) -> int:
    """Bytes per element of the full-precision pool: the model dtype's (fp16/bf16 2, fp32 4)."""
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", torch.float16)
    return torch.tensor([], dtype=dtype).element_size()


def pool_slots(vllm_config, sink: bool = False, preset: str = "") -> int:
    """Slots of each layer's full-precision pool: the sink slots (with ``sink``), the tail slots, and
    one scratch slot in request index mode; with tails in blocks, the step pool's ``max_num_seqs``."""
    if preset and tail_blocks_enabled(vllm_config, preset):
        return int(vllm_config.scheduler_config.max_num_seqs)
    per_request = per_request_slots(vllm_config)
    released = departures_reported(per_request)
    tails = tail_slot_count(vllm_config, per_request=per_request, departures_reported=released)
    return (sink_slot_count(vllm_config) if sink else 0) + tails + int(per_request)


class KVarNBackend(AttentionBackend):
    """Base of the per-preset KVarN backends; ``preset`` names the cache format."""

    preset: ClassVar[str] = ""
    """The ``--kv-cache-dtype`` this backend serves (a preset, or a preset with ``_sink``)."""
    sink: ClassVar[bool] = False
    registered_name: ClassVar[str] = BACKEND_NAME
    """The name vLLM's backend registry knows KVarN by (``CUSTOM`` where the registry takes no new names)."""
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)

    @classmethod
    def config(cls, head_size: int) -> KVarNConfig:
        """The record layout of this backend's preset for ``head_size``."""
        return cache_dtype_config(cls.preset, head_size)

    @staticmethod
    def get_name() -> str:
        return KVarNBackend.registered_name

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype == cls.preset

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,) if KVCacheLayout is not None else ()

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return cls.config(128).group_size

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        """Exactly one tile: a larger cache block (a multiple of G) is split into tiles by vLLM."""
        return [cls.config(128).group_size]

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``[num_blocks, Hkv, block_size, record_bytes / G]`` uint8: one record per (block, KV head)."""
        return (num_blocks, num_kv_heads, block_size, page_slot_bytes(cls.config(head_size)))

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        """Learned sink logits (``sinks=``) go to attention as ``sink_logits`` on every path the layer takes."""
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """The layer's window goes to attention; :mod:`kvarn.paged` reads no block before it."""
        return True

    @classmethod
    def customize_spec(cls, spec, full_pages: bool | None = None):
        """One record per (block, KV head): ``record_bytes / G`` bytes per head and token slot.

        A sliding-window layer keeps its window spec, so vLLM frees its blocks as the window moves, unless the
        run keeps something by a block the window leaves (:func:`~kvarn.integration.vllm.checks.
        freed_window_problems`: the sink, ``_ks`` on a GPU, speculative drafts): then it gets full-attention pages,
        blocks for every token, and attention applies the window alone (logged once with the reason).
        ``full_pages`` decides that instead (vLLM 0.26's spec hook, which has the run's config at hand)."""
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"{cls.preset} needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v}; "
                "serve this model with --kv-cache-dtype auto"
            )
        from vllm.config import get_current_vllm_config_or_none

        # vLLM 0.32 asks for the spec outside its config context: the config the layers were built under
        config = get_current_vllm_config_or_none() or serving.config
        if full_pages is None:
            full_pages = freed_window(spec) is not None and full_pages_reason(cls.preset, config)
        page = cls._record_page_spec(spec, full_pages)
        if config is None or not tail_blocks_enabled(config, cls.preset):
            return page
        return tail_spec(page, tail_geometry(cls.config(spec.head_size), pool_itemsize(config))[1])

    @classmethod
    def _record_page_spec(cls, spec, full_pages: bool = False):
        """``spec`` with pages of one record per (block, KV head).

        A window layer of a per-sequence smoothed format (``_ks``) keeps one tile more than its window: each
        store reads the sequence's smoothing vector from the record before the step's first tile, which vLLM
        must not have freed (the layer's own window still masks attention)."""
        cfg = cls.config(spec.head_size)
        per_slot = page_slot_bytes(cfg)
        shape = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size)
        shape.update(head_size_v=spec.head_size_v)
        if full_pages and freed_window(spec) is not None:
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            spec = FullAttentionSpec(**shape, dtype=spec.dtype, sliding_window=spec.sliding_window)
        if "state_content_bytes" in {f.name for f in dataclasses.fields(spec)}:
            done = spec.dtype == torch.uint8 and spec.state_content_bytes == per_slot  # asked twice: widened once
            window = getattr(spec, "sliding_window", None)
            if cfg.seq_smooth and window is not None and freed_window(spec) is not None and not done:
                spec = dataclasses.replace(spec, sliding_window=window + cfg.group_size)
            return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=per_slot, tokens_per_state=1)
        from vllm.v1.kv_cache_interface import TQFullAttentionSpec

        if freed_window(spec) is not None:  # not with full_pages: the spec is a full-attention one by now
            page = window_page_spec_class()
            return page(**shape, dtype=torch.uint8, sliding_window=spec.sliding_window, record_slot_bytes=per_slot)
        return TQFullAttentionSpec(**shape, dtype=torch.uint8, tq_slot_size=per_slot)
