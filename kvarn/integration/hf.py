"""A transformers cache that stores KVarN records: ``model.generate(..., past_key_values=KVarNCache())``.

Per attention layer the cache holds what the vLLM backend holds per sequence, and nothing else:

- ``records: [B, n_tiles, Hkv, record_bytes]`` uint8, one KVarN record per full tile per KV head
  (viewed as the paged cache ``[B * n_tiles, Hkv, record_bytes]``, block ``b * n_tiles + i`` =
  tile ``i`` of sequence ``b``);
- ``tail_k, tail_v: [num_slots, G, Hkv, D]``, the full-precision tile pool in the rotated frame:
  slot ``b`` is sequence ``b``'s tail (its last, incomplete tile), slot ``B + b`` its sink (a
  full-precision copy of its first tile) when ``sink=True``.

New tokens reach a record through :func:`kvarn.ops.store_tiles` (whole tiles of a chunk) or
:func:`kvarn.ops.write_tail` then :func:`kvarn.ops.commit_tiles` (tokens that fill a tile bit by
bit); both give the same bytes. No quantize-dequantize simulation: the K/V a layer attends over
are read back from the records.

Two ways to attend:

- ``paged=False`` (default, any ``attn_implementation``): :meth:`update` returns the history
  decoded from the records (:func:`kvarn.ops.decode_records`), the sink and the tail, un-rotated to
  the model frame, followed by the chunk's own K/V exactly as the model computed them. The decoded
  history is a per-layer temporary; the cache keeps only records and the pool.
- ``paged=True`` with ``attn_implementation="kvarn"`` (see :func:`register_kvarn_attention`):
  attention reads the records directly through :func:`kvarn.ops.paged_attention` (Triton on CUDA,
  the reference elsewhere); the chunk's own tokens are read from the cache like the history.
  Batches must be unpadded.

In both modes the first chunk of a sequence (the prompt) attends over its exact K/V, as
``docs/algorithm.md`` section 5 allows. This module holds no math: it moves tensors between the
model and :mod:`kvarn.ops`.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvarn import ops
from kvarn.config import DEFAULT_PRESET, KVarNConfig
from kvarn.reference import rotate

ATTENTION_NAME = "kvarn"


def _config(preset: str | KVarNConfig, head_dim: int) -> KVarNConfig:
    return KVarNConfig.from_preset(preset, head_dim=head_dim)


class KVarNLayer(CacheLayerMixin):
    """The KVarN cache of one attention layer (see the module docstring for its storage)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        preset: str | KVarNConfig = DEFAULT_PRESET,
        *,
        sink: bool = False,
        dtype: torch.dtype | None = None,
        max_cache_len: int | None = None,
        paged: bool = False,
        impl: str = "auto",
        keep_decoded: bool = False,
    ):
        super().__init__()
        self.keep_decoded = keep_decoded
        self.decoded: tuple[torch.Tensor, torch.Tensor] | None = None
        self.preset = preset
        self.sink = sink
        self.store_dtype = dtype
        self.max_cache_len = max_cache_len
        self.paged = paged
        self.impl = impl
        self.length = 0
        self.cfg: KVarNConfig | None = None
        self.records: torch.Tensor | None = None
        self.tail_k: torch.Tensor | None = None
        self.tail_v: torch.Tensor | None = None
        self.first_chunk = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pool (and the records, given ``max_cache_len``) for ``key_states: [B, Hkv, T, D]``."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                f"key_states and value_states must both be [B, Hkv, T, D], got {tuple(key_states.shape)} "
                f"and {tuple(value_states.shape)}"
            )
        batch, hkv, _, d = key_states.shape
        self.cfg = _config(self.preset, d)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = self.store_dtype or key_states.dtype
        self.batch_size, self.num_heads = batch, hkv
        g = self.cfg.group_size
        slots = 2 * batch if self.sink else batch
        self.tail_k = torch.zeros(slots, g, hkv, d, dtype=self.store_dtype, device=self.device)
        self.tail_v = torch.zeros_like(self.tail_k)
        tiles = math.ceil(self.max_cache_len / g) if self.max_cache_len else 0
        self.records = torch.zeros(batch, tiles, hkv, self.cfg.record_bytes, dtype=torch.uint8, device=self.device)
        self.is_initialized = True

    @property
    def n_tiles(self) -> int:
        """Full tiles stored as records."""
        return self.length // self.cfg.group_size

    @property
    def cache(self) -> torch.Tensor:
        """The records as a paged cache ``[B * capacity, Hkv, record_bytes]``."""
        return self.records.view(-1, *self.records.shape[2:])

    def block_table(self) -> torch.Tensor:
        """``[B, capacity]`` int32: block ``b * capacity + i`` holds tile ``i`` of sequence ``b``."""
        cap = self.records.shape[1]
        b = torch.arange(self.batch_size, device=self.device, dtype=torch.int32)[:, None]
        return b * cap + torch.arange(cap, device=self.device, dtype=torch.int32)[None, :]

    def _ensure_tiles(self, tiles: int) -> None:
        cap = self.records.shape[1]
        if tiles <= cap:
            return
        grown = self.records.new_zeros(self.batch_size, tiles, *self.records.shape[2:])
        grown[:, :cap] = self.records
        self.records = grown

    def _slots(self, first: int, offset: int, count: int) -> torch.Tensor:
        """``[B * count]`` tail mapping ``slot * G + offset + j`` for slots ``first .. first + B``."""
        g = self.cfg.group_size
        slots = torch.arange(first, first + self.batch_size, device=self.device)[:, None] * g
        return (slots + offset + torch.arange(count, device=self.device)[None, :]).reshape(-1)

    def _blocks(self, tile: int) -> torch.Tensor:
        cap = self.records.shape[1]
        return torch.arange(self.batch_size, device=self.device) * cap + tile

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v: [B, n, Hkv, D]`` (model frame, store dtype) at positions ``length .. length + n``."""
        g, batch = self.cfg.group_size, self.batch_size
        n = k.shape[1]
        self._ensure_tiles((self.length + n) // g)
        i, pos = 0, self.length
        while i < n:
            tile, off = divmod(pos, g)
            take = min(g - off, n - i)
            seg_k, seg_v = k[:, i : i + take], v[:, i : i + take]
            if self.sink and tile == 0:
                flat = (seg_k.reshape(-1, *k.shape[2:]), seg_v.reshape(-1, *v.shape[2:]))
                ops.write_tail(*flat, self.tail_k, self.tail_v, self._slots(batch, off, take), self.cfg, impl=self.impl)
            if off == 0 and take == g:
                ops.store_tiles(seg_k, seg_v, self._blocks(tile), self.cache, self.cfg, impl=self.impl)
            else:
                flat_k = seg_k.reshape(-1, *k.shape[2:])
                flat_v = seg_v.reshape(-1, *v.shape[2:])
                ops.write_tail(
                    flat_k, flat_v, self.tail_k, self.tail_v, self._slots(0, off, take), self.cfg, impl=self.impl
                )
                if off + take == g:
                    tail_slots = torch.arange(batch, device=self.device)
                    ops.commit_tiles(
                        self.tail_k, self.tail_v, tail_slots, self._blocks(tile), self.cache, self.cfg, impl=self.impl
                    )
            i += take
            pos += take
        self.length = pos

    def history(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of the first ``length`` stored tokens read back from the cache: ``[B, Hkv, length, D]``.

        Full tiles come from their records (the first from the sink slot when ``sink=True``), the
        rest from the tail slot; un-rotated to the model frame, in the model dtype.
        """
        length = self.length if length is None else length
        if length > self.length:
            raise ValueError(f"length {length} is past the {self.length} tokens stored")
        g = self.cfg.group_size
        n_full, rem = divmod(length, g)
        if self.keep_decoded:
            done = 0 if self.decoded is None else self.decoded[0].shape[2] // g
            if n_full > done:
                new_k, new_v = self._decode_tiles(done, n_full)
                if self.decoded is not None:
                    new_k = torch.cat([self.decoded[0], new_k], dim=2)
                    new_v = torch.cat([self.decoded[1], new_v], dim=2)
                self.decoded = (new_k, new_v)
            k, v = self.decoded[0][:, :, : n_full * g], self.decoded[1][:, :, : n_full * g]
        else:
            k, v = self._decode_tiles(0, n_full)
        if rem:
            tail_k, tail_v = self._frame(self.tail_k[: self.batch_size, :rem], self.tail_v[: self.batch_size, :rem])
            k, v = torch.cat([k, tail_k], dim=2), torch.cat([v, tail_v], dim=2)
        return k, v

    def _frame(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool tiles ``[B, T, Hkv, D]`` (rotated) -> ``[B, Hkv, T, D]`` in the model frame and dtype."""
        k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()
        if self.cfg.rotate:
            k, v = rotate(k), rotate(v)
        return k.to(self.dtype), v.to(self.dtype)

    def _decode_tiles(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles ``first .. last`` read back: ``[B, Hkv, (last - first) * G, D]`` in the model frame and dtype."""
        g, batch = self.cfg.group_size, self.batch_size
        k, v = ops.decode_records(self.records[:, first:last], self.cfg, impl=self.impl)  # [B, n, Hkv, G, D]
        k = k.transpose(2, 3).reshape(batch, -1, self.num_heads, self.cfg.head_dim)  # [B, n * G, Hkv, D]
        v = v.transpose(2, 3).reshape(batch, -1, self.num_heads, self.cfg.head_dim)
        if self.sink and first == 0 and last > 0:
            k[:, :g] = self.tail_k[batch:].float()
            v[:, :g] = self.tail_v[batch:].float()
        return self._frame(k, v)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states, value_states: [B, Hkv, n, D]`` and return the K/V to attend over.

        ``paged=False``: ``[B, Hkv, length, D]``, the history read back from the cache followed by
        the new tokens as given. ``paged=True``: the new tokens, tagged with this layer for the
        ``kvarn`` attention function.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_heads:
            raise ValueError(
                f"key_states must be [{self.batch_size}, {self.num_heads}, n, {self.cfg.head_dim}] for this "
                f"cache, got {tuple(key_states.shape)}"
            )
        past = self.length
        self.first_chunk = past == 0
        k = key_states.transpose(1, 2).to(self.store_dtype)  # [B, n, Hkv, D]
        v = value_states.transpose(1, 2).to(self.store_dtype)
        self._store(k, v)
        if self.paged:
            key_states._kvarn_layer = self
            return key_states, value_states
        if past == 0:
            return key_states, value_states
        hist_k, hist_v = self.history(past)
        return torch.cat([hist_k, key_states], dim=2), torch.cat([hist_v, value_states], dim=2)

    def attend(self, query: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Paged attention of ``query: [B, Hq, n, D]`` (the last ``n`` stored tokens) -> ``[B, n, Hq, D]``."""
        batch, hq, n, d = query.shape
        q = query.transpose(1, 2).reshape(batch * n, hq, d)
        qsl = torch.arange(0, batch * n + 1, n, device=query.device, dtype=torch.int32)
        seq_lens = torch.full((batch,), self.length, device=query.device, dtype=torch.int32)
        tail_slots = torch.arange(batch, device=query.device, dtype=torch.int32)
        sink_slots = tail_slots + batch if self.sink else None
        out = ops.paged_attention(
            q.to(self.store_dtype),
            self.cache,
            self.block_table(),
            seq_lens,
            self.tail_k,
            self.tail_v,
            tail_slots,
            self.cfg,
            qsl,
            sink_slots,
            scale,
            impl=self.impl,
        )
        return out.reshape(batch, n, hq, d).to(query.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.decoded = None
        self.records = self.tail_k = self.tail_v = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            idx = beam_idx.to(self.device)
            self.records = self.records.index_select(0, idx)
            self.decoded = None
            slots = torch.cat([idx, idx + self.batch_size]) if self.sink else idx
            self.tail_k = self.tail_k.index_select(0, slots)
            self.tail_v = self.tail_v.index_select(0, slots)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVarNCache cannot be cropped: committed tiles are quantized and cannot be reopened")

    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds: ``records`` (allocated), ``tail`` and ``sink`` pools, ``decoded`` copy."""
        if not self.is_initialized:
            return {"records": 0, "tail": 0, "sink": 0, "decoded": 0}
        pool = self.tail_k.numel() * self.tail_k.element_size() * 2
        sink = pool // 2 if self.sink else 0
        decoded = sum(t.numel() * t.element_size() for t in self.decoded) if self.decoded else 0
        return {"records": self.records.numel(), "tail": pool - sink, "sink": sink, "decoded": decoded}


class KVarNCache(Cache):
    """A transformers ``Cache`` holding KVarN records, a full-precision tail and an optional sink.

    Args:
        preset: a preset name (default ``kvarn_k4v2_g128``) or a :class:`~kvarn.KVarNConfig`
            (its ``head_dim`` is replaced by the model's).
        sink: keep a full-precision copy of each sequence's first tile and attend over it.
        dtype: dtype K/V are rounded to before storing (tail pool, and the input of the
            quantizer); default the model's. ``torch.float16`` on an fp32 CPU model mirrors an
            fp16 deployment.
        max_cache_len: preallocate records for this many tokens (otherwise they grow tile by tile).
        paged: attend through :func:`kvarn.ops.paged_attention`; needs
            ``attn_implementation="kvarn"`` (:func:`register_kvarn_attention`).
        impl: ``"auto" | "reference" | "triton"``, passed to every :mod:`kvarn.ops` call.
        keep_decoded: keep the decoded K/V of committed tiles between steps instead of decoding
            every record at every step (a speed aid for CPU evaluation: same outputs, but the
            decoded copy costs fp16-cache memory; it is counted under ``"decoded"`` in
            :meth:`nbytes`).

    Example:
        >>> from kvarn.integration.hf import KVarNCache
        >>> out = model.generate(ids, max_new_tokens=32, past_key_values=KVarNCache())  # doctest: +SKIP
    """

    def __init__(
        self,
        preset: str | KVarNConfig = DEFAULT_PRESET,
        *,
        sink: bool = False,
        dtype: torch.dtype | None = None,
        max_cache_len: int | None = None,
        paged: bool = False,
        impl: str = "auto",
        keep_decoded: bool = False,
    ):
        if impl not in ops.IMPLS:
            raise ValueError(f"impl must be one of {ops.IMPLS}, got {impl!r}")
        if isinstance(preset, str):
            KVarNConfig.from_preset(preset)  # fail early on an unknown name
        self.preset, self.sink, self.paged = preset, sink, paged
        kwargs = {
            "sink": sink,
            "dtype": dtype,
            "max_cache_len": max_cache_len,
            "paged": paged,
            "impl": impl,
            "keep_decoded": keep_decoded,
        }
        super().__init__(layer_class_to_replicate=lambda: KVarNLayer(preset, **kwargs))

    def nbytes(self) -> dict[str, int]:
        """Bytes held by all layers: ``records``, ``tail``, ``sink``, ``decoded`` and ``total``."""
        out = {"records": 0, "tail": 0, "sink": 0, "decoded": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                out[key] += value
        out["total"] = sum(out.values())
        return out

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 ``DynamicCache`` holding the same tokens would take (2 bytes per K and V element)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                total += 2 * 2 * layer.batch_size * layer.num_heads * layer.length * layer.cfg.head_dim
        return total

    def memory_report(self) -> dict[str, float]:
        """``nbytes()`` plus ``fp16_bytes`` and ``capacity_vs_fp16`` (fp16 bytes / bytes held)."""
        out: dict[str, float] = dict(self.nbytes())
        out["fp16_bytes"] = self.fp16_nbytes()
        out["capacity_vs_fp16"] = out["fp16_bytes"] / out["total"] if out["total"] else float("nan")
        return out


def kvarn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``attn_implementation="kvarn"`` attention function: paged attention over a ``KVarNCache(paged=True)``.

    ``query: [B, Hq, n, D]`` -> ``([B, n, Hq, D], None)``. The prompt chunk runs transformers' SDPA
    over its exact K/V; later chunks read the cache through :func:`kvarn.ops.paged_attention`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = getattr(key, "_kvarn_layer", None)
    if layer is None:
        raise RuntimeError(
            "attn_implementation='kvarn' needs past_key_values=KVarNCache(..., paged=True); "
            "with another cache use attn_implementation='sdpa'"
        )
    if layer.first_chunk:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    return layer.attend(query, scaling), None


def register_kvarn_attention() -> str:
    """Register ``"kvarn"`` with transformers' attention and mask interfaces; returns the name.

    Then ``model.set_attn_implementation("kvarn")`` (or ``from_pretrained(...,
    attn_implementation="kvarn")``) and ``past_key_values=KVarNCache(paged=True)``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kvarn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
