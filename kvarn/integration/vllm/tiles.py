"""The tile lifecycle of a KVarN layer inside vLLM: which tokens go where in one model step.

vLLM hands the backend, per step, ragged chunks of new tokens (``query_start_loc``), each
request's length after the step (``seq_lens``) and its block table. One block is one tile of
``G`` tokens. :class:`TilePlanner` turns that into a :class:`TilePlan`:

- A tile that this step writes from its first to its last token goes straight to its record
  (``store_tiles``): whole prompt tiles of a prefill chunk.
- Every other token goes to the full-precision tail pool (``write_tail``) at
  ``slot * G + offset``. A tile that becomes full in this step (a decode step or a chunk that
  ends the tile) is then quantized from its slot into its block (``commit_tiles``), in the same
  step and before attention: vLLM may publish that block to the prefix cache in this step.
- Attention reads every full tile from its record and the last ``seq_len % G`` tokens from the
  request's tail slot.

Tail slots are keyed by the block id of the incomplete tile. An incomplete block belongs to
exactly one live request (vLLM shares only full, hashed blocks), so the key needs no request id,
survives steps in which the request is not scheduled, and is dropped with the block: a request
that finishes or is preempted frees the block, and the next owner of that block id starts its
tile at offset 0 (prefix hits land on tile boundaries), overwriting the slot before reading it.

A slot is released when its tile commits, when its block id shows up as a full tile of any
scheduled request (the block was recycled), and, when the pool runs dry, least recently used
first among the slots this step does not touch. A request that continues a tile whose slot is
gone raises :class:`TailLostError` instead of attending over garbage; the pool is sized so that
this needs more partial tiles than ``num_slots`` to be outstanding at once.

Only committed tokens may be planned: speculative drafts would be frozen into a record.

:func:`store_step` and :func:`attend_step` are the backend's only calls into ``kvarn.ops`` (the
reference on CPU, Triton on CUDA); they need no vLLM, so the CUDA path is tested with them alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvarn import ops
from kvarn.config import KVarNConfig


class TailLostError(RuntimeError):
    """A request continues a tile whose full-precision tail slot was recycled."""


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
    """

    tail_slot_mapping: torch.Tensor
    commit_slots: torch.Tensor
    commit_blocks: torch.Tensor
    store_token_idx: torch.Tensor
    store_blocks: torch.Tensor
    tail_slots: torch.Tensor


class TilePlanner:
    """Hands out tail slots and plans the stores of each step (see the module docstring).

    One planner serves all layers of one KV-cache group: every layer of the group sees the same
    tokens in the same blocks, so the slot decisions are shared and each layer keeps its own
    ``[num_slots, G, Hkv, D]`` tail tensors.
    """

    def __init__(self, num_slots: int, group_size: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self.group_size = group_size
        self._slot_of: dict[int, int] = {}
        self._block_of: list[int | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._step = 0
        self.stats: Counter[str] = Counter()
        """Counts since creation: ``steps``, ``stored_tiles``, ``committed_tiles``, ``tail_tokens``,
        ``chunks_starting_inside_a_tile`` (a chunk of more than one token that continues a tile),
        ``recycled_tails`` (slots freed because their block came back as a full tile) and
        ``evicted_tails`` (slots taken from an idle tail when the pool ran dry)."""

    @property
    def live_slots(self) -> dict[int, int]:
        """A copy of the current ``block id -> tail slot`` map."""
        return dict(self._slot_of)

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
            idle = [s for s in range(self.num_slots) if s not in touched]
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
        tail_slots = [0] * batch
        commits: list[tuple[int, int]] = []
        stores: list[tuple[int, int]] = []
        touched: set[int] = set()
        full_rows: list[torch.Tensor] = []
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
            for tile in range(start // g, (length - 1) // g + 1):
                lo, hi = max(start, tile * g), min(length, (tile + 1) * g)
                block = int(row[tile])
                first = qsl[r] + lo - start
                if lo == tile * g and hi == (tile + 1) * g:
                    stores.append((first, block))
                    continue
                if lo > tile * g and block not in self._slot_of:
                    raise TailLostError(
                        f"the full-precision tail of block {block} (tokens {tile * g}..{lo - 1} of a "
                        f"running request) was recycled; raise KVARN_TAIL_SLOTS (now {self.num_slots})"
                    )
                slot = self._claim(block, touched)
                touched.add(slot)
                self._last_used[slot] = self._step
                mapping[first : first + hi - lo] = torch.arange(slot * g + lo - tile * g, slot * g + hi - tile * g)
                if hi == (tile + 1) * g:
                    commits.append((slot, block))
                else:
                    tail_slots[r] = slot
        committed = {slot for slot, _ in commits}
        if full_rows and self._slot_of:
            full = torch.cat(full_rows).tolist()
            for block in set(full).intersection(self._slot_of):
                if self._slot_of[block] not in touched:
                    self._release(self._slot_of[block])
                    self.stats["recycled_tails"] += 1
        for slot in committed:
            self._release(slot)
        self.stats["steps"] += 1
        self.stats["stored_tiles"] += len(stores)
        self.stats["committed_tiles"] += len(commits)
        self.stats["tail_tokens"] += int((mapping >= 0).sum())

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
        )


def store_step(
    plan: TilePlan,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    cfg: KVarNConfig,
    *,
    impl: str = "auto",
) -> None:
    """Store one step's ``k, v: [T, Hkv, D]`` (model frame) as the plan says, in place.

    Tail tokens first, then the tiles they complete, then the whole tiles of the step; ``cache:
    [num_blocks, Hkv, record_bytes]``, ``tail_k, tail_v: [num_slots, G, Hkv, D]``.
    """
    ops.write_tail(k, v, tail_k, tail_v, plan.tail_slot_mapping, cfg, impl=impl)
    ops.commit_tiles(tail_k, tail_v, plan.commit_slots, plan.commit_blocks, cache, cfg, impl=impl)
    if plan.store_blocks.numel():
        idx = plan.store_token_idx.reshape(-1)
        shape = (plan.store_blocks.numel(), cfg.group_size, *k.shape[1:])
        ops.store_tiles(k[idx].view(shape), v[idx].view(shape), plan.store_blocks, cache, cfg, impl=impl)


def attend_step(
    plan: TilePlan,
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    cfg: KVarNConfig,
    scale: float,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of one step's ``query: [T, Hq, D]`` after :func:`store_step` -> ``[T, Hq, D]``."""
    return ops.paged_attention(
        query,
        cache,
        block_table,
        seq_lens,
        tail_k,
        tail_v,
        plan.tail_slots,
        cfg,
        query_start_loc,
        None,
        scale,
        impl=impl,
    )
