"""A transformers cache that stores KVarN records: ``model.generate(..., past_key_values=KVarNCache())``.

An adapter over :mod:`kvarn.paged`, like the vLLM backend: the batch's rows are a
:class:`~kvarn.paged.DenseBatch` (which plans each step once for all layers, tile ``i`` of row
``b`` in block ``i * B + b``), and each layer keeps a :class:`~kvarn.paged.PagedKV` (records plus
the full-precision tail and sink pool). This module finds the batch's padding, moves tensors
between the model and those objects, and holds no math: no rotation, no tile commits, no sink
handling of its own.

Two ways to attend:

- ``paged=False`` (default, any ``attn_implementation``): :meth:`KVarNLayer.update` returns the
  history read back from the cache (:meth:`~kvarn.paged.PagedKV.read_tiles`, in the model frame
  and dtype), followed by the chunk's own K/V exactly as the model computed them.
- ``paged=True`` with ``attn_implementation="kvarn"`` (see :func:`register_kvarn_attention`):
  attention reads the records directly (:meth:`~kvarn.paged.PagedKV.attend`: Triton on CUDA, the
  reference elsewhere) under the own-tile rule: the tiles before a query's own from the records,
  its own tile in full precision (the tail slot the step started in, then the chunk's K/V).

In both modes the first chunk of a sequence (the prompt) attends over its exact K/V (it has no
history, and seeing all of itself exactly is at least what the own-tile rule gives). A later
chunk in the first mode sees all of itself exactly (and the history's partial tile from its tail
slot); in the second it follows the own-tile rule, as vLLM does. The two agree wherever a later
chunk stays inside one tile (decoding) or is made of whole tiles.

Left-padded batches: each row's tiles start at its first real token, so a row's records do not
depend on how much padding it got. Where the padding comes from, first found wins:

1. ``position_ids`` passed down to ``update`` (newer transformers pass the attention's keyword
   arguments to the cache; a row's real length is its last position + 1);
2. ``KVarNCache(..., attention_mask=mask)``, the prompt's ``[B, T]`` mask as given to ``generate``;
3. with ``attn_implementation="kvarn"``, the padding mask transformers builds the attention mask
   from (the ``kvarn`` mask function records it).

Padding must be on the left, as transformers requires for generation. A batch of more than one
row with none of these is taken as unpadded, with a warning.
"""

from __future__ import annotations

import contextvars
import math
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvarn import ops
from kvarn.config import DEFAULT_PRESET, KVarNConfig, LayerPolicy, check_preset
from kvarn.paged import BatchStep, DenseBatch, PagedKV

ATTENTION_NAME = "kvarn"

_ATTENDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("kvarn_attending", default=None)
"""``(layer, key)``: the paged layer whose ``update`` ran last in this context and the key tensor it
returned; the ``kvarn`` attention function takes the layer when it is handed that same key."""
_MASKED: contextvars.ContextVar[torch.Tensor | str | None] = contextvars.ContextVar("kvarn_padding", default=None)
"""What the ``kvarn`` mask function saw in this forward: the ``[B, kv_len]`` padding mask (True = real
token), or :data:`UNPADDED` when transformers built the mask without one; taken by the next new step."""
UNPADDED = "unpadded"


def _position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``[B, n]`` position ids transformers passed down to ``Cache.update``, if any."""
    found = kwargs.get("position_ids")
    for holder in (kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *args):
        if found is None and isinstance(holder, dict):
            found = holder.get("position_ids")
    if isinstance(found, torch.Tensor) and found.dim() == 2:
        return found
    return None


def _left_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask: [B, T]`` (nonzero = real token) as bool on the CPU, checked to pad on the left only."""
    mask = mask.detach().to("cpu", torch.bool)
    if mask.dim() != 2 or (mask.int().diff(dim=1) < 0).any():
        raise ValueError(
            "KVarNCache needs a [B, T] attention mask that pads on the left only (tokenizer padding_side='left'), "
            f"got one of shape {tuple(mask.shape)} with a padding position after a real token"
        )
    return mask


