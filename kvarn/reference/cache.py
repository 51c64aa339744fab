"""The paged KVarN cache: store tokens, commit tiles, gather a sequence back.

Storage a KVarN attention layer owns:

- ``cache: [num_blocks, Hkv, record_bytes]`` uint8: one record per (full tile, KV head), the
  block id being vLLM's (a block is one tile of ``G`` tokens).
- ``tail_k, tail_v: [num_slots, G, Hkv, D]`` in the model dtype: a pool of full-precision tiles in
  the rotated frame, in the pool form of :func:`~kvarn.reference.quantize.prepare` (an fp16 pool
  holds the rotated values times ``2^-POOL_EXP`` so the rotation never saturates it; readers go
  through :func:`~kvarn.reference.quantize.from_pool`). A sequence's last, not yet full tile
  lives in one slot (its *tail slot*); where the fp16 sink is used, the sequence's first tile
  also keeps a full-precision copy in a slot (its *sink slot*). How slots are handed out is the
  integration's business.

Tokens reach a record on one of two paths, which give identical bytes because both quantize
:func:`~kvarn.reference.quantize.prepare`'d values: :func:`write_tail` then :func:`commit_tiles`
(decode, chunks ending inside a tile), or :func:`store_tiles` (whole tiles of a prompt).

Formats with one smoothing vector per sequence (``cfg.seq_smooth``) need to know each tile's
sequence: both take ``smooth_src``, the block id of the sequence's first record (its block table
entry 0). A tile whose ``smooth_src`` is its own block id is a first tile: the vector comes from it
(:func:`~kvarn.reference.smooth.sequence_smoothing_vector`) and is written into its record; every
other tile reads the vector from the ``k_smooth`` field of record ``smooth_src``, which must hold
its sequence's first tile already or receive it in the same call.
"""

from __future__ import annotations

import torch

from kvarn.config import SMOOTH_FIELD, KVarNConfig
from kvarn.reference.quantize import from_pool, prepare
from kvarn.reference.record import decode_records, encode_records
from kvarn.reference.smooth import SMOOTH_DTYPE, sequence_smoothing_vector


def write_tail(
    k: torch.Tensor,
    v: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    cfg: KVarNConfig,
) -> None:
    """Rotate new tokens ``k, v: [T, Hkv, D]`` into the tail pool, in place.

    ``tail_slot_mapping: [T]`` holds ``slot * R + offset`` for each token, ``R = tail_k.shape[1]``
    rows a slot: ``G`` for a pool, a tail block's rows for tails in a cache's blocks
    (:func:`tail_tiles`); a negative entry (vLLM's padding) skips the token.
    """
    g = tail_k.shape[1]
    keep = tail_slot_mapping >= 0
    idx = tail_slot_mapping[keep].long()
    slot, off = idx // g, idx % g
    tail_k[slot, off] = prepare(k[keep], tail_k.dtype, cfg.rotate)
    tail_v[slot, off] = prepare(v[keep], tail_v.dtype, cfg.rotate)


