"""Attention over the paged KVarN cache: the oracle for the Triton kernels and the vLLM backend.

Queries and outputs are in the model frame; the cache is in the rotated frame. Per step::

    q~ = q @ H                      (rotation leaves scores unchanged: q~ . k~ = q . k)
    o~ = softmax(scale * q~ K~^T) V~   over the sequence's dequantized tiles, tail and sink
    o  = o~ @ H

Sequences are ragged. ``query_start_loc: [B + 1]`` gives each sequence's queries, as in vLLM;
the ``n`` queries of sequence ``b`` are its last ``n`` tokens, so query ``i`` sits at position
``p = seq_lens[b] - n + i`` and sees keys ``0 .. p`` (causal within the chunk). Decode is the case
of one query per sequence (``query_start_loc=None``). Grouped-query attention: query head ``h``
reads KV head ``h // (Hq // Hkv)``.

Which values a query sees (the *own-tile rule*): a query at position ``p`` in tile ``t = p // G``
reads tiles ``0 .. t - 1`` from their records (tile 0 from its sink slot, with a sink) and the
tokens ``t * G .. p`` of its own tile in full precision: those before the step from the
sequence's tail slot, the step's own from ``key``/``value`` (taken through the pool form, so they
are the values a tail slot would hold). The rule depends on positions only, not on how a prompt
was cut into chunks or where a prefix-cache hit ended, and it is what decoding gives every token
(its tile is in the tail slot until it is full): a prompt token attends as it would have had it
been decoded.

Sliding window (``window=W``, per layer, as vLLM and FlashAttention's ``window_size=(W - 1, 0)``):
a query at position ``p`` sees only the keys at positions ``p - W + 1 .. p`` (``W`` keys with
itself); the own-tile rule still says where each visible key is read from. Tiles wholly before the
window of a sequence's first query are never read: in vLLM their block-table entries are stale ids of
blocks another request may already own, or the null block. The full-precision first tile (the
sequence's *sink* slot, ``sink_slots``) is tile 0 like any other: a query whose window has left it
does not read it.

Learned sink logits (``sink_logits=z``, GPT-OSS's per-head ``sinks``; not kvarn's sink slot above):
one logit ``z_h`` per query head, raw (not multiplied by the softmax scale), enters the softmax's
denominator only, as a key of value 0::

    o_h = sum_j exp(s_j) v_j / (exp(z_h) + sum_j exp(s_j)),    s_j = scale * q_h . k_j

so a head may attend to "nothing". ``z_h = -inf`` is no sink logit; ``+inf`` is not allowed.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import torch

from kvarn.config import KVarNConfig
from kvarn.reference.cache import gather_sequences_tiles, tail_tiles
from kvarn.reference.hadamard import rotate
from kvarn.reference.quantize import from_pool, prepare

BLOCK = 64
"""Keys are taken in blocks of this many positions (see :func:`attend`)."""
QUERY_BLOCK = 16
"""Queries are taken in blocks of this many positions (see :func:`attend`): a decode step computes
one block per sequence, so fewer rows cost less there, and more rows share each gathered key block
in a prompt."""


def check_window(window) -> None:
    """Raise unless ``window`` is ``None`` or a positive int (keys a query sees, itself included)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int (keys a query sees, itself included), got {window!r}")


