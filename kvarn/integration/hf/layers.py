"""One attention layer of a :class:`~kvarn.integration.hf.KVarNCache`: KVarN records (:class:`KVarNLayer`) or
K/V kept unquantized by a layer policy (:class:`FullPrecisionLayer`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvarn.config import DEFAULT_PRESET, KVarNConfig
from kvarn.integration.hf.attention import ATTENDING
from kvarn.integration.hf.batch import Sequences, passed_position_ids
from kvarn.paged import PagedKV

STORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes K/V may be stored in: the full-precision pool's, and the quantizer's input."""
STORE_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"


@dataclass
class _KeptHistory:
    """What a ``keep_decoded`` layer attends over, kept from step to step: ``k, v: [B, Hkv, capacity, D]``.

    Positions ``0 .. length`` hold what :meth:`KVarNLayer.history` would read back (model frame and
    dtype, zeros at padding) as it stood before the last step, whose positions hold that step's K/V as
    given until the next step settles them. Each step then reads back only what changed: the last
    step's tokens from the tail, and the tiles completed since from their records.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int
    last: tuple[int, int, list[int]]  # (start, n, real tokens of each row) of the unsettled step

    def reserve(self, positions: int) -> None:
        """Grow the capacity to at least ``positions`` (doubling, so a generation copies O(its length) in all)."""
        capacity = self.k.shape[2]
        if positions <= capacity:
            return
        capacity = max(positions, 2 * capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


def _rows(index: list[int]) -> slice | list[int]:
    """Batch rows ``index`` (ascending) as a slice where they are consecutive (a view, not a gather)."""
    return slice(index[0], index[-1] + 1) if index[-1] - index[0] == len(index) - 1 else index


class KVarNLayer(CacheLayerMixin):
    """The KVarN cache of one attention layer: a :class:`~kvarn.paged.PagedKV` and its view of the batch."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    quantized = True

    def __init__(
        self,
        sequences: Sequences,
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
        self.kept: _KeptHistory | None = None
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
        if self.store_dtype not in STORE_DTYPES:
            raise ValueError(
                f"KVarNCache stores K/V in {STORE_DTYPE_NAMES}, and by default in the model's dtype, which is "
                f"{key_states.dtype} here; name one, e.g. KVarNCache(dtype=torch.float32)"
            )
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
        step = self.step = self.sequences.begin(past, key_states, self.cfg, passed_position_ids(args, kwargs))
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
            ATTENDING.set((self, key_states))
            return key_states, value_states
        if self.keep_decoded:
            out = self._attend_kept(step, past, key_states, value_states)
            self.finish_step()
            return out
        if past == 0:
            self.finish_step()
            return key_states, value_states
        hist_k, hist_v = self.history(step.before, past, before=True)
        self.finish_step()
        return torch.cat([hist_k, key_states], dim=2), torch.cat([hist_v, value_states], dim=2)

    def _attend_kept(self, step, past: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """:meth:`update`'s result (``history(before=True)`` then the step's K/V) from :attr:`kept`."""
        kept = self.kept
        if kept is None:  # the first step, or rows reordered since the last (reorder_rows drops it)
            kept = self.kept = self._start_kept(past)
        else:
            self._settle(kept, step)
        end = past + step.n
        kept.reserve(end)
        kept.k[:, :, past:end] = key_states
        kept.v[:, :, past:end] = value_states
        kept.last = (past, step.n, [a - b for a, b in zip(step.after, step.before, strict=True)])
        kept.length = end
        if past == 0:
            return key_states, value_states
        return kept.k[:, :, :end], kept.v[:, :, :end]

    def _start_kept(self, past: int) -> _KeptHistory:
        """A fresh :class:`_KeptHistory` of the positions before this step, read back whole."""
        shape = (self.batch_size, self.num_heads, 0, self.cfg.head_dim)
        empty = torch.zeros(shape, dtype=self.dtype, device=self.device)
        kept = _KeptHistory(empty, empty.clone(), 0, (0, 0, []))
        if past:
            kept.reserve(past)
            kept.k[:, :, :past], kept.v[:, :, :past] = self.history(self.step.before, past, before=True)
            kept.length = past
            self.decoded = None  # the kept history replaces it
        return kept

    def _settle(self, kept: _KeptHistory, step) -> None:
        """Bring the last step's positions (and tiles completed since) to what ``history(before=True)`` reads."""
        g, past, plan = self.cfg.group_size, kept.length, step.plan
        start, n, new = kept.last
        for b, r in enumerate(new):  # left padding inside the last step's positions reads back as zeros
            if r < n:
                kept.k[b, :, start : start + n - r] = 0
                kept.v[b, :, start : start + n - r] = 0
        work: dict[tuple[int, int, int, int, int], list[int]] = {}  # rows with the same reads, read together
        for b, (before, r) in enumerate(zip(step.before, new, strict=True)):
            tiles = before // g  # the own-tile rule: a partial tile is read from its tail slot
            settled = before - r  # the row's real tokens before the last step
            work.setdefault((past - before, settled // g, tiles, max(settled, tiles * g), before), []).append(b)
        for (pad, tile_lo, tile_hi, tok_lo, tok_hi), index in work.items():
            rows = _rows(index)
            if tile_hi > tile_lo:
                sinks = plan.sink_slots[rows] if tile_lo == 0 and plan.sink_slots is not None else None
                k, v = self.kv.read_tiles(step.block_table[rows, tile_lo:tile_hi], sinks)
                at = slice(pad + tile_lo * g, pad + tile_hi * g)
                kept.k[rows, :, at] = k.transpose(1, 2).to(self.dtype)
                kept.v[rows, :, at] = v.transpose(1, 2).to(self.dtype)
            if tok_hi > tok_lo:
                first = tile_hi * g
                k, v = self.kv.read_tail(plan.head_slots[rows], tok_hi - tok_lo, start=tok_lo - first)
                at = slice(pad + tok_lo, pad + tok_hi)
                kept.k[rows, :, at] = k.transpose(1, 2).to(self.dtype)
                kept.v[rows, :, at] = v.transpose(1, 2).to(self.dtype)

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
        tiles_k, tiles_v = self._tiles(n_full, min(committed, default=0))
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

    def _tiles(self, n: int, common: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles ``0 .. n`` of every row read back: ``[B, n * G, Hkv, D]`` fp32, model frame.

        ``keep_decoded`` keeps the first ``common`` of them, which every row has committed: a row of a
        left-padded batch may not have written its tile ``i`` yet when another row has.
        """
        step = self.step
        sinks = step.plan.sink_slots
        if not self.keep_decoded:
            return self.kv.read_tiles(step.block_table[:, :n], sinks)
        g, keep = self.cfg.group_size, min(n, common)
        done = 0 if self.decoded is None else self.decoded[0].shape[1] // g
        if keep > done:
            new_k, new_v = self.kv.read_tiles(step.block_table[:, done:keep], sinks if done == 0 else None)
            if self.decoded is not None:
                new_k = torch.cat([self.decoded[0], new_k], dim=1)
                new_v = torch.cat([self.decoded[1], new_v], dim=1)
            self.decoded = (new_k, new_v)
        kept = None if self.decoded is None else tuple(t[:, : keep * g] for t in self.decoded)
        if kept is not None and n == keep:
            return kept
        rest = self.kv.read_tiles(step.block_table[:, keep:n], sinks if keep == 0 else None)
        return rest if kept is None else tuple(torch.cat([a, b], dim=1) for a, b in zip(kept, rest, strict=True))

    def attend(self, query: torch.Tensor, scale: float | None = None, window: int | None = None) -> torch.Tensor:
        """Paged attention of ``query: [B, Hq, n, D]`` (the last ``n`` stored positions) -> ``[B, n, Hq, D]``.

        ``window``: the layer's sliding window (a query at ``p`` sees keys ``p - window + 1 .. p``), or None.
        """
        step = self.step
        batch, hq, n, d = query.shape
        if any(a - b != n for a, b in zip(step.after, step.before, strict=True)):
            raise ValueError("KVarNCache(paged=True) attends only chunks without padding after the prompt")
        q = query.transpose(1, 2).reshape(batch * n, hq, d).to(self.store_dtype)
        k, v = self.pending
        out = self.kv.attend(
            step.plan, q, step.block_table, step.seq_lens, step.query_start_loc, scale, None, k, v, window=window
        )
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
        self.kept = None
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
        self.kept = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("KVarNCache cannot be cropped: committed tiles are quantized and cannot be reopened")

    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds: ``records`` (allocated), ``tail`` and ``sink`` pools, ``decoded`` copies."""
        if not self.is_initialized:
            return {"records": 0, "tail": 0, "sink": 0, "decoded": 0}
        copies = [*(self.decoded or ()), *((self.kept.k, self.kept.v) if self.kept else ())]
        decoded = sum(t.numel() * t.element_size() for t in copies)
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
            ATTENDING.set((self, keys))
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