class _Sequences:
    """The rows of one :class:`KVarNCache` (a :class:`~kvarn.paged.DenseBatch`) and where their padding comes from."""

    def __init__(self, sink: bool, attention_mask: torch.Tensor | None = None):
        self.sink = sink
        self.prompt_mask = None if attention_mask is None else _left_padding_mask(attention_mask)
        self.rows = DenseBatch(sink)
        self.warned_range = False

    def reset(self) -> None:
        self.rows.reset()
        self.warned_range = False

    def begin(self, start: int, key_states: torch.Tensor, cfg: KVarNConfig, position_ids) -> BatchStep:
        """The step storing ``key_states: [B, Hkv, n, D]`` at positions ``start ..``, planned once for all layers."""
        batch, _, n, _ = key_states.shape
        return self.rows.begin(
            start,
            n,
            batch,
            cfg.group_size,
            key_states.device,
            lambda before: self._new_tokens(batch, start, n, position_ids, before),
        )

    def _new_tokens(self, batch: int, start: int, n: int, position_ids, before: list[int]) -> list[int]:
        """Real tokens of each row in the chunk of positions ``start .. start + n`` (the rest is left padding)."""
        if position_ids is None or position_ids.shape[0] != batch:
            mask = self.prompt_mask
            seen = _MASKED.get()
            _MASKED.set(None)
            fits = isinstance(seen, torch.Tensor) and seen.shape[0] == batch and seen.shape[1] >= start + n
            if mask is None and fits:
                mask = _left_padding_mask(seen)
            if mask is None:
                if batch > 1 and start == 0 and seen is not UNPADDED:
                    warnings.warn(
                        "KVarNCache cannot see this batch's padding; if it is padded, pass "
                        "KVarNCache(..., attention_mask=mask) or each row's records will depend on its padding",
                        stacklevel=6,
                    )
                return [n] * batch
            real = mask[:, start : start + n].sum(1).tolist()
            past_mask = max(0, start + n - max(mask.shape[1], start))  # positions past the mask are real
            return [int(r) + past_mask for r in real]
        pos = position_ids.detach().cpu()
        new = []
        for b in range(batch):
            r = int(pos[b, -1]) + 1 - before[b]
            real = pos[b, n - r :] if 0 <= r <= n else None
            if real is None or (before[b] and r != n) or not torch.equal(real, torch.arange(before[b], before[b] + r)):
                raise ValueError(
                    f"row {b}: position ids {pos[b].tolist()} after {before[b]} real tokens are not a left-padded "
                    "continuation; KVarNCache needs padding on the left (tokenizer padding_side='left')"
                )
            new.append(r)
        return new


