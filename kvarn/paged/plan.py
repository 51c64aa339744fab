"""Which tiles a step fills: the tile planner and its tail and sink slots.

Per step, an integration hands over ragged chunks of new tokens (``query_start_loc``), each
sequence's length after the step (``seq_lens``) and its block table. One block is one tile of ``G``
tokens. :class:`TilePlanner` turns that into a :class:`TilePlan`, which
:class:`~kvarn.paged.storage.PagedKV` carries out through :mod:`kvarn.ops`:

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

Sink (optional, ``num_sink_slots > 0``): the tokens of a sequence's first tile also go to a
*sink slot*, keyed by the block id of that first tile, and attention reads the first tile from
the sink slot in full precision instead of from its record (the record is written all the same).
Requests whose first tiles share a block (a prefix-cache hit) share its sink.
:class:`SinkSlots` keeps the map; the planner sees every write, so the key stays true to the
block's contents (a caller of :func:`~kvarn.paged.slots.plan_request_slots`, which sees no block
ids, drops the sinks of blocks it hands out fresh itself: the vLLM backend on the GPU runner):

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

Speculative decoding (``num_drafts``): the last ``k`` tokens of a request's step are unverified
drafts, and the next step may start below the end of this one (vLLM rolls a rejected draft back and
overwrites its row). A tile that the step fills is quantized into its block as usual, before
attention, so the step's draft queries past it read it as a run without drafts would; but while it
holds a draft its slot is kept (and the next tile takes a slot of its own), so the next step can
rewind into it, overwrite the rejected rows and quantize it again when it is full. A tile is never
frozen with a draft in it: its record is rewritten whenever its last token is, and vLLM publishes
a block to the prefix cache only once every token in it is verified, by which time the record was
made from those tokens. A whole tile with a draft in it goes through the tail, never straight to
its record. The kept slot is released once the request's next step starts past the tile (or with
the request's blocks), so a request holds at most two slots when ``k < G``.

A draft model's own attention layers (EAGLE, MTP, a draft model) write more unverified tokens than that:
each engine step first runs the draft over the verified tokens again and then one draft token at a time
past them, and the next step rewinds to the first token the target did not accept. Their planner is
told that every token of such a step is a draft (``num_drafts`` equal to the step's tokens): tiles
filled in those steps keep their slots until a step starts past them, by which time every token in
them was last written from verified inputs. A request then holds at most two slots while its draft
steps span at most two tiles.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvarn.paged.transfer import to_device_aligned


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
            committed / stored tile's request (its block table entry 0; with a window, once the step
            starts past tile 0, the block of the tile before the step's, whose record carries the same
            vector): where formats with one smoothing vector per sequence read it (``smooth_src`` of
            :func:`kvarn.ops.store_tiles`).
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
        window: int | None = None,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        if num_sink_slots < 0:
            raise ValueError(f"num_sink_slots must be non-negative, got {num_sink_slots}")
        if window is not None and (window < 1 or num_sink_slots):
            raise ValueError(
                f"window must be positive and come without sink slots (a first tile's block leaves with the window), "
                f"got window={window}, num_sink_slots={num_sink_slots}"
            )
        self.window = window
        self.num_slots = num_slots
        self.num_sink_slots = num_sink_slots
        self.group_size = group_size
        self._slot_of: dict[int, int] = {}
        self._tail_range = range(num_sink_slots, num_sink_slots + num_slots)
        self._block_of: list[int | None] = [None] * (num_sink_slots + num_slots)
        self._last_used = [0] * (num_sink_slots + num_slots)
        self._free = list(reversed(self._tail_range))
        self._step = 0
        self._kept: set[int] = set()  # slots of full tiles that hold a draft (module docstring)
        self.stats: Counter[str] = Counter()
        self.sinks = SinkSlots(num_sink_slots, group_size, sink_pinned, on_sink_evicted, self.stats)
        """Counts since creation: ``steps``, ``stored_tiles``, ``committed_tiles``, ``tail_tokens``,
        ``chunks_starting_inside_a_tile`` (a chunk of more than one token that continues a tile),
        ``recycled_tails`` (slots freed because their block came back as a full tile),
        ``verified_tails`` (kept slots of tiles filled with a draft, freed once a step starts past them),
        ``reopened_tails`` (steps that rewound into such a tile after a rejected draft),
        ``released_tails`` (slots freed by :meth:`release_blocks`), ``evicted_tails`` (slots
        taken from an idle tail when the pool ran dry), and with a sink ``new_sinks`` (first tiles
        written from offset 0), ``recycled_sinks`` (freed because their block was written as another
        tile) and ``evicted_sinks`` (taken from an unheld block when the sink pool ran dry)."""

    def first_live(self, start: int) -> int:
        """The first block-table column a step starting at position ``start`` may read (0 without a window)."""
        return 0 if self.window is None else max(0, start - self.window + 1) // self.group_size

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
            self._kept.discard(slot)

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
            # a kept slot last: its request may still rewind into its tile
            self._release(min(idle, key=lambda s: (s in self._kept, self._last_used[s])))
            self.stats["evicted_tails"] += 1
        slot = self._free.pop()
        self._slot_of[block] = slot
        self._block_of[slot] = block
        return slot

    def _release_verified(self, qsl: list[int], lens: list[int], block_table: torch.Tensor, drafts: list[int]) -> None:
        """Free the kept slot of a tile that a scheduled request's step now starts past with a verified token
        (every token in the tile was verified, and its record was made from them), before this step claims
        slots. Not where a row of this step writes that block (a tile of another request filled in this
        step), and not for a row whose every token is a draft (a draft model's step: the next step may rewind)."""
        g = self.group_size
        below, written = [], set()
        for r, length in enumerate(lens):
            start = length - (qsl[r + 1] - qsl[r])
            if start >= length or start < 0:
                continue
            row = block_table[r]
            written.update(int(b) for b in row[start // g : (length - 1) // g + 1].tolist())
            # an all-draft row may still rewind; a stale id before the window is not one of the row's blocks
            if drafts[r] < length - start and start // g - 1 >= self.first_live(start):
                below.append(int(row[start // g - 1]))
        for block in below:
            slot = self._slot_of.get(block)
            if slot in self._kept and block not in written:
                self._release(slot)
                self.stats["verified_tails"] += 1

    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_tokens: int,
        device: torch.device | str = "cpu",
        num_drafts=None,
    ) -> TilePlan:
        """Plan one step.

        Args:
            query_start_loc: ``[B + 1]`` int (CPU), offsets of each request's new tokens.
            seq_lens: ``[B]`` int (CPU), tokens of each request after the step, new ones included.
            block_table: ``[B, max_blocks]`` int (CPU), block of each tile of each request.
            num_tokens: rows of the step's key/value tensors (``>= query_start_loc[-1]``).
            device: where the plan's tensors go.
            num_drafts: ``[B]`` ints or ``None`` (none): how many of each request's new tokens, its
                last ones, are unverified speculative drafts (see the module docstring); all of them in
                a draft model's steps.
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
        drafts = [0] * batch if num_drafts is None else [int(d) for d in num_drafts]
        if len(drafts) != batch:
            raise ValueError(f"num_drafts must have one count per request ({batch}), got {len(drafts)}")
        kept: set[int] = set()  # slots of tiles filled in this step with a draft in them
        if self._kept:
            self._release_verified(qsl, lens, block_table, drafts)
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
            if not 0 <= drafts[r] <= n:
                raise ValueError(f"request {r} has {n} new tokens of which {drafts[r]} are said to be drafts")
            verified = length - drafts[r]  # tokens below it are verified
            if n > 1 and start % g:
                self.stats["chunks_starting_inside_a_tile"] += 1
            row = block_table[r]
            if drafts[r] < n:  # an all-draft row's full tiles may be its own, kept for a rewind
                full_rows.append(row[self.first_live(start) : length // g])
            # per-sequence smoothing reads the vector every record carries: from the first tile, or with a window
            # (whose first block vLLM frees) from the tile before the step's, which the caller's window keeps
            src = int(row[0]) if self.window is None or start < g else int(row[start // g - 1])
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
                if lo == tile * g and hi == (tile + 1) * g <= verified:
                    stores.append((first, block))
                    store_first.append(src)
                    continue
                if lo > tile * g and block not in self._slot_of:
                    raise TailLostError(
                        f"the full-precision tail of block {block} (tokens {tile * g}..{lo - 1} of a "
                        f"running request) was recycled; raise KVARN_TAIL_SLOTS (now {self.num_slots})"
                    )
                target = mapping
                if committing is not None and block not in self._slot_of and hi < (tile + 1) * g:
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
                    self.stats["reopened_tails"] += slot in self._kept  # a rewind after a rejected draft
                target[first : first + hi - lo] = torch.arange(slot * g + lo - tile * g, slot * g + hi - tile * g)
                if hi == (tile + 1) * g:
                    commits.append((slot, block))
                    commit_first.append(src)
                    if hi <= verified:
                        committing = slot
                    else:  # a draft in it: kept for a rewind, and the next tile takes a slot of its own
                        kept.add(slot)
                        committing = None
                else:
                    tail_slots[r] = slot
        self._kept = (self._kept - touched) | kept
        committed = {slot for slot, _ in commits}
        if full_rows and self._slot_of:
            full = torch.cat(full_rows).tolist()
            for block in set(full).intersection(self._slot_of):
                if self._slot_of[block] not in touched:
                    self._release(self._slot_of[block])
                    self.stats["recycled_tails"] += 1
        for slot in committed - reused - kept:
            self._release(slot)
        self.stats["steps"] += 1
        self.stats["stored_tiles"] += len(stores)
        self.stats["committed_tiles"] += len(commits)
        self.stats["tail_tokens"] += int((mapping >= 0).sum()) + int((late_mapping >= 0).sum())
        used = [s for s, _ in commits] + [s for r, s in enumerate(tail_slots) if lens[r] % g] + sink_slots

        store_idx = np.asarray([first for first, _ in stores], dtype=np.int64)[:, None] + np.arange(g)
        host = {
            "tail_slot_mapping": mapping.numpy(),
            "commit_slots": [s for s, _ in commits],
            "commit_blocks": [b for _, b in commits],
            "store_token_idx": store_idx,
            "store_blocks": [b for _, b in stores],
            "tail_slots": tail_slots,
            "head_slots": head_slots,
            "commit_first": commit_first,
            "store_first": store_first,
        }
        if sink:
            host.update(sink_slot_mapping=sink_mapping.numpy(), sink_slots=sink_slots)
        if reused:
            host["late_tail_slot_mapping"] = late_mapping.numpy()
        # one copy for the whole plan: a copy per list from pageable memory would wait for the device each time
        moved = dict(zip(host, to_device_aligned(list(host.values()), device), strict=True))
        moved["store_token_idx"] = moved["store_token_idx"].view(-1, g)
        return TilePlan(**moved, slots_needed=max(used, default=-1) + 1)

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
