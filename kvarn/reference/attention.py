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
"""

from __future__ import annotations

import math

import torch

from kvarn.config import KVarNConfig
from kvarn.reference.cache import gather_tiles, tail_tiles
from kvarn.reference.hadamard import rotate
from kvarn.reference.quantize import from_pool, prepare

BLOCK = 64
"""Queries and keys are taken in blocks of this many positions (see :func:`attend`)."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of the last ``n`` positions.

    ``q: [n, Hq, D]``, ``k, v: [L, Hkv, D]`` -> ``[n, Hq, D]`` fp32.

    Length-invariant: a query's output depends only on its own position and the keys up to it,
    bit for bit, not on how many queries or keys surround it. Queries go in blocks of
    :data:`BLOCK` aligned to absolute positions (padded to full blocks, so every matrix product
    has the same shape), keys in blocks of :data:`BLOCK` in order with an online softmax, and a
    key block wholly in a query's future adds exact zeros. A prompt's attention, and so the K/V
    of the layers after it, then come out the same whether the prompt is computed alone or as
    the prefix of a longer one: prefix caching changes no stored byte.
    """
    return attend_own_tile(q, (k, v), (k, v), 0, BLOCK, scale)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, scale: float):
    """Queries at positions ``start .. start + BLOCK`` (``q: [BLOCK, Hkv, group, D]``) over keys ``0 .. end``."""
    pos_q = torch.arange(start, start + BLOCK, device=q.device)[:, None]
    m = torch.full((BLOCK, *q.shape[1:3], 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for lo in range(0, end, BLOCK):
        kb = q.new_zeros(BLOCK, *k.shape[1:])
        vb = q.new_zeros(BLOCK, *v.shape[1:])
        hi = min(lo + BLOCK, end)
        kb[: hi - lo], vb[: hi - lo] = k[lo:hi].float(), v[lo:hi].float()
        s = torch.einsum("qhgd,khd->qhgk", q, kb) * scale  # [BLOCK, Hkv, group, BLOCK]
        future = torch.arange(lo, lo + BLOCK, device=q.device)[None, :] > pos_q  # also hides the block's padding
        s = s.masked_fill(future[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        seen = torch.isfinite(m_new)  # rows that have met a key
        alpha = torch.where(seen, torch.exp(m - m_new), 1.0)
        p = torch.where(seen, torch.exp(s - m_new), 0.0)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.einsum("qhgk,khd->qhgd", p, vb)
        m = m_new
    return acc / denom.clamp(min=torch.finfo(torch.float32).tiny)


def attend_own_tile(
    q: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    exact_from: int,
    group_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of the last ``n`` positions under the own-tile rule -> ``[n, Hq, D]`` fp32.

    ``tiles = (k, v)``: ``[m * G, Hkv, D]``, the sequence's first ``m`` tiles as attention reads
    them from the records; ``exact = (k, v)``: positions ``exact_from ..`` in full precision
    (``exact_from`` a multiple of ``G``). A query in tile ``t`` sees tiles ``< t`` from ``tiles``
    and the rest of its keys from ``exact``. Length-invariant as :func:`attend` (its blocks of
    :data:`BLOCK` queries never straddle a tile, since ``G`` is a multiple of it); :func:`attend` is
    the case of one set of keys.
    """
    n, hq, d = q.shape
    hkv = tiles[0].shape[1]
    g = group_size
    length = exact_from + exact[0].shape[0]
    first = length - n
    lo = first // BLOCK * BLOCK
    rows = math.ceil((length - lo) / BLOCK) * BLOCK
    qp = q.new_zeros(rows, hq, d, dtype=torch.float32)
    qp[first - lo : first - lo + n] = q.float()
    qp = qp.view(rows // BLOCK, BLOCK, hkv, hq // hkv, d)
    out = torch.empty(rows // BLOCK, BLOCK, hkv, hq // hkv, d, device=q.device)
    for i in range(rows // BLOCK):
        start = lo + i * BLOCK
        own = start // g * g  # the block's tile
        end = min(start + BLOCK, length)
        k = torch.cat([tiles[0][:own], exact[0][own - exact_from : end - exact_from]])
        v = torch.cat([tiles[1][:own], exact[1][own - exact_from : end - exact_from]])
        out[i] = _attend_block(qp[i], k, v, start, end, scale)
    return out.view(rows, hq, d)[first - lo : first - lo + n]


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
) -> torch.Tensor:
    """Attention of ``query: [Nq, Hq, D]`` over a paged KVarN cache -> ``[Nq, Hq, D]`` in ``query.dtype``.

    Every query follows the own-tile rule (module docstring).

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
    """
    nq, hq, d = query.shape
    hkv = cache.shape[1]
    g = cfg.group_size
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if (key is None) != (value is None):
        raise ValueError("key and value come together")
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
    out = torch.empty(nq, hq, d, dtype=torch.float32, device=query.device)
    for b in range(batch):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if q1 == q0:
            continue
        length = int(seq_lens[b])
        start = length - (q1 - q0)
        own, last = start // g, (length - 1) // g  # tiles of the first and last query
        sink = -1 if sink_slots is None else int(sink_slots[b])
        tiles = gather_tiles(cache, block_table[b], last, tail_k, tail_v, cfg, sink)
        slot = int(tail_slots[b])
        if key is None:
            if last != own:
                raise ValueError(f"sequence {b}'s queries span tiles {own}..{last}: pass the step's key and value")
            exact = tuple(from_pool(pool[slot, : length - own * g]) for pool in (tail_k, tail_v))
        else:
            held = start - own * g  # the own tile's tokens before the step, in the slot
            exact = tuple(
                torch.cat([from_pool(pool[slot, :held]), from_pool(prepare(x[q0:q1], pool.dtype, cfg.rotate))])
                for pool, x in ((tail_k, key), (tail_v, value))
            )
        out[q0:q1] = attend_own_tile(q[q0:q1], tiles, exact, own * g, g, scale)
    if cfg.rotate:
        out = rotate(out)
    return out.to(query.dtype)