def check_sink_logits(sink_logits, hq: int) -> None:
    """Raise unless ``sink_logits`` is ``None`` or a float ``[Hq]`` tensor."""
    if sink_logits is None:
        return
    if not isinstance(sink_logits, torch.Tensor) or sink_logits.shape != (hq,) or not sink_logits.is_floating_point():
        got = tuple(sink_logits.shape) if isinstance(sink_logits, torch.Tensor) else type(sink_logits).__name__
        raise ValueError(f"sink_logits must be a float tensor of one logit per query head, [{hq}], got {got}")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the last ``n`` positions.

    ``q: [n, Hq, D]``, ``k, v: [L, Hkv, D]`` -> ``[n, Hq, D]`` fp32. ``window``: a query at position
    ``p`` sees keys ``p - window + 1 .. p`` only (``None``: all up to ``p``); ``sink_logits: [Hq]``:
    each head's learned sink logit, added to the softmax denominator only (module docstring).

    Length-invariant: a query's output depends only on its own position and the keys it sees,
    bit for bit, not on how many queries or keys surround it. Queries go in blocks of
    :data:`QUERY_BLOCK` aligned to absolute positions (padded to full blocks, so every matrix
    product has the same shape, whichever blocks it is batched with), keys in blocks of
    :data:`BLOCK` aligned to absolute positions, in order with an online softmax, from the block
    of the first key the query block's window reaches (a function of the block's position and
    ``window`` only); a key block wholly outside a query's window or in its future adds exact
    zeros. A prompt's attention, and so the K/V of the layers after it, then come out the same
    whether the prompt is computed alone or as the prefix of a longer one: prefix caching changes
    no stored byte.
    """
    check_window(window)
    check_sink_logits(sink_logits, q.shape[1])
    return attend_own_tile(q, (k, v), (k, v), 0, BLOCK, scale, window=window, sink_logits=sink_logits)


def _attend_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
    window: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W`` blocks of queries, each over its own keys: ``q: [W, QUERY_BLOCK, Hkv, group, D]`` -> that shape.

    Block ``w`` holds the queries at positions ``start .. start + QUERY_BLOCK`` and reads its keys
    from the rows of ``keys, values: [R, Hkv, D]`` (row 0 zeros): the key at position ``p`` is row
    ``tiles_row + p`` for ``p < own`` and ``exact_row + p`` from ``own`` on, for ``lo <= p < end``
    (zeros elsewhere). ``blocks: [W, 7]`` int64 holds ``start, own, end, key0, lo, tiles_row,
    exact_row``; ``key0`` is a multiple of :data:`BLOCK`. Keys go in blocks of :data:`BLOCK` from
    ``key0``, in order, with an online softmax; ``sink_logits: [Hkv, group]`` join the denominator
    last. The blocks come in ascending order of their key-block counts, so that each step takes
    those still reading keys as one slice. A block's result depends on its own queries and keys
    only, bit for bit: every product is one ``[QUERY_BLOCK * group, D]`` matrix of one block and
    head against one key block, whatever the batch.
    """
    w, qb, hkv, group, d = q.shape
    start, own, end, key0, lo, tiles_row, exact_row = blocks.T[:, :, None]  # each [W, 1]
    pos_q = start + torch.arange(qb, device=q.device)  # [W, QUERY_BLOCK]
    steps = ((end - key0 + BLOCK - 1) // BLOCK)[:, 0].tolist()  # key blocks each query block reads
    if steps != sorted(steps):
        raise ValueError("query blocks must come in ascending order of their key blocks")
    # one matrix per (block, KV head), blocks outermost so that the blocks still reading keys are a
    # leading slice; rows of a key block are gathered as (block, head, key) rows of D values
    qm = q.permute(0, 2, 1, 3, 4).reshape(w * hkv, qb * group, d)
    flat_k, flat_v = keys.reshape(-1, d), values.reshape(-1, d)
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    m = torch.full((w * hkv, qb * group, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qm)
    for j in range(steps[-1] if steps else 0):
        a = bisect.bisect_right(steps, j)  # blocks a.. still read keys
        pos_k = key0[a:] + j * BLOCK + torch.arange(BLOCK, device=q.device)  # [W - a, BLOCK]
        row = torch.where(pos_k < own[a:], tiles_row[a:], exact_row[a:]) + pos_k
        row = torch.where((pos_k >= lo[a:]) & (pos_k < end[a:]), row, 0)
        at = (row[:, None, :] * hkv + heads).flatten()  # [(W - a) * Hkv * BLOCK]
        kb, vb = (x.index_select(0, at).view(-1, BLOCK, d) for x in (flat_k, flat_v))
        s = torch.bmm(qm[a * hkv :], kb.transpose(1, 2)) * scale  # [(W - a) * Hkv, QUERY_BLOCK * group, BLOCK]
        hidden = pos_k[:, None, :] > pos_q[a:, :, None]  # also hides the block's padding
        if window is not None:
            hidden |= pos_k[:, None, :] <= pos_q[a:, :, None] - window
        s = s.view(w - a, hkv, qb, group, BLOCK).masked_fill(hidden[:, None, :, None, :], float("-inf"))
        s = s.view(-1, qb * group, BLOCK)
        m_new = torch.maximum(m[a * hkv :], s.amax(-1, keepdim=True))
        seen = torch.isfinite(m_new)  # rows that have met a key
        alpha = torch.where(seen, torch.exp(m[a * hkv :] - m_new), 1.0)
        p = torch.where(seen, torch.exp(s - m_new), 0.0)
        denom[a * hkv :] = denom[a * hkv :] * alpha + p.sum(-1, keepdim=True)
        acc[a * hkv :] = acc[a * hkv :] * alpha + torch.bmm(p, vb)
        m[a * hkv :] = m_new
    if sink_logits is not None:  # a key of value 0 and score z: the denominator only
        z = sink_logits[None, :, None, :, None].expand(w, hkv, qb, group, 1).reshape(m.shape)
        m_new = torch.maximum(m, z)
        seen = torch.isfinite(m_new)
        alpha = torch.where(seen, torch.exp(m - m_new), 1.0)
        denom = denom * alpha + torch.where(seen, torch.exp(z - m_new), 0.0)
        acc = acc * alpha
    out = acc / denom.clamp(min=torch.finfo(torch.float32).tiny)
    return out.view(w, hkv, qb, group, d).permute(0, 2, 1, 3, 4)


MAX_BLOCKS = 64
"""Query blocks attended at once (bounds the scores' memory; the result does not depend on it)."""


class _Sequence(NamedTuple):
    """Where a sequence's keys lie in the rows given to :func:`_attend_sequences`.

    Position ``p`` as attention reads it from the records (``p >= tiles_from``, up to the last
    query's tile) is row ``tiles_row + p``; in full precision (``exact_from <= p < length``), row
    ``exact_row + p``. A query block reads the first form before its own tile, the second from it on.
    """

    length: int
    tiles_from: int
    tiles_row: int
    exact_from: int
    exact_row: int


def _attend_sequences(
    qs: list[torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    seqs: list[_Sequence],
    group_size: int,
    scale: float,
    window: int | None,
    sink_logits: torch.Tensor | None,
) -> list[torch.Tensor]:
    """:func:`attend_own_tile` of several sequences in one pass over their query blocks.

    ``qs[i]: [n_i, Hq, D]`` are the last ``n_i`` positions of ``seqs[i]``; ``keys, values: [R, Hkv, D]``
    fp32 hold every sequence's keys as rows, row 0 zeros.
    """
    hq, d = qs[0].shape[1:]
    hkv = keys.shape[1]
    z = None if sink_logits is None else sink_logits.float().to(keys.device).reshape(hkv, hq // hkv)
    blocks, q_blocks, spans = [], [], []
    for q, seq in zip(qs, seqs, strict=True):
        n = q.shape[0]
        first = seq.length - n
        seen_from = 0 if window is None else max(0, first - window + 1)  # the first key any query sees
        if seq.tiles_from > seen_from:
            raise ValueError(f"the tiles start at position {seq.tiles_from}, after the first key seen ({seen_from})")
        lo = first // QUERY_BLOCK * QUERY_BLOCK
        nb = math.ceil((seq.length - lo) / QUERY_BLOCK)
        start = lo + QUERY_BLOCK * torch.arange(nb)
        key0 = torch.zeros_like(start) if window is None else (start - window + 1).clamp(min=0) // BLOCK * BLOCK
        own = start // group_size * group_size  # each block's tile
        end = (start + QUERY_BLOCK).clamp(max=seq.length)
        fixed = torch.tensor([seq.tiles_from, seq.tiles_row, seq.exact_row]).expand(nb, 3)
        blocks.append(torch.cat([torch.stack([start, own, end, key0], 1), fixed], 1))
        qp = q.new_zeros(nb * QUERY_BLOCK, hq, d, dtype=torch.float32)
        qp[first - lo : first - lo + n] = q.float()
        q_blocks.append(qp.view(nb, QUERY_BLOCK, hkv, hq // hkv, d))
        spans.append((nb, first - lo, n))
    blocks = torch.cat(blocks).to(keys.device)
    q_all = torch.cat(q_blocks)
    out = torch.empty_like(q_all)
    order = torch.argsort(blocks[:, 2] - blocks[:, 3], stable=True)  # ascending key counts
    for part in order.split(MAX_BLOCKS):
        out[part] = _attend_blocks(q_all[part], keys, values, blocks[part], scale, window, z)
    results, at = [], 0
    for nb, skip, n in spans:
        results.append(out[at : at + nb].view(nb * QUERY_BLOCK, hq, d)[skip : skip + n])
        at += nb
    return results


def attend_own_tile(
    q: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    exact_from: int,
    group_size: int,
    scale: float,
    *,
    window: int | None = None,
    sink_logits: torch.Tensor | None = None,
    tiles_from: int = 0,
) -> torch.Tensor:
    """Causal GQA attention of the last ``n`` positions under the own-tile rule -> ``[n, Hq, D]`` fp32.

    ``tiles = (k, v)``: ``[m * G, Hkv, D]``, the sequence's tiles from position ``tiles_from`` on
    (a multiple of ``G``; the tiles before it are not given: no query's window reaches them) as
    attention reads them from the records; ``exact = (k, v)``: positions ``exact_from ..`` in full
    precision (``exact_from`` a multiple of ``G``). A query in tile ``t`` sees tiles ``< t`` from
    ``tiles`` and the rest of its keys from ``exact``, within its ``window``; ``sink_logits: [Hq]``
    as in :func:`attend`. Length-invariant as :func:`attend` (its blocks of :data:`QUERY_BLOCK`
    queries never straddle a tile, since ``G`` is a multiple of it); :func:`attend` is the case of
    one set of keys.
    """
    n_tiles = tiles[0].shape[0]
    keys, values = (torch.cat([t.new_zeros(1, *t.shape[1:]), t, x]).float() for t, x in zip(tiles, exact, strict=True))
    seq = _Sequence(exact_from + exact[0].shape[0], tiles_from, 1 - tiles_from, exact_from, 1 + n_tiles - exact_from)
    (out,) = _attend_sequences([q], keys, values, [seq], group_size, scale, window, sink_logits)
    return out


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    cfg: KVarNConfig,
    query_start_loc: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    scale: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    window: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query: [Nq, Hq, D]`` over a paged KVarN cache -> ``[Nq, Hq, D]`` in ``query.dtype``.

    Every query follows the own-tile rule, within its window, with the sink logits in the
    denominator (module docstring).

    Args:
        cache: ``[num_blocks, Hkv, record_bytes]`` uint8 records.
        block_table: ``[B, max_blocks]`` int, the block of each full tile of each sequence.
        seq_lens: ``[B]`` int, tokens in the cache per sequence, the queries' own included.
        tail_k, tail_v: ``[num_slots, G, Hkv, D]`` the full-precision tile pool (rotated, pool form).
        tail_slots: ``[B]`` int, the slot of the tile that sequence ``b``'s first query falls in
            (position ``seq_lens[b] - n``): it holds that tile's tokens before the step (and,
            without ``key``, the step's too). Read only where the tile has such tokens. Or
            ``[B, N]``: that tile is kept as rows of blocks (:func:`~kvarn.reference.cache.tail_tiles`;
            ``tail_k, tail_v: [num_blocks, R, Hkv, D]``, e.g. a cache's own blocks), without a sink.
        query_start_loc: ``[B + 1]`` int offsets of each sequence's queries; ``None`` = one each.
        sink_slots: ``[B]`` int or ``None``; a slot ``>= 0`` replaces the first tile's record by
            its full-precision copy in that slot.
        scale: softmax scale, default ``1 / sqrt(D)``.
        key, value: ``[Nq, Hkv, D]`` the step's own K/V (model frame, rows as ``query``'s), or
            ``None``: the step's tokens are then read from the tail slot, which holds them when
            they are tail tokens of one tile (decode); a sequence whose queries span tiles needs them.
        window: the layer's sliding window ``W`` (``None``: none): a query at position ``p`` sees keys
            ``p - W + 1 .. p``. Of sequence ``b`` only the tiles from ``(seq_lens[b] - n - W + 1) // G``
            on (the first query's window) are read, from the records or, for tile 0, the sink slot;
            the block-table entries before them may hold anything.
        sink_logits: ``[Hq]`` (any float dtype, taken as fp32) or ``None``: each query head's learned
            sink logit, raw (not times ``scale``), in the softmax denominator only (module docstring).
            Not the sink *slot* above, kvarn's full-precision first tile.
    """
    nq, hq, d = query.shape
    hkv = cache.shape[1]
    g = cfg.group_size
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if (key is None) != (value is None):
        raise ValueError("key and value come together")
    check_window(window)
    check_sink_logits(sink_logits, hq)
    batch = seq_lens.shape[0]
    if tail_slots.dim() == 2:  # own tiles kept as block rows: read them as a pool of one slot per sequence
        if sink_slots is not None:
            raise ValueError("a sink lives in a pool slot: pass tail_slots as [B] slots of that pool")
        tail_k, tail_v = (tail_tiles(rows, tail_slots[:batch], g) for rows in (tail_k, tail_v))
        tail_slots = torch.arange(batch, device=tail_slots.device)
    if query_start_loc is None:
        query_start_loc = torch.arange(batch + 1, device=query.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = rotate(query) if cfg.rotate else query.float()
    if key is not None:  # the step's tokens as a tail slot would hold them
        key, value = (from_pool(prepare(x, pool.dtype, cfg.rotate)) for pool, x in ((tail_k, key), (tail_v, value)))
    out = torch.zeros(nq, hq, d, dtype=torch.float32, device=query.device)
    spans, where, tiles, exact_k, exact_v = [], [], [], [], []
    n_tiles = 0
    for b in range(batch):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if q1 == q0:
            continue
        length = int(seq_lens[b])
        start = length - (q1 - q0)
        own, last = start // g, (length - 1) // g  # tiles of the first and last query
        seen = 0 if window is None else max(0, start - window + 1) // g  # the first tile in a window
        slot = int(tail_slots[b])
        if key is None:
            if last != own:
                raise ValueError(f"sequence {b}'s queries span tiles {own}..{last}: pass the step's key and value")
            xk, xv = (from_pool(pool[slot, : length - own * g]) for pool in (tail_k, tail_v))
        else:
            held = start - own * g  # the own tile's tokens before the step, in the slot
            xk, xv = (
                torch.cat([from_pool(pool[slot, :held]), x[q0:q1]]) for pool, x in ((tail_k, key), (tail_v, value))
            )
        tiles.append((block_table[b], last, -1 if sink_slots is None else int(sink_slots[b]), seen))
        where.append((length, seen * g, 1 + (n_tiles - seen) * g, own * g))
        n_tiles += last - seen
        exact_k.append(xk)
        exact_v.append(xv)
        spans.append((q0, q1))
    if spans:
        tk, tv = gather_sequences_tiles(cache, tiles, tail_k, tail_v, cfg)
        zero = tk.new_zeros(1, hkv, d)
        keys, values = torch.cat([zero, tk, *exact_k]).float(), torch.cat([zero, tv, *exact_v]).float()
        seqs, row = [], 1 + n_tiles * g  # rows: zeros, the tiles, then each sequence's exact tokens
        for (length, tiles_from, tiles_row, exact_from), x in zip(where, exact_k, strict=True):
            seqs.append(_Sequence(length, tiles_from, tiles_row, exact_from, row - exact_from))
            row += x.shape[0]
        outs = _attend_sequences([q[q0:q1] for q0, q1 in spans], keys, values, seqs, g, scale, window, sink_logits)
        for (q0, q1), o in zip(spans, outs, strict=True):
            out[q0:q1] = o
    if cfg.rotate:
        out = rotate(out)
    return out.to(query.dtype)
