"""The paged KVarN cache below the integrations: the tile lifecycle and one layer's storage.

Both integrations (the vLLM backend and the transformers cache) are adapters over this module;
it imports neither vLLM nor transformers. Per step, an integration hands over ragged chunks of
new tokens (``query_start_loc``), each sequence's length after the step (``seq_lens``) and its
block table. One block is one tile of ``G`` tokens. :class:`TilePlanner` turns that into a
:class:`TilePlan`, and :class:`PagedKV` (the records and the full-precision pool of one layer)
carries the plan out through :mod:`kvarn.ops`:

- A tile that this step writes from its first to its last token goes straight to its record
  (``store_tiles``): whole prompt tiles of a prefill chunk.
- Every other token goes to the full-precision tail pool (``write_tail``) at
  ``slot * G + offset``. A tile that becomes full in this step (a decode step or a chunk that
  ends the tile) is then quantized from its slot into its block (``commit_tiles``), in the same
  step and before attention: vLLM may publish that block to the prefix cache in this step.
- Attention follows the own-tile rule (:func:`kvarn.reference.paged_attention`): a query reads
  the tiles before its own from their records and its own tile in full precision, from the slot
  the step started in (:attr:`TilePlan.head_slots`, which keeps a tile completed in this step
  until attention has read it) and from the step's own K/V.

Tail slots are keyed by the block id of the incomplete tile. An incomplete block belongs to
exactly one live request (vLLM shares only full, hashed blocks), so the key needs no request id,
survives steps in which the request is not scheduled, and is dropped with the block: a request
that finishes or is preempted frees the block, and the next owner of that block id starts its
tile at offset 0 (prefix hits land on tile boundaries), overwriting the slot before reading it.

A request holds at most one slot: a chunk that completes the request's tile and starts the next
one hands the slot to the new tile, whose tokens are written after the step's attention
(``late_tail_slot_mapping``: attention still reads the completed tile from the slot). A slot is
released when its tile commits, when the integration reports that its request left
(:meth:`TilePlanner.release_blocks`: vLLM's finished and preempted requests), when its block id
shows up as a full tile of any scheduled request (the block was recycled), and, when the pool runs
dry, least recently used first among the slots this step does not touch. With the departures
reported, the live slots never outnumber the requests that can run, so a pool of ``max_num_seqs``
slots never runs dry. A request that continues a tile whose slot is gone raises
:class:`TailLostError` instead of attending over garbage; that needs more partial tiles than
``num_slots`` outstanding at once, which only unreported departures allow.

A caller that gives every live request a stable index (vLLM's GPU model runner) plans with
:func:`plan_request_slots` instead: the request's slot is its index, nothing is claimed or
evicted, and no block id is read on the host.

Tails in blocks (``docs/tail_blocks.md``; vLLM's CPU engine with ``KVARN_TAIL_BLOCKS=1``): a
sequence's partial tile lives in the blocks after its own (:func:`tail_geometry` rows each), and
:meth:`PagedKV.gather_tails` / :meth:`PagedKV.scatter_tails` move it into and out of a step pool
of one slot per row around the step (at the places :func:`tail_rows` finds once a step), which is
then planned with :func:`plan_request_slots`.

Sink (optional, ``num_sink_slots > 0``): the tokens of a sequence's first tile also go to a
*sink slot*, keyed by the block id of that first tile, and attention reads the first tile from
the sink slot in full precision instead of from its record (the record is written all the same).
Requests whose first tiles share a block (a prefix-cache hit) share its sink.
:class:`SinkSlots` keeps the map; the planner sees every write, so the key stays true to the
block's contents (a caller of :func:`plan_request_slots`, which sees no block ids, drops the sinks
of blocks it hands out fresh itself: the vLLM backend on the GPU runner):

- a request that writes its first tile from offset 0 claims the block's sink slot (a new one, or
  the one the block had: it is overwritten before it is read);
- a request that continues or reads a first tile (``start > 0``) must find its sink; if it is
  gone, :class:`SinkLostError` is raised instead of reading another tile's values;
- a sink slot is freed when its block is written as any tile other than a first one (the block
  was recycled);
- when no slot is free, the least recently used sink whose block ``sink_pinned(block)`` reports
  unheld and that this step does not touch is evicted, and ``on_sink_evicted(block)`` is called
  (the vLLM backend drops the block from vLLM's prefix cache there, so no later request can hit a
  first tile whose sink is gone). Without ``sink_pinned`` nothing is evicted and a full pool
  raises :class:`SinkLostError` (the transformers cache: one slot per row, held for the batch's life).

Only committed tokens may be planned: speculative drafts would be frozen into a record.

Prefill. A request with many queries in one step (a prompt chunk) can attend through one varlen
attention call for all such requests of the step (:data:`VarlenAttention`: vLLM's flash attention
in the vLLM backend, :func:`sdpa_varlen` elsewhere) instead of through the paged kernel, whose
programs serve one query block at a time: :meth:`PagedKV.read_pages` reads the tiles before each
query's tile back as pages (the dequantize kernel) and builds one full-precision page per query
tile, and each query tile attends over its own page table. :func:`split_prefill` picks those
requests and :meth:`PagedKV.attend_split` runs both paths in one step. The semantics are
:meth:`PagedKV.attend`'s; only the order of the arithmetic differs.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvarn import ops
from kvarn.config import KVarNConfig


class TailLostError(RuntimeError):
    """A request continues a tile whose full-precision tail slot was recycled."""


class SinkLostError(RuntimeError):
    """A request continues or reads a first tile whose full-precision sink slot is gone, or none is free."""


@dataclass
class TilePlan:
    """Everything one step of one KV-cache group needs, as tensors on the model's device.

    Attributes:
        tail_slot_mapping: ``[T]`` int64, ``slot * G + offset`` of each token that goes to the
            tail pool, ``-1`` for tokens stored as whole tiles and for padding.
        commit_slots, commit_blocks: ``[Nc]`` int64, tail slots whose tile is full after this
            step and the blocks they are quantized into.
        store_token_idx: ``[Ns, G]`` int64, batch rows of the tokens of each whole tile.
        store_blocks: ``[Ns]`` int64, the block of each whole tile.
        tail_slots: ``[B]`` int64, each request's tail slot after the step (``0`` when its length
            is a multiple of ``G``: the slot is then not read).
        head_slots: ``[B]`` int64, the slot of the tile each request's step starts in (position
            ``seq_len - n``): it holds that tile's tokens before the step and the step's tail
            tokens of it, and keeps them until the step's attention has run (the own-tile rule,
            :func:`kvarn.reference.paged_attention`; ``0`` where the step stores that tile whole).
        sink_slot_mapping: ``[T]`` int64, ``slot * G + offset`` in the sink pool of each token of a
            first tile, ``-1`` elsewhere; ``None`` without a sink.
        sink_slots: ``[B]`` int64, each request's sink slot; ``None`` without a sink.
        slots_needed: one past the highest pool row the plan touches (a pool may grow lazily).
        late_tail_slot_mapping: ``[T]`` int64 or ``None``, tail tokens written after the step's
            attention (a chunk that completes its request's tile and starts another hands the
            slot to the new tile, and attention still reads the completed tile from it), ``-1``
            elsewhere.
        commit_first, store_first: ``[Nc]``, ``[Ns]`` int64, the block of the first tile of each
            committed / stored tile's request (its block table entry 0): where formats with one
            smoothing vector per sequence read it (``smooth_src`` of :func:`kvarn.ops.store_tiles`).
            ``None`` from planners that predate them is not accepted for such formats.
    """

    tail_slot_mapping: torch.Tensor
    commit_slots: torch.Tensor
    commit_blocks: torch.Tensor
    store_token_idx: torch.Tensor
    store_blocks: torch.Tensor
    tail_slots: torch.Tensor
    head_slots: torch.Tensor
    sink_slot_mapping: torch.Tensor | None = None
    sink_slots: torch.Tensor | None = None
    slots_needed: int = 0
    late_tail_slot_mapping: torch.Tensor | None = None
    commit_first: torch.Tensor | None = None
    store_first: torch.Tensor | None = None


class SinkSlots:
    """The full-precision sink slots of one KV-cache group: a first tile's block id -> pool row.

    Rows ``0 .. num_slots - 1`` of the pool (see the module docstring, "Sink"). Requests whose first
    tiles share a block share its sink. :meth:`assign` hands out one step's sinks (:meth:`read`
    serves a step whose rows all read existing sinks, e.g. decoding, without a Python loop over
    rows); the caller drops the sink of a block that comes back as anything but the same first
    tile (:meth:`drop`): the block-keyed planner sees that in its block table, vLLM's GPU runner
    says so in its scheduler output (fresh blocks). ``pinned(block)``: whether a request holds
    ``block`` (its sink may not be evicted); ``on_evicted(block)``: called when a sink is evicted
    (vLLM drops the block from its prefix cache). Without ``pinned`` nothing is evicted. Slots are
    kept in least-recently-used order; an eviction takes the oldest unheld one and moves the held
    ones it passes to the recent end (they are in use), so ``pinned`` is asked about each slot at
    most once per eviction and about few once the held ones have moved.
    """

    def __init__(
        self,
        num_slots: int,
        group_size: int,
        pinned: Callable[[int], bool] | None = None,
        on_evicted: Callable[[int], None] | None = None,
        stats: Counter[str] | None = None,
    ):
        if num_slots < 0:
            raise ValueError(f"num_sink_slots must be non-negative, got {num_slots}")
        self.num_slots = num_slots
        self.group_size = group_size
        self._slot_of: dict[int, int] = {}
        self._by_block = np.full(0, -1, dtype=np.int64)  # the same map as an array, for :meth:`read`
        self._block: list[int | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recently used first
        self._pinned = pinned
        self._on_evicted = on_evicted
        self.stats: Counter[str] = Counter() if stats is None else stats
        """``new_sinks`` (first tiles written from offset 0), ``recycled_sinks`` (dropped because the
        block was written as another tile), ``evicted_sinks`` (taken from an unheld block)."""

    @property
    def live(self) -> dict[int, int]:
        """A copy of the current ``first block id -> sink slot`` map."""
        return dict(self._slot_of)

    def drop(self, block: int) -> bool:
        """Free the sink of ``block`` (written as another tile now); returns whether it had one."""
        if not self._free_slot(block):
            return False
        self.stats["recycled_sinks"] += 1
        return True

    def _free_slot(self, block: int) -> bool:
        slot = self._slot_of.pop(block, None)
        if slot is None:
            return False
        self._by_block[block] = -1
        self._block[slot] = None
        self._free.append(slot)
        del self._lru[slot]
        return True

    def read(self, blocks: np.ndarray) -> np.ndarray | None:
        """The sink slots of ``blocks: [N]`` (first blocks of rows that only read their first tile,
        ``start >= G``), marked used; ``None`` if any has no sink (then :meth:`assign` raises)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self._by_block.shape[0]):
            return None
        slots = self._by_block[blocks]
        if (slots < 0).any():
            return None
        for slot in dict.fromkeys(slots.tolist()):
            self._lru.move_to_end(slot)
        return slots

    def assign(self, rows: list[tuple[int, int, int]], num_rows: int) -> list[int]:
        """One step's sinks: ``rows`` are ``(row, first block, start)`` for each row with tokens.

        Returns ``num_rows`` slots, ``-1`` for rows not in ``rows``. Rows that read an existing sink
        take it first (so it is not evicted for a claim), then rows that write their first tile
        from offset 0 claim one, then the remaining rows look theirs up: a prefix hit may read a
        first tile that another row of the same step writes (vLLM caches a block as soon as it
        schedules it, e.g. for the children of ``n > 1`` sampling), whatever the rows' order.
        Raises :class:`SinkLostError` if a row with ``start > 0`` finds no sink or no slot is free.
        """
        touched: set[int] = set()
        slots = [-1] * num_rows
        phases = (
            lambda block, start: start > 0 and block in self._slot_of,
            lambda block, start: start == 0,
            lambda block, start: True,
        )
        for wanted in phases:
            for r, block, start in rows:
                if slots[r] < 0 and wanted(block, start):
                    slots[r] = self._sink(block, start, touched)
        return slots

    def _sink(self, block: int, start: int, touched: set[int]) -> int:
        """The sink slot of the request whose first tile is ``block`` and whose step starts at ``start``."""
        slot = self._slot_of.get(block)
        if slot is not None:
            if start == 0:
                self.stats["new_sinks"] += 1
            touched.add(slot)
            self._lru.move_to_end(slot)
            return slot
        if start > 0:
            raise SinkLostError(
                f"the full-precision sink of block {block} (the first tile of a request, tokens "
                f"0..{min(start, self.group_size) - 1}) is not held: its slot was recycled or never filled; "
                "a request may not read a first tile without its sink"
            )
        if not self._free:
            victim = None
            if self._pinned is not None:
                # oldest first; a slot in use (held by a request, or used by this step) goes to the
                # end as used, so later evictions start at sinks nobody holds
                for _ in range(len(self._lru)):
                    slot = next(iter(self._lru))
                    if slot not in touched and not self._pinned(self._block[slot]):
                        victim = slot
                        break
                    self._lru.move_to_end(slot)
            if victim is None:
                raise SinkLostError(
                    f"all {self.num_slots} full-precision sink slots hold first tiles of live requests; "
                    "raise KVARN_SINK_SLOTS (at least --max-num-seqs) or lower --max-num-seqs"
                )
            evicted = self._block[victim]
            self._free_slot(evicted)
            self.stats["evicted_sinks"] += 1
            if self._on_evicted is not None:
                self._on_evicted(evicted)
        slot = self._free.pop()
        self._slot_of[block] = slot
        if block >= self._by_block.shape[0]:
            grown = np.full(max(2 * self._by_block.shape[0], block + 1, 1024), -1, dtype=np.int64)
            grown[: self._by_block.shape[0]] = self._by_block
            self._by_block = grown
        self._by_block[block] = slot
        self._block[slot] = block
        touched.add(slot)
        self._lru[slot] = None
        self.stats["new_sinks"] += 1
        return slot


