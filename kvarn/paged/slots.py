"""Tail slots a caller names per request, and tails kept in the cache's own blocks.

A caller that gives every live request a stable index (vLLM's GPU model runner) plans with
:func:`plan_request_slots` instead of :class:`~kvarn.paged.plan.TilePlanner`: the request's slot is
its index, nothing is claimed or evicted, and no block id is read on the host.

Tails in blocks (``docs/internals/vllm_backend.md``; vLLM's CPU engine with ``KVARN_TAIL_BLOCKS=1``): a
sequence's partial tile lives in the blocks after its own (:func:`tail_geometry` rows each), and
:meth:`PagedKV.gather_tails <kvarn.paged.storage.PagedKV.gather_tails>` /
:meth:`PagedKV.scatter_tails <kvarn.paged.storage.PagedKV.scatter_tails>` move it into and out of a
step pool of one slot per row around the step (at the places :func:`tail_rows` finds once a step),
which is then planned with :func:`plan_request_slots`. A decode step may instead write and read the
blocks directly (:func:`block_tails`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvarn.config import KVarNConfig
from kvarn.paged.plan import TilePlan
from kvarn.paged.transfer import to_device_aligned


def tail_geometry(cfg: KVarNConfig, pool_itemsize: int = 2) -> tuple[int, int]:
    """``(rows_per_block, tail_blocks)``: the tail tokens one block's page holds and the blocks a tail takes.

    A page holds one record per KV head, ``cfg.record_bytes`` each; a tail token of one KV head takes
    its K and V rows in the pool form, ``2 * head_dim * pool_itemsize`` bytes. A tail holds up to a
    whole tile (``group_size`` tokens: the own-tile rule keeps a completed tile in full precision until
    attention has read it). At k4v2_g128, head_dim 128, 16-bit pools: 27 rows a block, 5 blocks.

    The layout of tails in vLLM's blocks (``docs/internals/vllm_backend.md``, used by
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
    j // rows_per_block]``, row ``j % rows_per_block`` (``docs/internals/vllm_backend.md``). ``since: [B]``: only
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
