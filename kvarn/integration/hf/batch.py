"""The rows of a transformers batch: their tile lifecycle (:class:`DenseBatch`) and where their padding comes from.

A transformers batch is ``B`` sequences that advance together by the same number of positions; a
left-padded row has fewer real tokens than positions. :class:`DenseBatch` numbers the rows' tiles
as blocks and plans each step once for all layers through :class:`~kvarn.paged.TilePlanner`;
:class:`Sequences` finds how many of a step's positions are real tokens in each row.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvarn.config import KVarNConfig
from kvarn.integration.hf.attention import MASKED, UNPADDED
from kvarn.paged import TilePlan, TilePlanner, to_device_aligned


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
        host = [rows[keep].numpy(), qsl.numpy(), after, table.numpy()]
        token_idx, qsl_d, lens_d, table_d = to_device_aligned(host, device)  # one copy, not waiting for the device
        self.last = BatchStep(
            start=start,
            n=n,
            plan=plan,
            token_idx=token_idx,
            query_start_loc=qsl_d.to(torch.int32),
            before=before,
            after=after,
            seq_lens=lens_d.to(torch.int32),
            block_table=table_d.view(table.shape).to(torch.int32),
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


def passed_position_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
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


def _copies_of_one_row(x: torch.Tensor) -> bool:
    """Whether every row of ``x: [B, ...]`` equals the first: the beams (or samples) of one prompt, which padding
    cannot tell apart."""
    return bool((x == x[:1]).all())


def _per_row(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The prompt's ``[B, T]`` mask with one row per cache row: ``generate`` repeats each prompt's row once per
    beam (and per returned sequence) with ``repeat_interleave``, so a mask of ``B`` rows serves ``B * k`` rows."""
    rows = mask.shape[0]
    if rows == batch:
        return mask
    if rows and batch % rows == 0:
        return mask.repeat_interleave(batch // rows, dim=0)
    raise ValueError(
        f"KVarNCache(attention_mask=...) has {rows} rows but the batch has {batch}; pass the mask given to generate "
        "(one row per prompt, repeated here for each beam) or one row per batch row"
    )


class Sequences:
    """The rows of one :class:`~kvarn.integration.hf.KVarNCache` (a :class:`DenseBatch`) and where their padding
    comes from."""

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
            lambda before: self._new_tokens(key_states, start, position_ids, before),
        )

    def _new_tokens(self, key_states: torch.Tensor, start: int, position_ids, before: list[int]) -> list[int]:
        """Real tokens of each row in the chunk of positions ``start .. start + n`` (the rest is left padding)."""
        batch, _, n, _ = key_states.shape
        if position_ids is None or position_ids.shape[0] != batch:
            mask = self.prompt_mask
            seen = MASKED.get()
            MASKED.set(None)
            fits = isinstance(seen, torch.Tensor) and seen.shape[0] == batch and seen.shape[1] >= start + n
            if mask is None and fits:
                mask = _left_padding_mask(seen)
            if mask is None:
                shared = position_ids is not None and position_ids.shape[0] == 1  # the same positions in every row
                unseen = seen is not UNPADDED and not shared
                # the comparison of rows waits for the GPU: only a batch's first step asks it
                if batch > 1 and start == 0 and unseen and not _copies_of_one_row(key_states):
                    warnings.warn(
                        "KVarNCache cannot see this batch's padding; if it is padded, pass "
                        "KVarNCache(..., attention_mask=mask) or each row's records will depend on its padding",
                        stacklevel=6,
                    )
                return [n] * batch
            real = _per_row(mask, batch)[:, start : start + n].sum(1).tolist()
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