class TilePlanner:
    """Hands out tail slots and plans the stores of each step (see the module docstring).

    One planner serves all layers of one KV-cache group: every layer of the group sees the same
    tokens in the same blocks, so the slot decisions are shared and each layer keeps its own
    pool tensors. Slots are numbered as pool rows: sink slots ``0 .. num_sink_slots - 1``, then
    the ``num_slots`` tail slots.
    """

    def __init__(
        self,
        num_slots: int,
        group_size: int,
        num_sink_slots: int = 0,
        sink_pinned: Callable[[int], bool] | None = None,
        on_sink_evicted: Callable[[int], None] | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        if num_sink_slots < 0:
            raise ValueError(f"num_sink_slots must be non-negative, got {num_sink_slots}")
        self.num_slots = num_slots
        self.num_sink_slots = num_sink_slots
        self.group_size = group_size
        self._slot_of: dict[int, int] = {}
        self._tail_range = range(num_sink_slots, num_sink_slots + num_slots)
        self._block_of: list[int | None] = [None] * (num_sink_slots + num_slots)
        self._last_used = [0] * (num_sink_slots + num_slots)
        self._free = list(reversed(self._tail_range))
        self._step = 0
        self.stats: Counter[str] = Counter()
        self.sinks = SinkSlots(num_sink_slots, group_size, sink_pinned, on_sink_evicted, self.stats)
        """Counts since creation: ``steps``, ``stored_tiles``, ``committed_tiles``, ``tail_tokens``,
        ``chunks_starting_inside_a_tile`` (a chunk of more than one token that continues a tile),
        ``recycled_tails`` (slots freed because their block came back as a full tile),
        ``released_tails`` (slots freed by :meth:`release_blocks`), ``evicted_tails`` (slots
        taken from an idle tail when the pool ran dry), and with a sink ``new_sinks`` (first tiles
        written from offset 0), ``recycled_sinks`` (freed because their block was written as another
        tile) and ``evicted_sinks`` (taken from an unheld block when the sink pool ran dry)."""

    @property
    def live_slots(self) -> dict[int, int]:
        """A copy of the current ``block id -> tail slot`` map."""
        return dict(self._slot_of)

    @property
    def live_sinks(self) -> dict[int, int]:
        """A copy of the current ``first block id -> sink slot`` map."""
        return self.sinks.live

    def _plan_sinks(self, qsl: list[int], lens: list[int], block_table: torch.Tensor) -> list[int]:
        """Each row's sink slot (``-1`` for rows without tokens), whatever the rows' order.

        First the sinks of blocks this step writes as later tiles are dropped (recycled blocks), then
        :meth:`SinkSlots.assign` hands out the rows' sinks.
        """
        g = self.group_size
        rows: list[tuple[int, int, int]] = []
        for r, length in enumerate(lens):
            start = length - (qsl[r + 1] - qsl[r])
            if start >= length or start < 0:  # no tokens (or an error the caller reports)
                continue
            row = block_table[r]
            for tile in range(max(1, start // g), (length - 1) // g + 1):
                self.sinks.drop(int(row[tile]))  # a block recycled as another tile
            rows.append((r, int(row[0]), start))
        return self.sinks.assign(rows, len(lens))

    def _release(self, slot: int) -> None:
        block = self._block_of[slot]
        if block is not None:
            del self._slot_of[block]
            self._block_of[slot] = None
            self._free.append(slot)

    def _claim(self, block: int, touched: set[int]) -> int:
        slot = self._slot_of.get(block)
        if slot is not None:
            return slot
        if not self._free:
            idle = [s for s in self._tail_range if s not in touched]
            if not idle:
                raise TailLostError(
                    f"more than {self.num_slots} incomplete tiles in one step; raise KVARN_TAIL_SLOTS "
                    "or lower --max-num-seqs"
                )
            self._release(min(idle, key=self._last_used.__getitem__))
            self.stats["evicted_tails"] += 1
        slot = self._free.pop()
        self._slot_of[block] = slot
        self._block_of[slot] = block
        return slot

    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_tokens: int,
        device: torch.device | str = "cpu",
    ) -> TilePlan:
        """Plan one step.

        Args:
            query_start_loc: ``[B + 1]`` int (CPU), offsets of each request's new tokens.
            seq_lens: ``[B]`` int (CPU), tokens of each request after the step, new ones included.
            block_table: ``[B, max_blocks]`` int (CPU), block of each tile of each request.
            num_tokens: rows of the step's key/value tensors (``>= query_start_loc[-1]``).
            device: where the plan's tensors go.
        """
        g = self.group_size
        self._step += 1
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        batch = len(lens)
        mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        late_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        reused: set[int] = set()
        sink = self.num_sink_slots > 0
        sink_mapping = torch.full((num_tokens,), -1, dtype=torch.int64) if sink else None
        sink_slots = [-1] * batch
        tail_slots = [0] * batch
        head_slots = [0] * batch
        commits: list[tuple[int, int]] = []
        stores: list[tuple[int, int]] = []
        commit_first: list[int] = []
        store_first: list[int] = []
        touched: set[int] = set()
        full_rows: list[torch.Tensor] = []
        if sink:
            sink_slots = self._plan_sinks(qsl, lens, block_table)
        for r in range(batch):
            n = qsl[r + 1] - qsl[r]
            length = lens[r]
            if n <= 0:
                continue
            start = length - n
            if start < 0:
                raise ValueError(f"request {r} has {n} new tokens but a length of {length}")
            if n > 1 and start % g:
                self.stats["chunks_starting_inside_a_tile"] += 1
            row = block_table[r]
            full_rows.append(row[: length // g])
            if sink:
                sink_slot = sink_slots[r]
                if start < g:
                    hi = min(length, g)
                    sink_mapping[qsl[r] : qsl[r] + hi - start] = torch.arange(sink_slot * g + start, sink_slot * g + hi)
            committing = None  # the slot of this request's tile that commits in this step
            for tile in range(start // g, (length - 1) // g + 1):
                lo, hi = max(start, tile * g), min(length, (tile + 1) * g)
                block = int(row[tile])
                first = qsl[r] + lo - start
                if lo == tile * g and hi == (tile + 1) * g:
                    stores.append((first, block))
                    store_first.append(int(row[0]))
                    continue
                if lo > tile * g and block not in self._slot_of:
                    raise TailLostError(
                        f"the full-precision tail of block {block} (tokens {tile * g}..{lo - 1} of a "
                        f"running request) was recycled; raise KVARN_TAIL_SLOTS (now {self.num_slots})"
                    )
                target = mapping
                if committing is not None and block not in self._slot_of:
                    # the chunk completed the request's previous tile and starts this one: the slot
                    # passes to this tile, written after attention (one slot per request at most)
                    slot, target = committing, late_mapping
                    del self._slot_of[self._block_of[slot]]
                    self._slot_of[block] = slot
                    self._block_of[slot] = block
                    reused.add(slot)
                else:
                    slot = self._claim(block, touched)
                touched.add(slot)
                self._last_used[slot] = self._step
                if tile == start // g:
                    head_slots[r] = slot
                target[first : first + hi - lo] = torch.arange(slot * g + lo - tile * g, slot * g + hi - tile * g)
                if hi == (tile + 1) * g:
                    commits.append((slot, block))
                    commit_first.append(int(row[0]))
                    committing = slot
                else:
                    tail_slots[r] = slot
        committed = {slot for slot, _ in commits}
        if full_rows and self._slot_of:
            full = torch.cat(full_rows).tolist()
            for block in set(full).intersection(self._slot_of):
                if self._slot_of[block] not in touched:
                    self._release(self._slot_of[block])
                    self.stats["recycled_tails"] += 1
        for slot in committed - reused:
            self._release(slot)
        self.stats["steps"] += 1
        self.stats["stored_tiles"] += len(stores)
        self.stats["committed_tiles"] += len(commits)
        self.stats["tail_tokens"] += int((mapping >= 0).sum()) + int((late_mapping >= 0).sum())
        used = [s for s, _ in commits] + [s for r, s in enumerate(tail_slots) if lens[r] % g] + sink_slots

        def tensor(values, shape=(-1,)):
            return torch.tensor(values, dtype=torch.int64).reshape(shape).to(device)

        store_idx = torch.tensor([first for first, _ in stores], dtype=torch.int64)
        store_idx = store_idx[:, None] + torch.arange(g)[None, :]
        return TilePlan(
            tail_slot_mapping=mapping.to(device),
            commit_slots=tensor([s for s, _ in commits]),
            commit_blocks=tensor([b for _, b in commits]),
            store_token_idx=store_idx.to(device),
            store_blocks=tensor([b for _, b in stores]),
            tail_slots=tensor(tail_slots),
            head_slots=tensor(head_slots),
            sink_slot_mapping=sink_mapping.to(device) if sink else None,
            sink_slots=tensor(sink_slots) if sink else None,
            slots_needed=max(used, default=-1) + 1,
            late_tail_slot_mapping=late_mapping.to(device) if reused else None,
            commit_first=tensor(commit_first),
            store_first=tensor(store_first),
        )

    def release_blocks(self, blocks) -> int:
        """Free the tail slots keyed by any of ``blocks`` (the blocks of a finished or preempted request).

        The integration calls it when a request leaves (vLLM: the runner's finished and preempted
        request ids, before the step that may hand their blocks to others is planned), so a pool of
        one slot per request that can run is never exhausted. Returns how many slots were freed.
        """
        freed = 0
        for block in blocks:
            slot = self._slot_of.get(int(block))
            if slot is not None:
                self._release(slot)
                freed += 1
        self.stats["released_tails"] += freed
        return freed


@dataclass
class PagedKV:
    """The KVarN storage of one attention layer, and the ops that carry a :class:`TilePlan` out.

    Attributes:
        cfg: the format (its ``head_dim`` is the layer's).
        cache: ``[num_blocks, Hkv, record_bytes]`` uint8, one record per (full tile, KV head).
        tail_k, tail_v: ``[slots, G, Hkv, D]`` in the store dtype, the full-precision pool in the
            rotated frame and the pool form (an fp16 pool holds the values times ``2^-POOL_EXP``,
            :func:`kvarn.reference.pool_exponent`; read it with :func:`kvarn.ops.from_pool`):
            ``num_sink_slots`` sink slots first, then the tail slots (the planner's numbering).
        num_sink_slots: how many slots at the start of the pool hold sinks.
        impl: ``"auto" | "reference" | "triton"``, passed to every :mod:`kvarn.ops` call.
    """

    cfg: KVarNConfig
    cache: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    num_sink_slots: int = 0
    impl: str = "auto"
    late_pending: TilePlan | None = field(default=None, repr=False)
    """A plan :meth:`store` carried out whose late tail tokens :meth:`write_late_tail` has not written yet."""

    @classmethod
    def allocate(
        cls,
        cfg: KVarNConfig,
        num_blocks: int,
        num_heads: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        num_sink_slots: int = 0,
        impl: str = "auto",
    ) -> PagedKV:
        """Zeroed storage: ``num_blocks`` records and ``num_slots + num_sink_slots`` pool tiles."""
        pool = (num_sink_slots + num_slots, cfg.group_size, num_heads, cfg.head_dim)
        cache = torch.zeros(num_blocks, num_heads, cfg.record_bytes, dtype=torch.uint8, device=device)
        tail_k = torch.zeros(pool, dtype=dtype, device=device)
        return cls(cfg, cache, tail_k, torch.zeros_like(tail_k), num_sink_slots, impl)

    @property
    def num_slots(self) -> int:
        """Tail slots (the pool less its sink slots)."""
        return self.tail_k.shape[0] - self.num_sink_slots

    def grow_pool(self, slots: int) -> None:
        """Make the pool at least ``slots`` rows long (new rows zeroed), keeping what it holds."""
        have = self.tail_k.shape[0]
        if slots > have:
            extra = self.tail_k.new_zeros(slots - have, *self.tail_k.shape[1:])
            self.tail_k = torch.cat([self.tail_k, extra])
            self.tail_v = torch.cat([self.tail_v, extra])

    def grow_blocks(self, num_blocks: int) -> None:
        """Make the cache at least ``num_blocks`` records long (new records zeroed); block ids stay."""
        have = self.cache.shape[0]
        if num_blocks > have:
            self.cache = torch.cat([self.cache, self.cache.new_zeros(num_blocks - have, *self.cache.shape[1:])])

    def overflows(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether storing ``k, v: [T, Hkv, D]`` (before any cast to the pool dtype) saturates the pool.

        An fp16 pool holds rotated values up to ``2^POOL_EXP`` (``>= sqrt(D)``) times 65504
        (:func:`kvarn.reference.pool_exponent`), and no rotated element exceeds its token's L2
        norm (the rotation is orthonormal): fp16 K/V never saturate it. Wider K/V (an fp32 or
        bf16 model storing in fp16) may, through a value past 65504 (the cast) or a token whose
        norm is past the pool form's range. bf16 and fp32 pools hold any finite input (``prepare``
        saturates at ``2^24`` first). One reduction and one host sync; for callers that can afford
        it (the transformers cache), not for a captured step.
        """
        pool = self.tail_k.dtype
        if not k.numel() or pool != torch.float16 or (k.dtype == pool and v.dtype == pool):
            return False
        finite = torch.finfo(pool).max
        amax = torch.maximum(k.abs().amax(), v.abs().amax()).float()
        if not self.cfg.rotate:
            return bool(amax > finite)
        limit = finite * 2.0 ** ops.pool_exponent(pool, self.cfg.head_dim)
        norm = torch.maximum(k.float().norm(dim=-1).amax(), v.float().norm(dim=-1).amax())
        return bool((amax > finite) | (norm > limit))

    def store(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one step's ``k, v: [T, Hkv, D]`` (model frame) as ``plan`` says, in place, before attention.

        Tail (and sink) tokens first, then the tiles they complete, then the step's whole tiles:
        :meth:`write_tail`, :meth:`commit`, :meth:`store_whole`. The tokens of a tile that the step
        starts in a slot it takes over (:meth:`write_late_tail`) go in after the step's attention;
        the next :meth:`store` raises if they were not written.
        """
        if self.late_pending is not None:
            raise RuntimeError(
                "PagedKV.store: the previous step's late tail tokens were never written; call "
                "write_late_tail(plan, k, v) after each step's attention"
            )
        self.write_tail(plan, k, v)
        self.commit(plan)
        self.store_whole(plan, k, v)
        if plan.late_tail_slot_mapping is not None:
            self.late_pending = plan

    def write_tail(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """The plan's tail (and sink) tokens of ``k, v: [T, Hkv, D]`` into the pool (negative entries skip)."""
        cfg, impl = self.cfg, self.impl
        if plan.slots_needed > self.tail_k.shape[0]:
            raise ValueError(f"the plan uses {plan.slots_needed} pool slots, this pool has {self.tail_k.shape[0]}")
        ops.write_tail(k, v, self.tail_k, self.tail_v, plan.tail_slot_mapping, cfg, impl=impl)
        if plan.sink_slot_mapping is not None:
            ops.write_tail(k, v, self.tail_k, self.tail_v, plan.sink_slot_mapping, cfg, impl=impl)

    def write_late_tail(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """The plan's tail tokens that go in after the step's attention (a slot handed to the next tile).

        Attention still reads the completed tile from the slot (:attr:`TilePlan.head_slots`);
        call this once the step's attention (every layer's own) has run, before the next step.
        """
        if plan.late_tail_slot_mapping is not None:
            ops.write_tail(k, v, self.tail_k, self.tail_v, plan.late_tail_slot_mapping, self.cfg, impl=self.impl)
        if self.late_pending is plan:
            self.late_pending = None

    def _first_blocks(self, first: torch.Tensor | None) -> torch.Tensor | None:
        """``smooth_src`` for the store ops: the plan's first blocks for per-sequence smoothing, else None."""
        if not self.cfg.seq_smooth:
            return None
        if first is None:
            raise ValueError(f"{self.cfg.name} with smooth_scope='sequence' needs a plan with commit_first/store_first")
        return first

    def commit(self, plan: TilePlan) -> None:
        """Quantize the pool tiles that are full after this step into their blocks."""
        src = self._first_blocks(plan.commit_first)
        ops.commit_tiles(
            self.tail_k, self.tail_v, plan.commit_slots, plan.commit_blocks, self.cache, self.cfg, src, impl=self.impl
        )

    def store_whole(self, plan: TilePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize the step's whole tiles straight from ``k, v: [T, Hkv, D]``."""
        cfg = self.cfg
        if plan.store_blocks.numel():
            idx = plan.store_token_idx.reshape(-1)
            shape = (plan.store_blocks.numel(), cfg.group_size, *k.shape[1:])
            src = self._first_blocks(plan.store_first)
            ops.store_tiles(
                k[idx].view(shape), v[idx].view(shape), plan.store_blocks, self.cache, cfg, src, impl=self.impl
            )

    def attend(
        self,
        plan: TilePlan,
        query: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None,
        scale: float | None = None,
        out: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        tails: BlockTails | None = None,
    ) -> torch.Tensor:
        """Attention of one step's ``query: [T, Hq, D]`` after :meth:`store` -> ``[T, Hq, D]`` (``out`` if given).

        Each request's tokens attend causally over its first ``seq_lens`` tokens under the own-tile
        rule: the tiles before a query's own from the records (the first from its sink slot, with a
        sink), its own tile from the step's head slot and ``key, value: [T, Hkv, D]`` (the step's
        K/V as stored; needed where a request's queries span tiles, e.g. a prompt chunk). With
        ``tails`` (a decode step, tails in the cache's blocks: :func:`block_tails`) the own tiles are
        read from their blocks instead of the head slots.
        """
        pool_k, pool_v, own = self.tail_k, self.tail_v, plan.head_slots
        if tails is not None:
            (pool_k, pool_v), own = self.tail_block_view(tails.rows_per_block), tails.tables
        return ops.paged_attention(
            query,
            self.cache,
            block_table,
            seq_lens,
            pool_k,
            pool_v,
            own,
            self.cfg,
            query_start_loc,
            plan.sink_slots,
            scale,
            key,
            value,
            out=out,
            impl=self.impl,
        )

    def read_pages(
        self,
        plan: TilePlan,
        block_table: torch.Tensor,
        layout: PageLayout,
        key: torch.Tensor,
        value: torch.Tensor,
        dtype: torch.dtype,
    ) -> PagedChunks:
        """The K/V that the prompt chunks of ``layout`` attend over, as pages of ``G`` tokens, model frame, ``dtype``.

        Per request, the tiles before its last query's tile are dequantized into one page each (a
        sink tile read from its slot), and each tile holding queries gets a full-precision page:
        the tile's tokens before the step from the head slot, the step's from ``key, value:
        [T, Hkv, D]`` through the pool form (the values a tail slot would hold). Batched over all
        requests, three launches (:func:`kvarn.ops.write_record_pages`, then
        :func:`kvarn.ops.write_row_pages` for the head slots' tokens and for the step's), each
        writing its rows straight into the pages (:mod:`kvarn.reference.pages` states the values).

        Every page element is written once: the record pages whole, and of each query tile's page
        its rows before ``seqused_k`` (head slot and step tokens) and, as zeros, the rows past it
        (only the last query tile of a request has any; the attention never reads them, and zeros
        keep a ``0 * garbage`` product of a masked key finite). Those padding rows are found on the
        host once per layout and kept with its device index arrays.
        """
        cfg, g = self.cfg, self.cfg.group_size
        heads, d = self.cache.shape[1], cfg.head_dim
        dev = self.cache.device
        ix = layout.on(dev)
        pages = [torch.empty(layout.num_pages, g, heads, d, dtype=dtype, device=dev) for _ in range(2)]
        if ix["rec_row"].shape[0]:
            ops.write_record_pages(
                self.cache,
                block_table,
                ix["rec_row"],
                ix["rec_tile"],
                *pages,
                cfg,
                self.tail_k,
                self.tail_v,
                plan.sink_slots,
                impl=self.impl,
            )
        if ix["held_dst"].shape[0]:
            slots = plan.head_slots[ix["held_rows"]]
            ops.write_row_pages(
                self.tail_k, self.tail_v, ix["held_src"], ix["held_dst"], *pages, cfg, False, slots, impl=self.impl
            )
        ops.write_row_pages(
            key, value, ix["step_rows"], ix["step_dst"], *pages, cfg, True, None, self.tail_k.dtype, impl=self.impl
        )
        table, cu_q, used = ix["block_table"], ix["cu_q"], ix["seqused_k"]
        return PagedChunks(pages[0], pages[1], layout.cu_q, layout.seqused_k, table, cu_q, used)

    def attend_split(
        self,
        plan: TilePlan,
        query: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        split: PrefillSplit,
        scale: float | None = None,
        varlen: VarlenAttention | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attend` for a step that :func:`split_prefill` split. ``query: [T, Hq, D]`` -> ``[T, Hq, D]``.

        The prefill requests attend over :meth:`read_pages` in one ``varlen`` call per group of
        at most :data:`PREFILL_READ_TOKENS` tokens (default :func:`sdpa_varlen`; the vLLM backend
        passes flash attention); the other requests go through the paged kernel.
        ``key, value: [T, Hkv, D]``: the step's K/V, as for :meth:`attend`.
        """
        if key is None or value is None:
            raise ValueError("attend_split needs the step's key and value (the prompt chunks' own tiles)")
        out = torch.empty_like(query)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if split.rest_rows is not None:
            rows, tokens = split.rest_rows, split.rest_tokens
            sinks = None if plan.sink_slots is None else plan.sink_slots[rows]
            out[tokens] = ops.paged_attention(
                query[tokens],
                self.cache,
                block_table[rows],
                seq_lens[rows],
                self.tail_k,
                self.tail_v,
                plan.head_slots[rows],
                self.cfg,
                split.rest_query_start_loc,
                sinks,
                scale,
                key[tokens],
                value[tokens],
                impl=self.impl,
            ).to(out.dtype)
        groups, size = [[]], 0
        for item in split.rows:  # bounded read-back: at most PREFILL_READ_TOKENS tokens per group
            if groups[-1] and size + item[3] > PREFILL_READ_TOKENS:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += item[3]
        for group in groups:
            rows = tuple(group)
            if rows not in split.layouts:  # the same for every layer of the step
                split.layouts[rows] = PageLayout.of(group, self.cfg.group_size)
            chunks = self.read_pages(plan, block_table, split.layouts[rows], key, value, query.dtype)
            spans = [(first, end) for _, first, end, _ in group]
            contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            q = query[spans[0][0] : spans[-1][1]] if contiguous else torch.cat([query[a:b] for a, b in spans])
            att = (varlen or sdpa_varlen)(q, chunks, scale)
            if contiguous:
                out[spans[0][0] : spans[-1][1]] = att
            else:
                done = 0
                for a, b in spans:
                    out[a:b] = att[done : done + b - a]
                    done += b - a
        return out

    def read_tiles(self, blocks: torch.Tensor, sink_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Full tiles read back in the model frame: ``blocks: [B, n]`` -> ``k, v: [B, n * G, Hkv, D]`` fp32.

        With ``sink_slots: [B]`` (pool indices, ``-1`` for none), tile 0 of each row with a sink
        comes from its sink slot in full precision instead of its record.
        """
        batch, n = blocks.shape
        cfg = self.cfg
        k, v = ops.decode_records(self.cache[blocks.reshape(-1).long()], cfg, impl=self.impl)  # [B*n, Hkv, G, D]
        heads = self.cache.shape[1]
        k = k.view(batch, n, *k.shape[1:]).transpose(2, 3).reshape(batch, n * cfg.group_size, heads, cfg.head_dim)
        v = v.view(batch, n, *v.shape[1:]).transpose(2, 3).reshape(batch, n * cfg.group_size, heads, cfg.head_dim)
        if sink_slots is not None and n > 0:
            rows = (sink_slots >= 0).nonzero().flatten()
            if rows.numel():
                slots = sink_slots[rows].long()
                k[rows, : cfg.group_size] = ops.from_pool(self.tail_k[slots])
                v[rows, : cfg.group_size] = ops.from_pool(self.tail_v[slots])
        return self.to_model_frame(k), self.to_model_frame(v)

    def read_tail(self, slots: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` tokens of pool slots ``slots: [B]`` in the model frame: ``[B, count, Hkv, D]`` fp32."""
        idx = slots.long()
        k = ops.from_pool(self.tail_k[idx, :count])
        v = ops.from_pool(self.tail_v[idx, :count])
        return self.to_model_frame(k), self.to_model_frame(v)

    def tail_block_view(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The records' bytes as tail rows (``docs/tail_blocks.md``): ``k, v: [num_blocks, rows, Hkv, D]``.

        Strided views of :attr:`cache` in the pool dtype: row ``r`` of block ``b`` and KV head ``h``
        holds one tail token's K then V (pool form) at bytes ``r * 2 D e ..`` of that head's record
        (``rows`` from :func:`tail_geometry`). Writing them writes the cache.
        """
        d, dtype = self.cfg.head_dim, self.tail_k.dtype
        num_blocks, heads, record = self.cache.shape
        width = rows * 2 * d * dtype.itemsize
        if width > record or record % dtype.itemsize:
            raise ValueError(f"{rows} tail rows of head_dim {d} in {dtype} do not fit a {record}-byte record")
        x = self.cache[:, :, :width].view(dtype).view(num_blocks, heads, rows, 2, d).permute(0, 2, 1, 3, 4)
        return x[..., 0, :], x[..., 1, :]

    def gather_tails(self, where: TailRows) -> None:
        """Before a step: each sequence's partial-tile tokens from its tail blocks into its pool slot at their
        offsets (``where``: :func:`tail_rows` of the lengths before the step; see :meth:`tail_block_view`)."""
        view_k, view_v = self.tail_block_view(where.rows_per_block)
        self.tail_k[where.slot, where.offset] = view_k[where.block, where.row]
        self.tail_v[where.slot, where.offset] = view_v[where.block, where.row]

    def scatter_tails(self, where: TailRows) -> None:
        """After a step (its late tail written): :meth:`gather_tails` backwards (``where`` for the lengths
        after the step). Writes only rows of the blocks after each sequence's partial tile: never a record."""
        view_k, view_v = self.tail_block_view(where.rows_per_block)
        view_k[where.block, where.row] = self.tail_k[where.slot, where.offset]
        view_v[where.block, where.row] = self.tail_v[where.slot, where.offset]

    def write_block_tails(self, tails: BlockTails, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode step's tokens ``k, v: [B, Hkv, D]`` straight into their rows of the cache's blocks
        (:func:`block_tails`; no step pool)."""
        view_k, view_v = self.tail_block_view(tails.rows_per_block)
        ops.write_tail(k, v, view_k, view_v, tails.mapping, self.cfg, impl=self.impl)

    def commit_block_tails(self, plan: TilePlan, tails: BlockTails) -> None:
        """Commit the tiles a decode step filled when they are kept in the cache's blocks: each committing
        row's tile is copied from its blocks into its step-pool slot, then committed from there.

        ``plan.commit_slots`` index ``tails.tables`` as well as the pool: the plan must be
        :func:`plan_request_slots`' with slot ``b`` for row ``b`` (``arange`` slots, no sink slots), as the
        vLLM builder makes it; other slot lists would copy another row's tile.
        """
        view_k, view_v = self.tail_block_view(tails.rows_per_block)
        ops.gather_tail_tiles(view_k, view_v, tails.tables, self.tail_k, self.tail_v, plan.commit_slots, impl=self.impl)
        self.commit(plan)

    def to_model_frame(self, x: torch.Tensor) -> torch.Tensor:
        """Rotated-frame ``x: [..., D]`` back to the model frame (the rotation is its own inverse)."""
        return ops.rotate(x, impl=self.impl) if self.cfg.rotate else x

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``records``, ``tail`` (tail slots) and ``sink`` (sink slots)."""
        per_slot = 2 * self.tail_k[:1].numel() * self.tail_k.element_size()
        return {
            "records": self.cache.numel(),
            "tail": per_slot * self.num_slots,
            "sink": per_slot * self.num_sink_slots,
        }


PREFILL_MIN_QUERIES = 64
"""A request with at least this many queries in a step attends through :meth:`PagedKV.attend_split`."""

PREFILL_READ_TOKENS = 65536
"""Most tokens :meth:`PagedKV.attend_split` reads back for one varlen call (its pages, in the attention
dtype, scale with it; a single longer request is read alone)."""


@dataclass
class PagedChunks:
    """Prompt chunks' keys and values as pages, one attention sequence per query tile (:meth:`PagedKV.read_pages`).

    Attributes:
        k, v: ``[pages, G, Hkv, D]`` model frame.
        cu_q: ``[S + 1]`` host ints: query tile ``i``'s queries are rows ``cu_q[i] .. cu_q[i + 1]``
            of the packed queries.
        seqused_k: ``[S]`` host ints: its keys are the first ``seqused_k[i]`` tokens of its pages.
        block_table: ``[S, W]`` int32: its pages, in position order (entries past
            ``ceil(seqused_k[i] / G)`` are padding).
        cu_q_t, seqused_k_t: ``cu_q`` and ``seqused_k`` as int32 tensors on the pages' device.
    Queries sit at the end of their keys (causal, aligned bottom right).
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_q: list[int]
    seqused_k: list[int]
    block_table: torch.Tensor
    cu_q_t: torch.Tensor | None = None
    seqused_k_t: torch.Tensor | None = None


VarlenAttention = Callable[[torch.Tensor, PagedChunks, float], torch.Tensor]
"""``(q: [Tq, Hq, D], chunks, scale) -> [Tq, Hq, D]``: causal attention of each query tile of
:class:`PagedChunks` over its pages (queries aligned to the end of their keys, GQA heads grouped)."""


def sdpa_varlen(q: torch.Tensor, chunks: PagedChunks, scale: float) -> torch.Tensor:
    """:data:`VarlenAttention` by one ``scaled_dot_product_attention`` call per query tile (any device).

    The pages gathered per query tile, an explicit end-aligned causal mask, the KV heads repeated for GQA.
    """
    out = torch.empty_like(q)
    g, hkv, d = chunks.k.shape[1:]
    group = q.shape[1] // hkv
    table = chunks.block_table.long()
    for i, ((qa, qb), used) in enumerate(zip(itertools.pairwise(chunks.cu_q), chunks.seqused_k, strict=True)):
        n = qb - qa
        ids = table[i, : -(-used // g)]
        keys = chunks.k[ids].reshape(-1, hkv, d)[:used].transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
        vals = chunks.v[ids].reshape(-1, hkv, d)[:used].transpose(0, 1).repeat_interleave(group, 0)
        visible = torch.ones(n, used, dtype=torch.bool, device=q.device).tril(used - n)
        att = torch.nn.functional.scaled_dot_product_attention(
            q[qa:qb].transpose(0, 1)[None], keys[None], vals[None], attn_mask=visible, scale=scale
        )
        out[qa:qb] = att[0].transpose(0, 1)
    return out


@dataclass
class PrefillSplit:
    """A step's requests split by :func:`split_prefill`.

    Attributes:
        rows: ``(row, first, end, seq_len)`` per prefill request: its index in the batch, its
            query tokens ``first .. end`` and its length after the step (host ints).
        rest_rows: ``[Br]`` int64, the other requests (``None`` if there are none);
            ``rest_tokens: [Tr]`` int64 their query tokens; ``rest_query_start_loc: [Br + 1]``
            their queries' offsets within ``rest_tokens``.
        layouts: the :class:`PageLayout` of each group of prefill rows (keyed by the rows), made
            by the step's first layer and reused by the others.
    """

    rows: list[tuple[int, int, int, int]]
    rest_rows: torch.Tensor | None = None
    rest_tokens: torch.Tensor | None = None
    rest_query_start_loc: torch.Tensor | None = None
    layouts: dict[tuple, PageLayout] = field(default_factory=dict)


@dataclass
class PageLayout:
    """Where :meth:`PagedKV.read_pages` puts each prompt chunk's K/V: host index arrays, the same for every layer.

    Made once per step (:meth:`of`) and moved to the device once (:meth:`on`). Record pages come
    first (request by request, its tiles before its last query's tile), then one full-precision
    page per query tile.
    """

    num_pages: int
    cu_q: list[int]
    seqused_k: list[int]
    arrays: dict[str, np.ndarray]
    sink_pages: np.ndarray
    _device: dict = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, int]], g: int) -> PageLayout:
        """The layout of :attr:`PrefillSplit.rows` entries ``(row, first, end, seq_len)`` for tiles of ``g``."""
        r, first, end, lens = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
        start = lens - (end - first)
        own, last = start // g, (lens - 1) // g  # tiles of each request's first and last query
        n_exact = last - own + 1
        rec_base = np.concatenate([[0], np.cumsum(last)[:-1]])
        exact_base = int(last.sum()) + np.concatenate([[0], np.cumsum(n_exact)[:-1]])
        req = np.repeat(np.arange(len(rows)), last)
        pre = start - own * g  # the first query tile's tokens before the step: in the head slot
        has = np.flatnonzero(pre)
        # one attention sequence per query tile
        qreq = np.repeat(np.arange(len(rows)), n_exact)
        qtile = own[qreq] + np.arange(len(qreq)) - np.repeat(np.cumsum(n_exact) - n_exact, n_exact)
        lo = np.maximum(start[qreq], qtile * g)
        hi = np.minimum(lens[qreq], (qtile + 1) * g)
        width = int(qtile.max()) + 1
        cols = np.arange(width)[None, :]
        table = np.where(cols < qtile[:, None], rec_base[qreq][:, None] + cols, 0)
        table[np.arange(len(qreq)), qtile] = exact_base[qreq] + qtile - own[qreq]
        tokens = np.concatenate([np.arange(f, e) for f, e in zip(first, end, strict=True)])
        token_dst = np.concatenate([exact_base[i] * g + pre[i] + np.arange(end[i] - first[i]) for i in range(len(r))])
        with_rec = np.flatnonzero(last > 0)
        # the rows of each query tile's own page past its last key (only a request's last query tile
        # has any): written as zeros, after the step's tokens (source row -1)
        row_in_page = np.arange(g)
        own_page = table[np.arange(len(qreq)), qtile] * g
        pad = (own_page[:, None] + row_in_page)[row_in_page[None, :] >= (hi - qtile * g)[:, None]]
        arrays = {
            "rec_row": r[req],
            "rec_tile": np.arange(len(req)) - np.repeat(rec_base, last),
            "sink_rows": r[with_rec],
            "sink_pages": rec_base[with_rec],
            "held_rows": r[has],
            "held_src": np.concatenate([[0], *(k * g + np.arange(pre[i]) for k, i in enumerate(has))])[1:],
            "held_dst": np.concatenate([[0], *(exact_base[i] * g + np.arange(pre[i]) for i in has)])[1:],
            "step_rows": np.concatenate([tokens, np.full(pad.size, -1)]),
            "step_dst": np.concatenate([token_dst, pad]),
            "block_table": table,
        }
        cu_q = np.concatenate([[0], np.cumsum(hi - lo)]).tolist()
        return cls(int(exact_base[-1] + n_exact[-1]), cu_q, hi.tolist(), arrays, rec_base[with_rec])

    def on(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The index arrays as int64 tensors on ``device`` (one copy, made once), plus ``block_table``,
        ``cu_q`` and ``seqused_k`` in int32 (the varlen attention's argument types)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self._device:
            host = dict(self.arrays, cu_q=np.array(self.cu_q), seqused_k=np.array(self.seqused_k))
            parts = to_device_aligned(list(host.values()), device)
            ix = {k: t.view(a.shape) for (k, a), t in zip(host.items(), parts, strict=True)}
            for k in ("block_table", "cu_q", "seqused_k"):
                ix[k] = ix[k].to(torch.int32)
            self._device[key] = ix
        return self._device[key]


def to_device_aligned(parts: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """The integer host arrays ``parts`` as flat int64 tensors on ``device``, from one staging copy (pinned,
    not waiting for the device, on CUDA), each starting on a 16-byte boundary.

    Triton compiles a kernel once per 16-byte alignment class of each pointer argument: views packed
    end to end would start at offsets that change with a step's sizes, and vLLM's steps would compile
    new variants while serving (measured, session 19: two ``_row_pages_kernel`` compiles inside a
    capacity run, after the serving steps had been rehearsed). Each part is padded to an even length.
    """
    device = torch.device(device)
    sizes = [int(np.size(a)) for a in parts]
    padded = [n + n % 2 for n in sizes]  # int64: two elements make 16 bytes
    flat = np.zeros(sum(padded), dtype=np.int64)
    start = 0
    for a, n, w in zip(parts, sizes, padded, strict=True):
        flat[start : start + n] = np.asarray(a).reshape(-1)
        start += w
    staged = torch.from_numpy(flat)
    if device.type == "cuda":
        staged = staged.pin_memory()
    if device.type != "cpu":
        staged = staged.to(device, non_blocking=True)
    return [t[:n] for t, n in zip(torch.split(staged, padded), sizes, strict=True)]


def split_prefill(
    query_start_loc, seq_lens, device: torch.device | str, min_queries: int = PREFILL_MIN_QUERIES
) -> PrefillSplit | None:
    """Requests with at least ``min_queries`` queries in this step, or ``None`` if there are none.

    ``query_start_loc: [B + 1]`` and ``seq_lens: [B]`` are host arrays (exact lengths).
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    counts = np.diff(qsl)
    dense = counts >= min_queries
    if not dense.any():
        return None
    rows = [(int(b), int(qsl[b]), int(qsl[b + 1]), int(lens[b])) for b in np.flatnonzero(dense)]
    rest = np.flatnonzero(~dense)
    if not rest.size:
        return PrefillSplit(rows)
    tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in rest])
    offsets = np.concatenate([[0], np.cumsum(counts[rest])])
    return PrefillSplit(
        rows,
        torch.from_numpy(rest).to(device),
        torch.from_numpy(tokens).to(device),
        torch.from_numpy(offsets.astype(np.int32)).to(device),
    )


def tail_geometry(cfg: KVarNConfig, pool_itemsize: int = 2) -> tuple[int, int]:
    """``(rows_per_block, tail_blocks)``: the tail tokens one block's page holds and the blocks a tail takes.

    A page holds one record per KV head, ``cfg.record_bytes`` each; a tail token of one KV head takes
    its K and V rows in the pool form, ``2 * head_dim * pool_itemsize`` bytes. A tail holds up to a
    whole tile (``group_size`` tokens: the own-tile rule keeps a completed tile in full precision until
    attention has read it). At k4v2_g128, head_dim 128, 16-bit pools: 27 rows a block, 5 blocks.

    The layout of tails in vLLM's blocks (``docs/tail_blocks.md``, used by
    :mod:`kvarn.integration.vllm.tail_blocks`): :meth:`PagedKV.tail_block_view` reads a cache's records
    as such rows, :func:`tail_rows` and :func:`block_tails` find a step's.
    """
    rows = cfg.record_bytes // (2 * cfg.head_dim * pool_itemsize)
    if rows < 1:
        raise ValueError(
            f"a {cfg.record_bytes}-byte record holds no {pool_itemsize}-byte tail token of head_dim {cfg.head_dim}"
        )
    return rows, math.ceil(cfg.group_size / rows)


@dataclass(frozen=True)
class TailRows:
    """Where a step's partial tiles live, one entry per token (:func:`tail_rows`): pool ``(slot, offset)``
    and tail-block ``(block, row)``, ``rows_per_block`` rows a block."""

    slot: torch.Tensor
    offset: torch.Tensor
    block: torch.Tensor
    row: torch.Tensor
    rows_per_block: int


def tail_rows(
    block_table: torch.Tensor,
    lens: torch.Tensor,
    slots: torch.Tensor,
    group_size: int,
    rows_per_block: int,
    since: torch.Tensor | None = None,
) -> TailRows:
    """The :class:`TailRows` of sequences of ``lens: [B]`` tokens whose step-pool slots are ``slots: [B]``.

    A sequence's partial tile (``lens % G`` tokens) keeps token ``j`` in ``block_table[b, lens // G + 1 +
    j // rows_per_block]``, row ``j % rows_per_block`` (``docs/tail_blocks.md``). ``since: [B]``: only
    the tokens at positions ``>= since`` (a step's new tokens: all that a scatter after the step must
    write back, the older rows of the same tile being in their blocks already). Computed once a step
    and used by every layer's :meth:`PagedKV.gather_tails` / :meth:`PagedKV.scatter_tails`; the index
    math runs on the host (the lengths a builder plans with are host arrays) and reaches the device in
    one copy from pinned memory that does not wait for the device, and a block table too narrow for a
    tail is refused here, before any layer writes.
    """
    g, rows = group_size, rows_per_block
    lens = lens.long().cpu()
    n = lens % g  # tokens of each sequence's partial tile
    seq = torch.repeat_interleave(torch.arange(lens.shape[0]), n)
    offset = torch.arange(seq.shape[0]) - (torch.cumsum(n, 0) - n)[seq]
    if since is not None:
        keep = lens[seq] // g * g + offset >= since.long().cpu()[seq]
        seq, offset = seq[keep], offset[keep]
    col = lens[seq] // g + 1 + offset // rows  # tail blocks follow the partial tile's block
    if col.numel() and int(col.max()) >= block_table.shape[1]:
        bad = int(seq[col.argmax()])
        raise ValueError(
            f"sequence {bad} of {int(lens[bad])} tokens keeps its tail in blocks up to column {int(col.max())}, "
            f"but its block table has {block_table.shape[1]} columns (vLLM must give it the tail blocks)"
        )
    parts = [seq, col, slots.long().cpu()[seq], offset, offset % rows]
    seq, col, slot, offset, row = to_device_aligned([p.numpy() for p in parts], block_table.device)
    return TailRows(slot, offset, block_table[seq, col].long(), row, rows)


@dataclass(frozen=True)
class BlockTails:
    """A decode step's own tiles where tails live in the cache's blocks (:func:`block_tails`).

    ``tables: [B, N]`` int32, the blocks of each sequence's own tile (row ``j`` of the tile in block
    ``tables[b, j // rows_per_block]``); ``mapping: [B]`` int64, the step's token as ``block *
    rows_per_block + row`` for :func:`kvarn.ops.write_tail` on :meth:`PagedKV.tail_block_view` (``-1``:
    a padding row, skipped).
    """

    tables: torch.Tensor
    mapping: torch.Tensor
    rows_per_block: int


def block_tails(
    block_table: torch.Tensor, seq_lens: torch.Tensor, group_size: int, rows_per_block: int, tail_blocks: int
) -> BlockTails:
    """The :class:`BlockTails` of a decode step (one new token per sequence; ``seq_lens: [B]`` after it),
    computed where the tensors are, without a host sync (a CUDA-graph step's builder runs it).

    The token at position ``p = seq_lens - 1`` belongs to tile ``p // G``, whose rows are kept from
    block-table column ``p // G + 1`` on (:func:`tail_rows`' layout before the step; the tile stays there
    in the step that fills it, after its commit). Columns past the table's width are clamped: the caller
    checks the width on the host (:meth:`kvarn.integration` builders do, from the lengths they plan with).
    A row with ``seq_lens <= 0`` (padding) gets mapping ``-1``.
    """
    g, rows = group_size, rows_per_block
    lens = seq_lens.long()
    pos = (lens - 1).clamp(min=0)
    cols = pos // g + 1
    cols = (cols[:, None] + torch.arange(tail_blocks, device=lens.device)).clamp(max=block_table.shape[1] - 1)
    tables = block_table[: lens.shape[0]].gather(1, cols).to(torch.int32)
    off = pos % g
    blk = tables.gather(1, (off // rows)[:, None])[:, 0].long()
    mapping = torch.where(lens > 0, blk * rows + off % rows, -1)
    return BlockTails(tables, mapping, rows)


def plan_request_slots(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    request_slots,
    group_size: int,
    sink_slots=None,
) -> TilePlan:
    """Plan one step when the caller names each request's tail slot; no block id is read on the host.

    For callers that give every live request a stable index (vLLM's GPU model runner does): the
    request's incomplete tile lives in pool slot ``request_slots[r]`` for the request's whole
    life, so slots are never claimed, evicted or lost, and the pool needs exactly one slot per
    request that can run. A new owner of a slot starts its tile at offset 0 (or at a prefix hit,
    on a tile boundary), so it overwrites the slot before it reads it.

    Args:
        query_start_loc: ``[B + 1]`` int (CPU), offsets of each request's new tokens.
        seq_lens: ``[B]`` int (CPU), tokens of each request after the step.
        block_table: ``[B, max_blocks]`` int on the plan's device; the commit and store blocks
            are gathered from it there (no copy to the host).
        num_tokens: rows of the step's key/value tensors (``>= query_start_loc[-1]``).
        request_slots: ``[B]`` ints (CPU), each request's tail slot.
        group_size: the tile length ``G``.
        sink_slots: ``[B]`` ints (CPU) or ``None`` (no sink): each request's sink slot (a pool row
            holding its first tile in full precision, ``-1`` for none, e.g. a CUDA-graph padding
            row); the step's tokens at positions below ``G`` are written to it as well.

    Returns the same :class:`TilePlan` as :meth:`TilePlanner.plan`, on ``block_table``'s device.
    """
    g = group_size
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    slots = np.asarray(request_slots, dtype=np.int64)
    batch = lens.shape[0]
    if qsl.shape != (batch + 1,) or slots.shape != (batch,):
        raise ValueError(
            f"query_start_loc must be [B + 1] and request_slots [B] for B = {batch}, got "
            f"{tuple(qsl.shape)} and {tuple(slots.shape)}"
        )
    n = qsl[1:] - qsl[:-1]
    start = lens - n
    if (n < 0).any() or (start < 0).any():
        bad = int(np.nonzero((n < 0) | (start < 0))[0][0])
        raise ValueError(f"request {bad} has {n[bad]} new tokens but a length of {lens[bad]}")
    total = int(qsl[-1])
    if total > num_tokens:
        raise ValueError(f"the step has {total} tokens but num_tokens is {num_tokens}")
    row = np.repeat(np.arange(batch), n)
    tok = np.arange(total)
    pos = start[row] + tok - qsl[row]
    tile = pos // g
    whole = (tile * g >= start[row]) & ((tile + 1) * g <= lens[row])
    commits = (n > 0) & (start % g != 0) & ((start // g + 1) * g <= lens)
    late = ~whole & commits[row] & (tile > start[row] // g)
    mapping = np.full(num_tokens, -1, dtype=np.int64)
    slot_pos = slots[row] * g + pos % g
    mapping[:total] = np.where(whole | late, -1, slot_pos)
    late_mapping = np.full(num_tokens if late.any() else 0, -1, dtype=np.int64)
    if late.any():
        late_mapping[:total] = np.where(late, slot_pos, -1)
    first = whole & (pos % g == 0)
    commit = np.nonzero(commits)[0]
    nl = late_mapping.shape[0]
    parts = [mapping, late_mapping, slots[commit], commit, start[commit] // g]
    parts += [tok[first], row[first], tile[first], slots]
    if sink_slots is not None:
        sinks = np.asarray(sink_slots, dtype=np.int64)
        if sinks.shape != (batch,):
            raise ValueError(f"sink_slots must be [B] for B = {batch}, got {tuple(sinks.shape)}")
        sink_mapping = np.full(num_tokens, -1, dtype=np.int64)
        sink_mapping[:total] = np.where((pos < g) & (sinks[row] >= 0), sinks[row] * g + pos, -1)
        parts += [sink_mapping, sinks]
    device = block_table.device
    split = to_device_aligned(parts, device)
    mapping_d, late_d, commit_slots, commit_rows, commit_tiles = split[:5]
    store_tok0, store_rows, store_tiles, tail_slots = split[5:9]
    return TilePlan(
        sink_slot_mapping=split[9] if sink_slots is not None else None,
        sink_slots=split[10] if sink_slots is not None else None,
        late_tail_slot_mapping=late_d if nl else None,
        tail_slot_mapping=mapping_d,
        commit_slots=commit_slots,
        commit_blocks=block_table[commit_rows, commit_tiles].long(),
        store_token_idx=store_tok0[:, None] + torch.arange(g, device=device)[None, :],
        store_blocks=block_table[store_rows, store_tiles].long(),
        tail_slots=tail_slots,
        head_slots=tail_slots,
        commit_first=block_table[commit_rows, 0].long(),
        store_first=block_table[store_rows, 0].long(),
    )


@dataclass
class BatchStep:
    """One step of a :class:`DenseBatch`, shared by every layer.

    Attributes:
        start, n: positions before the step and new positions per row (padding included).
        plan: the tile plan of the step's real tokens.
        token_idx: ``[T]`` rows of the flattened ``[B * n]`` chunk that are real tokens.
        query_start_loc: ``[B + 1]`` int32, offsets of each row's real tokens in ``token_idx``.
        before, after: ``[B]`` real tokens of each row before and after the step (host lists).
        seq_lens, block_table: ``[B]`` and ``[B, tiles]`` int32 on the model's device.
    """

    start: int
    n: int
    plan: TilePlan
    token_idx: torch.Tensor
    query_start_loc: torch.Tensor
    before: list[int]
    after: list[int]
    seq_lens: torch.Tensor
    block_table: torch.Tensor


class _Cursor:
    """A planner walking a :class:`DenseBatch`'s schedule; it keeps the last :class:`BatchStep` it made."""

    def __init__(self, batch: int, group_size: int, sink: bool):
        self.batch, self.group_size = batch, group_size
        self.planner = TilePlanner(batch, group_size, num_sink_slots=batch if sink else 0)
        self.real = [0] * batch
        self.index = 0  # the next step of the schedule to plan
        self.last: BatchStep | None = None

    def advance(self, start: int, n: int, new: list[int], device: torch.device | str) -> BatchStep:
        """Plan the step that adds ``new[b]`` real tokens (the last ones of ``n`` positions) to each row."""
        batch, g = self.batch, self.group_size
        before = self.real
        after = [b + r for b, r in zip(before, new, strict=True)]
        rows = torch.arange(batch)[:, None] * n + torch.arange(n)[None, :]
        keep = torch.arange(n)[None, :] >= torch.tensor([n - r for r in new])[:, None]
        qsl = torch.tensor([0, *new]).cumsum(0)
        tiles = max(1, max(math.ceil(a / g) for a in after))
        table = torch.arange(tiles)[None, :] * batch + torch.arange(batch)[:, None]
        plan = self.planner.plan(qsl, torch.tensor(after), table, int(qsl[-1]), device)
        self.real, self.index = after, self.index + 1
        self.last = BatchStep(
            start=start,
            n=n,
            plan=plan,
            token_idx=rows[keep].to(device),
            query_start_loc=qsl.to(device, torch.int32),
            before=before,
            after=after,
            seq_lens=torch.tensor(after, dtype=torch.int32, device=device),
            block_table=table.to(device, torch.int32),
        )
        return self.last


class DenseBatch:
    """``B`` sequences that advance together, as a transformers batch does: the lifecycle of its rows.

    Tile ``i`` of row ``b`` is block ``i * B + b`` (growing the cache appends blocks and never
    renumbers one); row ``b``'s tail is a tail slot and, with ``sink``, its first tile is kept in
    sink slot ``b``. A step adds ``n`` positions to every row, of which the last ``new[b]`` are
    real tokens (the rest is left padding, which is never stored): each row's tiles start at its
    first real token.

    Every layer asks for the same steps: the first to ask plans it, the others reuse the plan. A
    caller may also fill the layers one after the other: a layer asking for an older step gets it
    from a second planner replaying the schedule, which makes the same decisions the first made.
    """

    def __init__(self, sink: bool = False):
        self.sink = sink
        self.reset()

    def reset(self) -> None:
        self.batch = self.group_size = self.positions = 0
        self.schedule: list[tuple[int, int, list[int]]] = []  # (start, n, new real tokens per row)
        self.lead: _Cursor | None = None
        self.replay: _Cursor | None = None

    @property
    def real(self) -> list[int]:
        """Real tokens of each row after the newest step."""
        return self.lead.real if self.lead else []

    @property
    def step(self) -> BatchStep | None:
        """The newest step."""
        return self.lead.last if self.lead else None

    def begin(
        self,
        start: int,
        n: int,
        batch: int,
        group_size: int,
        device: torch.device | str,
        new_tokens: Callable[[list[int]], list[int]],
    ) -> BatchStep:
        """The step adding ``n`` positions to each of ``batch`` rows at positions ``start ..``.

        ``new_tokens(before)`` gives the real tokens of each row in the step (``before``: real tokens
        so far); it is called only when the step is planned for the first time.
        """
        if self.lead is None:
            self.batch, self.group_size = batch, group_size
            self.lead = _Cursor(batch, group_size, self.sink)
        elif batch != self.batch or group_size != self.group_size:
            raise ValueError(f"this batch has {self.batch} rows of {self.group_size}-token tiles, got {batch} rows")
        for cursor in (self.lead, self.replay):
            if cursor is not None and cursor.last is not None and cursor.last.start == start and cursor.last.n == n:
                return cursor.last
        if start == self.positions:
            new = new_tokens(list(self.lead.real))
            if len(new) != batch or any(not 0 <= r <= n for r in new):
                raise ValueError(f"each of the {batch} rows gets 0 to {n} real tokens in this step, got {new}")
            self.schedule.append((start, n, new))
            self.positions = start + n
            return self.lead.advance(start, n, new, device)
        index = next((i for i, (s, m, _) in enumerate(self.schedule) if s == start and m == n), None)
        if index is None:
            raise ValueError(
                f"{n} positions at {start}, but the steps so far were {[(s, m) for s, m, _ in self.schedule]}; "
                "committed tiles cannot be cropped or rewound"
            )
        if self.replay is None or self.replay.index > index:
            self.replay = _Cursor(self.batch, self.group_size, self.sink)
        while True:
            s, m, new = self.schedule[self.replay.index]
            step = self.replay.advance(s, m, new, device)
            if self.replay.index > index:
                return step

    def reorder(self, order: list[int]) -> list[tuple[int, int]]:
        """Rows ``order`` become rows ``0 .. B`` (beam search); returns the ``(to, from)`` pool rows to copy.

        The rows' records move with ``cache.view(tiles, B, ...)[:, order]``; the pool rows returned
        carry each row's tail (and sink) along.
        """
        if self.lead is None:
            return []
        g, batch, real = self.group_size, self.batch, self.lead.real
        slots, sinks = self.lead.planner.live_slots, self.lead.planner.live_sinks
        moves = []
        for dst, src in enumerate(order):
            if real[dst] != real[src]:
                raise ValueError("reordering rows needs equal lengths in the rows it exchanges (beams of one prompt)")
            if real[dst] % g:
                tile = real[dst] // g
                moves.append((slots[tile * batch + dst], slots[tile * batch + src]))
            if self.sink and real[dst]:
                moves.append((sinks[dst], sinks[src]))
        self.replay = None
        return moves