class KVarNLayer(CacheLayerMixin):
    """The KVarN cache of one attention layer: a :class:`~kvarn.paged.PagedKV` and its view of the batch."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    quantized = True

    def __init__(
        self,
        sequences: _Sequences,
        preset: str | KVarNConfig = DEFAULT_PRESET,
        *,
        dtype: torch.dtype | None = None,
        max_cache_len: int | None = None,
        paged: bool = False,
        impl: str = "auto",
        keep_decoded: bool = False,
    ):
        super().__init__()
        self.sequences = sequences
        self.preset = preset
        self.store_dtype = dtype
        self.max_cache_len = max_cache_len
        self.paged = paged
        self.impl = impl
        self.keep_decoded = keep_decoded
        self.decoded: tuple[torch.Tensor, torch.Tensor] | None = None
        self.length = 0
        self.cfg: KVarNConfig | None = None
        self.kv: PagedKV | None = None
        self.first_chunk = True
        self.saw_kvarn_attention = False
        self.step = None  # the step of this layer's last update
        self.pending = None  # the last step's K/V until its late tail tokens are written (finish_step)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pool (and the records, given ``max_cache_len``) for ``key_states: [B, Hkv, T, D]``."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                f"key_states and value_states must both be [B, Hkv, T, D], got {tuple(key_states.shape)} "
                f"and {tuple(value_states.shape)}"
            )
        batch, hkv, _, d = key_states.shape
        self.cfg = KVarNConfig.from_preset(self.preset, head_dim=d)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = self.store_dtype or key_states.dtype
        self.batch_size, self.num_heads = batch, hkv
        tiles = math.ceil(self.max_cache_len / self.cfg.group_size) if self.max_cache_len else 0
        sinks = batch if self.sequences.sink else 0
        self.kv = PagedKV.allocate(
            self.cfg, tiles * batch, hkv, batch, self.store_dtype, self.device, num_sink_slots=sinks, impl=self.impl
        )
        self.is_initialized = True

    @property
    def records(self) -> torch.Tensor:
        """The records as ``[B, tiles, Hkv, record_bytes]`` (a view of the paged cache)."""
        cache = self.kv.cache
        return cache.view(-1, self.batch_size, *cache.shape[1:]).transpose(0, 1)

    @property
    def tail_k(self) -> torch.Tensor:
        """The full-precision pool (sink slots, then tail slots) ``[slots, G, Hkv, D]``, rotated frame."""
        return self.kv.tail_k

    @property
    def tail_v(self) -> torch.Tensor:
        return self.kv.tail_v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states, value_states: [B, Hkv, n, D]`` and return the K/V to attend over.

        ``paged=False``: ``[B, Hkv, positions, D]``, the history read back from the cache (zeros at
        padding positions) followed by the new tokens as given. ``paged=True``: the new tokens; the
        ``kvarn`` attention function reads the cache.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.finish_step()
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_heads:
            raise ValueError(
                f"key_states must be [{self.batch_size}, {self.num_heads}, n, {self.cfg.head_dim}] for this "
                f"cache, got {tuple(key_states.shape)}"
            )
        if self.paged and self.length and not self.saw_kvarn_attention:
            raise RuntimeError(
                "KVarNCache(paged=True) needs attn_implementation='kvarn' (register_kvarn_attention()); this model "
                "attends with another implementation, which would read only the newest tokens. Use "
                "KVarNCache(paged=False) with it instead"
            )
        past = self.length
        step = self.step = self.sequences.begin(past, key_states, self.cfg, _position_ids(args, kwargs))
        self.first_chunk = past == 0
        kv = self.kv
        kv.grow_blocks(max(step.after) // self.cfg.group_size * self.batch_size)  # records of full tiles
        kv.grow_pool(step.plan.slots_needed)
        flat = (self.batch_size * step.n, self.num_heads, self.cfg.head_dim)
        k = key_states.transpose(1, 2).reshape(flat)[step.token_idx]
        v = value_states.transpose(1, 2).reshape(flat)[step.token_idx]
        # only K/V wider than an fp16 store dtype can saturate it; the check costs a host sync:
        # every chunk of several tokens, and once a tile while decoding
        check = step.n > 1 or past % self.cfg.group_size == 0
        if check and not self.sequences.warned_range and kv.overflows(k, v):
            self.sequences.warned_range = True
            warnings.warn(
                f"KVarNCache: K/V values past what {self.store_dtype} holds (65504, or vectors whose Hadamard "
                f"rotation leaves the pool's range) are saturated in the full-precision pool and lose accuracy; "
                "store in a wider dtype (KVarNCache(dtype=torch.bfloat16 or torch.float32))",
                stacklevel=4,
            )
        k, v = k.to(self.store_dtype), v.to(self.store_dtype)
        kv.store(step.plan, k, v)
        self.pending = (k, v)
        self.length = past + step.n
        if self.paged:
            _ATTENDING.set((self, key_states))
            return key_states, value_states
        if past == 0:
            self.finish_step()
            return key_states, value_states
        hist_k, hist_v = self.history(step.before, past, before=True)
        self.finish_step()
        return torch.cat([hist_k, key_states], dim=2), torch.cat([hist_v, value_states], dim=2)

    def finish_step(self) -> None:
        """Write the tail tokens of the last step that waited for its attention (``PagedKV.write_late_tail``)."""
        if self.pending is not None:
            self.kv.write_late_tail(self.step.plan, *self.pending)
            self.pending = None

    def history(self, lengths: list[int] | None = None, positions: int | None = None, *, before: bool = False):
        """The first ``lengths[b]`` real tokens of each row read back from the cache, right-aligned in
        ``[B, Hkv, positions, D]`` (model frame and dtype; zeros where a row has fewer tokens).

        Full tiles come from their records (tile 0 from the sink slot with ``sink=True``), the rest
        from the row's tail slot. Default: every stored token (after the step); ``before``: the
        tokens before the step (``lengths`` its ``before``), the last partial tile from the slot the
        step started in (the own-tile rule: the step's tokens see it in full precision).
        """
        step = self.step
        if not before:
            self.finish_step()
        lengths = list(step.after) if lengths is None else lengths
        positions = self.length if positions is None else positions
        g = self.cfg.group_size
        committed = [n // g for n in (lengths if before else step.after)]  # tiles read from records
        n_full = max((min(math.ceil(n / g), c) for n, c in zip(lengths, committed, strict=True)), default=0)
        tiles_k, tiles_v = self._tiles(n_full)
        tail_k, tail_v = self.kv.read_tail(step.plan.head_slots if before else step.plan.tail_slots, g)
        out_k = key_like = torch.zeros(
            self.batch_size, positions, self.num_heads, self.cfg.head_dim, dtype=self.dtype, device=self.device
        )
        out_v = torch.zeros_like(key_like)
        for b, n in enumerate(lengths):
            from_records = min(n, committed[b] * g)
            rows_k = [tiles_k[b, :from_records], tail_k[b, : n - from_records]]
            rows_v = [tiles_v[b, :from_records], tail_v[b, : n - from_records]]
            out_k[b, positions - n :] = torch.cat(rows_k).to(self.dtype)
            out_v[b, positions - n :] = torch.cat(rows_v).to(self.dtype)
        return out_k.transpose(1, 2), out_v.transpose(1, 2)

    def _tiles(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles ``0 .. n`` of every row read back: ``[B, n * G, Hkv, D]`` fp32, model frame."""
        step = self.step
        sinks = step.plan.sink_slots
        if not self.keep_decoded:
            return self.kv.read_tiles(step.block_table[:, :n], sinks)
        g = self.cfg.group_size
        done = 0 if self.decoded is None else self.decoded[0].shape[1] // g
        if n > done:
            new_k, new_v = self.kv.read_tiles(step.block_table[:, done:n], sinks if done == 0 else None)
            if self.decoded is not None:
                new_k = torch.cat([self.decoded[0], new_k], dim=1)
                new_v = torch.cat([self.decoded[1], new_v], dim=1)
            self.decoded = (new_k, new_v)
        return self.decoded[0][:, : n * g], self.decoded[1][:, : n * g]

    def attend(self, query: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Paged attention of ``query: [B, Hq, n, D]`` (the last ``n`` stored positions) -> ``[B, n, Hq, D]``."""
        step = self.step
        batch, hq, n, d = query.shape
        if any(a - b != n for a, b in zip(step.after, step.before, strict=True)):
            raise ValueError("KVarNCache(paged=True) attends only chunks without padding after the prompt")
        q = query.transpose(1, 2).reshape(batch * n, hq, d).to(self.store_dtype)
        k, v = self.pending
        out = self.kv.attend(step.plan, q, step.block_table, step.seq_lens, step.query_start_loc, scale, None, k, v)
        self.finish_step()
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
        self.kv = None
        self.first_chunk = True
        self.saw_kvarn_attention = False
        self.step = None
        self.pending = None
        self.is_initialized = False

    def reorder_rows(self, beam_idx: torch.Tensor, moves: list[tuple[int, int]]) -> None:
        """Rows ``beam_idx`` become rows ``0 .. B``: records, and the pool rows ``moves`` names."""
        if not self.is_initialized:
            return
        self.finish_step()
        cache = self.kv.cache
        tiles = cache.view(-1, self.batch_size, *cache.shape[1:])
        self.kv.cache = tiles.index_select(1, beam_idx.to(self.device)).reshape(cache.shape)
        if moves:
            dst, src = (torch.tensor(m, device=self.device) for m in zip(*moves, strict=True))
            self.kv.tail_k[dst] = self.kv.tail_k[src].clone()
            self.kv.tail_v[dst] = self.kv.tail_v[src].clone()
        self.decoded = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVarNCache cannot be cropped: committed tiles are quantized and cannot be reopened")

    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds: ``records`` (allocated), ``tail`` and ``sink`` pools, ``decoded`` copy."""
        if not self.is_initialized:
            return {"records": 0, "tail": 0, "sink": 0, "decoded": 0}
        decoded = sum(t.numel() * t.element_size() for t in self.decoded) if self.decoded else 0
        return {**self.kv.nbytes(), "decoded": decoded}

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim


class FullPrecisionLayer(CacheLayerMixin):
    """A layer a :class:`~kvarn.config.LayerPolicy` keeps unquantized: K/V in the store dtype, every position.

    Like transformers' ``DynamicLayer``, with K/V rounded to the cache's store dtype (default the
    model's) as :class:`KVarNLayer` rounds its tail; padding positions are stored as given (the
    attention mask hides them). ``update`` returns the history read back in the model dtype
    followed by the chunk's own K/V as the model computed them.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    quantized = False

    def __init__(self, *, dtype: torch.dtype | None = None, paged: bool = False):
        super().__init__()
        self.store_dtype = dtype
        self.paged = paged
        self.length = 0
        self.first_chunk = True
        self.saw_kvarn_attention = False
        self.keys = self.values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = self.store_dtype or key_states.dtype
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self.keys = key_states[:, :, :0].to(self.store_dtype)
        self.values = value_states[:, :, :0].to(self.store_dtype)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states, value_states: [B, Hkv, n, D]``; return ``[B, Hkv, positions, D]`` to attend over."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[:2] != (self.batch_size, self.num_heads) or key_states.shape != value_states.shape:
            raise ValueError(
                f"key_states and value_states must both be [{self.batch_size}, {self.num_heads}, n, "
                f"{self.head_dim}] for this cache, got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        past = self.length
        self.first_chunk = past == 0
        hist_k, hist_v = self.keys.to(self.dtype), self.values.to(self.dtype)
        self.keys = torch.cat([self.keys, key_states.to(self.store_dtype)], dim=2)
        self.values = torch.cat([self.values, value_states.to(self.store_dtype)], dim=2)
        self.length = past + key_states.shape[2]
        keys = torch.cat([hist_k, key_states], dim=2)
        values = torch.cat([hist_v, value_states], dim=2)
        if self.paged:
            _ATTENDING.set((self, keys))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None
        self.first_chunk = True
        self.is_initialized = False

    def reorder_rows(self, beam_idx: torch.Tensor, moves: list[tuple[int, int]]) -> None:
        if self.is_initialized:
            self.keys = self.keys.index_select(0, beam_idx.to(self.device))
            self.values = self.values.index_select(0, beam_idx.to(self.device))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVarNCache cannot be cropped: committed tiles are quantized and cannot be reopened")

    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds, all under ``full_precision``."""
        held = 0 if not self.is_initialized else sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return {"records": 0, "tail": 0, "sink": 0, "decoded": 0, "full_precision": held}


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
        paged: attend through :meth:`kvarn.paged.PagedKV.attend`; needs
            ``attn_implementation="kvarn"`` (:func:`register_kvarn_attention`).
        impl: ``"auto" | "reference" | "triton"``, passed to every :mod:`kvarn.ops` call.
        keep_decoded: keep the decoded K/V of committed tiles between steps instead of decoding
            every record at every step (a speed aid for CPU evaluation: same outputs, but the
            decoded copy costs fp16-cache memory; it is counted under ``"decoded"`` in
            :meth:`nbytes`).
        attention_mask: the prompt's ``[B, T]`` attention mask (as given to ``generate``) for a
            left-padded batch, so that each row's tiles start at its first real token. Needed only
            where transformers passes no position ids to the cache and the attention is not
            ``"kvarn"`` (see the module docstring).
        layer_policy: a :class:`~kvarn.config.LayerPolicy` keeping some layers (e.g. the first and
            the last) unquantized in ``dtype`` or at another preset of the same tile length.
        num_layers: the model's attention layer count (``model.config.num_hidden_layers``); needed
            when ``layer_policy`` counts layers from the end, checked against the layers seen.

    Example:
        >>> from kvarn.integration.hf import KVarNCache
        >>> out = model.generate(ids, max_new_tokens=32, past_key_values=KVarNCache())  # doctest: +SKIP
        >>> policy = LayerPolicy(first=1, last=1)  # layers 0 and L-1 unquantized
        >>> n = model.config.num_hidden_layers  # doctest: +SKIP
        >>> cache = KVarNCache("kvarn_k2v2_g128", layer_policy=policy, num_layers=n)  # doctest: +SKIP
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
        attention_mask: torch.Tensor | None = None,
        layer_policy: LayerPolicy | None = None,
        num_layers: int | None = None,
    ):
        if impl not in ops.IMPLS:
            raise ValueError(f"impl must be one of {ops.IMPLS}, got {impl!r}")
        check_preset(preset)
        if layer_policy is not None and not isinstance(layer_policy, LayerPolicy):
            raise TypeError(f"layer_policy must be a kvarn.config.LayerPolicy, got {type(layer_policy).__name__}")
        self.preset, self.sink, self.paged = preset, sink, paged
        self.layer_policy, self.num_layers = layer_policy, num_layers
        kept, kept_preset = (), None
        if layer_policy is not None:
            kept = layer_policy.kept(num_layers)
            kept_preset = layer_policy.kept_config(KVarNConfig.from_preset(preset))
        self._sequences = _Sequences(sink, attention_mask)
        kwargs = {
            "dtype": dtype,
            "max_cache_len": max_cache_len,
            "paged": paged,
            "impl": impl,
            "keep_decoded": keep_decoded,
        }

        def make_layer() -> CacheLayerMixin:
            index = len(self.layers)  # transformers appends layers in order, each when first updated
            if num_layers is not None and index >= num_layers:
                raise ValueError(f"KVarNCache(num_layers={num_layers}) got an update for layer {index}")
            if index not in kept:
                return KVarNLayer(self._sequences, preset, **kwargs)
            if kept_preset is None:
                return FullPrecisionLayer(dtype=dtype, paged=paged)
            return KVarNLayer(self._sequences, kept_preset, **kwargs)

        super().__init__(layer_class_to_replicate=make_layer)

    def reset(self) -> None:
        super().reset()
        self._sequences.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        moves = self._sequences.rows.reorder(beam_idx.tolist())
        for layer in self.layers:
            layer.reorder_rows(beam_idx, moves)

    def nbytes(self) -> dict[str, int]:
        """Bytes held by all layers: ``records``, ``tail``, ``sink``, ``decoded``, ``full_precision`` (the layers a
        :class:`~kvarn.config.LayerPolicy` keeps unquantized) and ``total``."""
        out = {"records": 0, "tail": 0, "sink": 0, "decoded": 0, "full_precision": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                out[key] += value
        out["total"] = sum(out.values())
        return out

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 ``DynamicCache`` holding the same real tokens would take (2 bytes per K and V element)."""
        tokens = sum(self._sequences.rows.real)
        if not any(layer.quantized for layer in self.layers if layer.is_initialized):  # a policy keeping every layer
            tokens = sum(layer.batch_size * layer.length for layer in self.layers[:1] if layer.is_initialized)
        return sum(2 * 2 * layer.num_heads * tokens * layer.head_dim for layer in self.layers if layer.is_initialized)

    def memory_report(self) -> dict[str, float]:
        """What the cache holds against an fp16 cache of the same tokens.

        ``nbytes()`` (allocated bytes) plus ``fp16_bytes``, ``capacity_vs_fp16`` (fp16 bytes / bytes
        held: pools included, so short sequences, whose tail slot is mostly empty, score low),
        ``tail_used`` (bytes of the tokens the tail slots hold now) and ``records_vs_fp16`` (fp16
        bytes of the committed tokens / their record bytes: the ratio a long sequence tends to).
        """
        out: dict[str, float] = dict(self.nbytes())
        out["fp16_bytes"] = self.fp16_nbytes()
        out["capacity_vs_fp16"] = out["fp16_bytes"] / out["total"] if out["total"] else float("nan")
        real, committed, used, record = self._sequences.rows.real, 0, 0, 0
        for layer in self.layers:
            if layer.is_initialized and layer.quantized:
                g, per_token = layer.cfg.group_size, layer.num_heads * layer.cfg.head_dim
                committed += sum(r // g * g for r in real) * 2 * 2 * per_token
                used += sum(r % g for r in real) * 2 * per_token * layer.kv.tail_k.element_size()
                record += sum(r // g for r in real) * layer.num_heads * layer.cfg.record_bytes
        out["tail_used"] = used
        out["records_vs_fp16"] = committed / record if record else float("nan")
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
    over its exact K/V; later chunks read the cache through :meth:`kvarn.paged.PagedKV.attend`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    entry = _ATTENDING.get()
    _ATTENDING.set(None)
    layer = entry[0] if entry is not None and entry[1] is key else None
    if layer is None:
        raise RuntimeError(
            "attn_implementation='kvarn' needs past_key_values=KVarNCache(..., paged=True); "
            "with another cache use attn_implementation='sdpa'"
        )
    layer.saw_kvarn_attention = True
    if layer.first_chunk or not layer.quantized:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
        if layer.quantized:
            layer.finish_step()
        return out
    return layer.attend(query, scaling), None


def register_kvarn_attention() -> str:
    """Register ``"kvarn"`` with transformers' attention and mask interfaces; returns the name.

    Then ``model.set_attn_implementation("kvarn")`` (or ``from_pretrained(...,
    attn_implementation="kvarn")``) and ``past_key_values=KVarNCache(paged=True)``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def kvarn_mask(*args, **kwargs):
        """transformers' SDPA mask, after recording the padding mask for :class:`KVarNCache`."""
        padding = kwargs.get("attention_mask")
        _MASKED.set(padding if isinstance(padding, torch.Tensor) and padding.dim() == 2 else UNPADDED)
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, kvarn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvarn_mask)
    return ATTENTION_NAME