def tail_tiles(rows: torch.Tensor, tables: torch.Tensor, group_size: int) -> torch.Tensor:
    """Tiles kept as rows of blocks, read as pool tiles: ``rows: [num_blocks, R, Hkv, D]``, ``tables: [B, N]``
    -> ``[B, G, Hkv, D]``.

    Row ``j`` of tile ``b`` is row ``j % R`` of block ``tables[b, j // R]`` (``N * R >= G``). Tails
    in a cache's own blocks (``kvarn.paged.PagedKV.tail_block_view``) are addressed this way; a pool
    is the case ``R = G``, ``N = 1``, ``tables[b, 0]`` the slot.
    """
    r = rows.shape[1]
    if tables.dim() != 2 or tables.shape[1] * r < group_size:
        raise ValueError(f"tables must be [B, N] with N * {r} >= {group_size} rows a tile, got {tuple(tables.shape)}")
    j = torch.arange(group_size, device=tables.device)
    return rows[tables[:, j // r].long(), j % r]


def gather_tail_tiles(
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
    tables: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Copy whole tiles kept as block rows into pool slots, in place: ``tail_*[s] = tail_tiles(rows_*, tables)[s]``
    for each ``s`` of ``slots: [N]`` (a negative entry skips). ``tables`` is indexed by slot: row ``s`` names
    the blocks of the tile that goes to slot ``s`` (every listed slot below ``len(tables)``).

    The commit of a tile kept in a cache's blocks (a decode step that fills it) reads it from the
    pool this copy fills (:meth:`kvarn.paged.PagedKV.commit_block_tails`).
    """
    keep = slots[slots >= 0].long()
    if keep.numel() == 0:
        return
    g = tail_k.shape[1]
    tail_k[keep] = tail_tiles(rows_k, tables[keep], g)
    tail_v[keep] = tail_tiles(rows_v, tables[keep], g)


def commit_tiles(
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
) -> None:
    """Quantize full tail tiles ``tail_*[tail_slots[i]]`` into ``cache[block_ids[i]]``, in place.

    ``tail_slots, block_ids: [N]``; an entry with a negative slot is skipped (fixed-size padded
    lists, as a captured CUDA graph needs). The caller promises every token of those tiles is
    written and committed (no speculative drafts).
    ``smooth_src: [N]``: see the module docstring (``cfg.seq_smooth`` formats only).
    """
    _check_smooth_src(smooth_src, block_ids, cfg)
    keep = tail_slots >= 0
    tail_slots, block_ids = tail_slots[keep], block_ids[keep]
    if smooth_src is not None:
        smooth_src = smooth_src[keep]
    if tail_slots.numel() == 0:
        return
    k = tail_k[tail_slots.long()].transpose(1, 2)  # [N, Hkv, G, D]
    v = tail_v[tail_slots.long()].transpose(1, 2)
    _encode_into(k, v, block_ids, smooth_src, cache, cfg)


def store_tiles(
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
) -> None:
    """Quantize whole tiles ``k, v: [N, G, Hkv, D]`` (model frame) into ``cache[block_ids]``, in place.

    ``smooth_src: [N]``: see the module docstring (``cfg.seq_smooth`` formats only).
    """
    _check_smooth_src(smooth_src, block_ids, cfg)
    if block_ids.numel() == 0:
        return
    kr = prepare(k, k.dtype, cfg.rotate).transpose(1, 2)  # [N, Hkv, G, D]
    vr = prepare(v, v.dtype, cfg.rotate).transpose(1, 2)
    _encode_into(kr, vr, block_ids, smooth_src, cache, cfg)


def _check_smooth_src(smooth_src: torch.Tensor | None, block_ids: torch.Tensor, cfg: KVarNConfig) -> None:
    """Raise unless ``smooth_src`` is given exactly for a ``seq_smooth`` format, shaped like ``block_ids``."""
    if cfg.seq_smooth and smooth_src is None:
        raise ValueError(
            f"{cfg.name} with smooth_scope='sequence' needs smooth_src: each tile's sequence's first block id"
        )
    if not cfg.seq_smooth and smooth_src is not None:
        raise ValueError("smooth_src applies to smooth_scope='sequence' formats only")
    if smooth_src is not None and smooth_src.shape != block_ids.shape:
        raise ValueError(
            f"smooth_src must be shaped like block_ids {tuple(block_ids.shape)}, got {tuple(smooth_src.shape)}"
        )


def _encode_into(
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    smooth_src: torch.Tensor | None,
    cache: torch.Tensor,
    cfg: KVarNConfig,
) -> None:
    """Encode prepared tiles ``k, v: [N, Hkv, G, D]`` into ``cache[block_ids]`` (vectors from ``smooth_src``)."""
    ids = block_ids.long()
    if smooth_src is None:
        cache[ids] = encode_records(k, v, cfg)
        return
    src = smooth_src.long()
    first = src == ids
    lo = cfg.offsets[SMOOTH_FIELD]
    field = slice(lo, lo + cfg.smooth_bytes)
    # first tiles publish their sequence's vector, then every tile reads its own from its source record
    # (no host sync: every tile's candidate is computed, the first tiles' are kept)
    own = sequence_smoothing_vector(from_pool(k)).to(SMOOTH_DTYPE).view(torch.uint8)  # [N, Hkv, D]
    cache[ids, :, field] = torch.where(first[:, None, None], own, cache[ids, :, field])
    s = cache[src, :, field].contiguous().view(SMOOTH_DTYPE).float()  # [N, Hkv, D]
    cache[ids] = encode_records(k, v, cfg, s)


def gather_tiles(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    n_tiles: int,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    cfg: KVarNConfig,
    sink_slot: int = -1,
    first_tile: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's tiles ``first_tile .. n_tiles - 1`` as attention reads them: ``[(n_tiles - first_tile) * G, Hkv,
    D]`` fp32, rotated frame.

    Dequantized from ``cache[block_ids[first_tile:n_tiles]]`` (the entries before ``first_tile`` are
    not read: a sliding window has left them); with ``sink_slot >= 0`` tile 0, where gathered, is
    read from that pool slot in full precision instead of its record.
    """
    return gather_sequences_tiles(cache, [(block_ids, n_tiles, sink_slot, first_tile)], tail_k, tail_v, cfg)


def gather_sequences_tiles(
    cache: torch.Tensor,
    sequences: list[tuple[torch.Tensor, int, int, int]],
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    cfg: KVarNConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_tiles` of several sequences, one after another, in one decode of their records.

    ``sequences`` holds each sequence's ``(block_ids, n_tiles, sink_slot, first_tile)``, the
    arguments of :func:`gather_tiles`.
    """
    g = cfg.group_size
    ids, sinks, at = [], [], 0
    for block_ids, n_tiles, sink_slot, first_tile in sequences:
        n = max(n_tiles - first_tile, 0)
        ids.append(block_ids[first_tile : first_tile + n].long())
        if sink_slot >= 0 and n > 0 and first_tile == 0:
            sinks.append((at, sink_slot))
        at += n
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=cache.device)
    k, v = decode_records(cache[ids], cfg)  # [n, Hkv, G, D]
    k = k.transpose(1, 2).reshape(at * g, *k.shape[1:2], cfg.head_dim)
    v = v.transpose(1, 2).reshape(at * g, *v.shape[1:2], cfg.head_dim)
    for tile, slot in sinks:
        k[tile * g : (tile + 1) * g] = from_pool(tail_k[slot])
        v[tile * g : (tile + 1) * g] = from_pool(tail_v[slot])
    return k, v
