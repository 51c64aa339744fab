"""Prompt chunks attended through one varlen call: which requests, and where their pages go.

A request with many queries in one step (a prompt chunk) can attend through one varlen attention
call for all such requests of the step (:data:`VarlenAttention`: vLLM's flash attention in the vLLM
backend, :func:`sdpa_varlen` elsewhere) instead of through the paged kernel, whose programs serve
one query block at a time: :meth:`PagedKV.read_pages <kvarn.paged.storage.PagedKV.read_pages>`
reads the tiles before each query's tile back as pages (the dequantize kernel) and builds one
full-precision page per query tile, and each query tile attends over its own page table.
:func:`split_prefill` picks those requests, :class:`PageLayout` places their pages, and
:meth:`PagedKV.attend_split <kvarn.paged.storage.PagedKV.attend_split>` runs both paths in one step.
The semantics are :meth:`PagedKV.attend <kvarn.paged.storage.PagedKV.attend>`'s; only the order of
the arithmetic differs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvarn.paged.transfer import to_device_aligned

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

    def read_groups(self) -> list[list[tuple[int, int, int, int]]]:
        """:attr:`rows` in order, cut so that a group reads back at most :data:`PREFILL_READ_TOKENS` tokens
        (a longer request alone): the rows of one varlen call each."""
        groups, size = [[]], 0
        for item in self.rows:
            if groups[-1] and size + item[3] > PREFILL_READ_TOKENS:
                groups.append([])
                size = 0
            groups[-1].append(item)
            size += item[3]
        return groups

    def layout(self, group: list[tuple[int, int, int, int]], group_size: int) -> PageLayout:
        """The :class:`PageLayout` of ``group`` (one of :meth:`read_groups`), made by the step's first layer."""
        rows = tuple(group)
        if rows not in self.layouts:
            self.layouts[rows] = PageLayout.of(group, group_size)
        return self.layouts[rows]


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
