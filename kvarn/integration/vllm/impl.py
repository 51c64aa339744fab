"""The KVarN attention impl: stores a step's K/V as KVarN tiles and attends over them, through
:class:`kvarn.paged.PagedKV` only, as its builder (:mod:`kvarn.integration.vllm.builder`) planned."""

from __future__ import annotations

import itertools
import logging
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from kvarn.config import cache_dtype_config
from kvarn.integration.vllm.backend import KVarNBackend, check_sink, pool_slots, tail_blocks_enabled
from kvarn.integration.vllm.builder import KVarNMetadata
from kvarn.integration.vllm.checks import check_run, sink_slot_count
from kvarn.integration.vllm.state import serving
from kvarn.paged import PagedKV, VarlenAttention

logger = logging.getLogger("vllm.kvarn")


def flash_varlen() -> VarlenAttention | None:
    """vLLM's own flash attention as a :data:`~kvarn.paged.VarlenAttention`, or ``None`` where it does not import.

    Found by feature (``vllm.v1.attention.backends.fa_utils`` with a varlen function that imports),
    never by version. Prompt chunks on CUDA attend through it; without it they use
    :func:`kvarn.paged.sdpa_varlen`.
    """
    if not serving.flash:
        fn = None
        try:
            from vllm.v1.attention.backends import fa_utils

            if fa_utils.is_flash_attn_varlen_func_available():
                version = fa_utils.get_flash_attn_version()
                kernel = fa_utils.flash_attn_varlen_func

                def fn(q, chunks, scale):
                    cu_q, used = chunks.cu_q_t, chunks.seqused_k_t  # on the device, once per step
                    if cu_q is None or used is None:
                        dev = q.device
                        cu_q = torch.tensor(chunks.cu_q, dtype=torch.int32).to(dev, non_blocking=True)
                        used = torch.tensor(chunks.seqused_k, dtype=torch.int32).to(dev, non_blocking=True)
                    return kernel(
                        q,
                        chunks.k,
                        chunks.v,
                        max_seqlen_q=max(b - a for a, b in itertools.pairwise(chunks.cu_q)),
                        cu_seqlens_q=cu_q,
                        max_seqlen_k=max(chunks.seqused_k),
                        seqused_k=used,
                        block_table=chunks.block_table,
                        softmax_scale=scale,
                        causal=True,
                        **({} if version is None else {"fa_version": version}),
                    )
        except (ImportError, AttributeError, RuntimeError, AssertionError) as exc:
            logger.info("KVarN: vLLM's flash attention is not available for prompt chunks (%s)", exc)
        serving.flash.append(fn)
    return serving.flash[0]


def _capturing(query: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph (tests stand in for a capture on the CPU)."""
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


class KVarNAttentionImpl(AttentionImpl[KVarNMetadata]):
    """Stores K/V as KVarN tiles and attends over them, through :class:`kvarn.paged.PagedKV` only."""

    backend: ClassVar[type[KVarNBackend]] = KVarNBackend

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
        preset = self.backend.preset or kv_cache_dtype
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            "a logits soft cap": logits_soft_cap not in (None, 0, 0.0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
        }
        for what, present in refused.items():
            if present:
                raise ValueError(
                    f"--kv-cache-dtype {preset}: this layer uses {what}, which KVarN does not serve; "
                    "use --kv-cache-dtype auto for this model"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = preset
        self.cfg = cache_dtype_config(preset, head_size)
        self.attn_type = attn_type
        self.window = None if sliding_window is None else int(sliding_window)
        self.sinks = kwargs.get("sinks")
        """The layer's learned sink logits ``[Hq]`` (this rank's heads), a parameter vLLM fills after construction."""
        if self.sinks is not None and self.sinks.shape[0] != num_heads:
            raise ValueError(f"sinks must hold one logit per query head ({num_heads}), got {tuple(self.sinks.shape)}")
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None:
            check_run(config, preset)
            check_sink(config, preset)
            serving.config = config
        self.num_sink_slots = sink_slot_count(config) if config is not None and self.backend.sink else 0
        self.pool_slots = pool_slots(config, self.backend.sink, preset) if config is not None else 1
        self.shared_pool = config is not None and tail_blocks_enabled(config, preset)
        self.probe_rows = int(config.scheduler_config.max_num_seqs) if config is not None else 1

    def _pool(self, layer, num_slots: int, dtype: torch.dtype, device: torch.device):
        """The layer's ``tail_k, tail_v: [num_slots, G, Hkv, D]``, allocated in vLLM's profiling run.

        With tails in blocks (``shared_pool``) one step pool of that shape serves every layer of its
        shape: each layer fills it from its blocks and empties it back within its own forward.
        """
        owner = serving.shared_pools if self.shared_pool else layer.__dict__
        key = ("_kvarn_tail", device, dtype, self.num_kv_heads, self.head_size) if self.shared_pool else "_kvarn_tail"
        pool = owner.get(key)
        if pool is None or pool[0].shape[0] != num_slots or pool[0].dtype != dtype or pool[0].device != device:
            shape = (num_slots, self.cfg.group_size, self.num_kv_heads, self.head_size)
            pool = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            owner[key] = pool
        return pool

    @staticmethod
    def _varlen(dtype: torch.dtype) -> VarlenAttention | None:
        """vLLM's flash attention for prompt chunks where it takes the dtype (fp16, bf16); else SDPA."""
        return flash_varlen() if dtype in (torch.float16, torch.bfloat16) else None

    def _attention_args(self) -> dict:
        """The layer's window and sink logits for :meth:`kvarn.paged.PagedKV.attend` (read at forward time: the
        sinks are loaded after construction; float32 as the kernels take them)."""
        sinks = None if self.sinks is None else self.sinks.to(torch.float32)
        return {"window": self.window, "sink_logits": sinks}

    def _records(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's ``[num_blocks, Hkv, G, C]`` page view as ``[num_blocks, Hkv, record_bytes]`` (padding cut off)."""
        return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)[..., : self.cfg.record_bytes]

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
        """Store this step's K/V, attend (the own-tile rule), then write a handed-over slot's new tile.

        The store runs here, inside vLLM's attention op, rather than in ``do_kv_cache_update``, so
        a tile completed in this step is quantized before this step's attention and a slot handed
        to the next tile (:meth:`kvarn.paged.PagedKV.write_late_tail`) is written only after it.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KVarN backend")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        if attn_metadata is None:
            self._pool(layer, self.pool_slots, query.dtype, query.device)
            return output.fill_(0)
        meta = attn_metadata
        meta.forward_ran = True  # this step commits its own tiles here, or is a capture (commit_replayed)
        n = meta.num_actual_tokens
        capturing = _capturing(query)
        plan = meta.plan
        name = getattr(layer, "layer_name", None)
        if capturing and not meta.graph_ready:
            raise RuntimeError("the KVarN backend captures CUDA graphs of single-token decode batches only")
        if capturing and not name:  # its tiles are committed after replays by name (commit_replayed)
            raise RuntimeError("the KVarN backend captures decode steps of layers with a layer_name only")
        paged = self._paged(layer, kv_cache, meta.num_slots, query.dtype)
        if meta.decode and meta.decode_layers is not None and name:  # (the rehearsal's stub layer has none)
            meta.decode_layers[name] = (self, layer, kv_cache, query.dtype)
        k = v = None
        if key is not None and value is not None:
            k = key[:n].view(n, self.num_kv_heads, self.head_size)
            v = value[:n].view(n, self.num_kv_heads, self.head_size)
        stored = kv_cache.numel() and k is not None
        if meta.block_tails is not None:
            return self._decode_in_blocks(layer, paged, meta, plan, query, k, v, output, capturing)
        if meta.tails is not None and kv_cache.numel():
            paged.gather_tails(meta.tails[0])
        if stored:
            paged.write_tail(plan, k, v)
            if not capturing:  # a captured step's tiles are committed after its replays (commit_replayed)
                paged.commit(plan)
            paged.store_whole(plan, k, v)
        q = query[:n].view(n, self.num_heads, self.head_size)
        if meta.prefill is not None and not capturing and self.window is None and self.sinks is None:
            out = paged.attend_split(
                plan, q, meta.block_table, meta.seq_lens, meta.prefill, self.scale, self._varlen(q.dtype), k, v
            )
            output[:n] = out.view(output[:n].shape)
        else:
            # decode: one token per request, whose tile (the token included) is in its slot
            qsl, kv = (None, (None, None)) if meta.decode else (meta.query_start_loc, (k, v))
            # the kernel writes vLLM's buffer: no copy launch per layer
            dst = output[:n].view(q.shape) if output.dtype == q.dtype else None
            out = paged.attend(
                plan, q, meta.block_table, meta.seq_lens, qsl, self.scale, dst, *kv, **self._attention_args()
            )
            if dst is None:
                output[:n] = out.view(output[:n].shape)
        if stored:
            paged.write_late_tail(plan, k, v)
            if meta.tails is not None:
                paged.scatter_tails(meta.tails[1])
        return output

    def _paged(self, layer, kv_cache: torch.Tensor, num_slots: int, dtype: torch.dtype) -> PagedKV:
        """The layer's cache as :class:`kvarn.paged.PagedKV`: vLLM's pages and the layer's (or the step's) pool."""
        tail_k, tail_v = self._pool(layer, num_slots, dtype, kv_cache.device)
        return PagedKV(self.cfg, self._records(kv_cache), tail_k, tail_v, num_sink_slots=self.num_sink_slots)

    def commit_step(self, layer, kv_cache: torch.Tensor, dtype: torch.dtype, meta: KVarNMetadata) -> None:
        """Commit the tiles decode step ``meta`` filled in this layer (``dtype``: its forward's), that forward
        having been replayed from a CUDA graph
        (:meth:`~kvarn.integration.vllm.builder.KVarNMetadataBuilder.commit_replayed`)."""
        if not kv_cache.numel():
            return
        paged = self._paged(layer, kv_cache, meta.num_slots, dtype)
        if meta.block_tails is not None:
            paged.commit_block_tails(meta.plan, meta.block_tails)
        else:
            paged.commit(meta.plan)

    def _decode_in_blocks(self, layer, paged: PagedKV, meta: KVarNMetadata, plan, query, k, v, output, capturing: bool):
        """:meth:`forward` of a decode step with tails in the blocks
        (:meth:`~kvarn.integration.vllm.builder.KVarNMetadataBuilder._decode_in_blocks`): the token into its block
        row, the filled tiles committed (eagerly; after a graph's replay by the builder's next build), attention
        reading the own tiles from the blocks; nothing goes through the step pool but a committed tile."""
        n, tails = meta.num_actual_tokens, meta.block_tails
        if not paged.cache.numel():
            return output.fill_(0)
        if k is not None:
            paged.write_block_tails(tails, k, v)
            if not capturing and plan.commit_slots.numel():  # else after a replay (commit_replayed)
                paged.commit_block_tails(plan, tails)
        q = query[:n].view(n, self.num_heads, self.head_size)
        dst = output[:n].view(q.shape) if output.dtype == q.dtype else None
        out = paged.attend(
            plan, q, meta.block_table, meta.seq_lens, None, self.scale, dst, tails=tails, **self._attention_args()
        )
        if dst is None:
            output[:n] = out.view(output[:n].shape)
        serving.probe.record(
            layer,
            paged,
            self.scale,
            tails.rows_per_block,
            self.probe_rows,
            query=q,
            output=output[:n].view(q.shape),
            seq_lens=meta.seq_lens,
            block_table=meta.block_table,
            tables=tails.tables,
        )
        return output
