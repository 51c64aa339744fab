"""Cache records and K/V rows read back as pages: model-frame values in the attention dtype.

A prompt chunk that attends through a varlen call (``kvarn.paged.PagedKV.read_pages``) reads its
keys and values as pages ``[P, G, Hkv, D]`` in the attention dtype (fp16/bf16, or fp32), in the
model frame (not rotated). Three kinds of rows fill them:

- record tiles: ``decode_records`` (rotated fp32), ``@ H``, cast (:func:`records_to_pages`); a
  sequence's first tile with a sink slot comes from that pool slot instead;
- pool rows (the tokens of a query tile from before the step, and the sinks): ``from_pool``,
  ``@ H``, cast (:func:`rows_to_pages` with ``from_model=False``);
- the step's own model-frame K/V: through the pool form first, ``prepare`` to the pool dtype, then
  ``from_pool``, ``@ H``, cast (:func:`rows_to_pages`, ``from_model=True``), so a step's token has
  exactly the value a tail slot would hold (the own-tile rule, :func:`kvarn.reference.paged_attention`).

The way back from the rotated frame is one fp32 matrix product with ``H``
(:func:`~kvarn.reference.hadamard.hadamard_matrix`), then ``.to(dtype)`` (round to nearest even,
``inf`` past the dtype's range). :func:`write_record_pages` and :func:`write_row_pages` write those
values into pages at given indices: the signatures of the Triton kernels (``kvarn.kernels.pages``).
"""

from __future__ import annotations

import torch

from kvarn.config import KVarNConfig
from kvarn.reference.hadamard import hadamard_matrix
from kvarn.reference.quantize import from_pool, prepare
from kvarn.reference.record import decode_records


def _model_frame(x: torch.Tensor, cfg: KVarNConfig) -> torch.Tensor:
    """Rotated fp32 ``x: [..., D]`` back to the model frame: ``x @ H`` (fp32 matmul), or ``x`` unrotated formats."""
    return x @ hadamard_matrix(x.shape[-1], x.device) if cfg.rotate else x


def records_to_pages(records: torch.Tensor, cfg: KVarNConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``[N, Hkv, record_bytes]`` uint8 -> ``k, v: [N, G, Hkv, D]`` in ``dtype``, model frame.

    ``decode_records`` (fp32, rotated, ``[N, Hkv, G, D]``), ``@ H``, tokens before heads, cast.
    """
    k, v = decode_records(records, cfg)
    return tuple(_model_frame(x, cfg).transpose(-3, -2).to(dtype) for x in (k, v))


def rows_to_pages(
    x: torch.Tensor,
    cfg: KVarNConfig,
    dtype: torch.dtype,
    pool_dtype: torch.dtype | None = None,
    from_model: bool = True,
) -> torch.Tensor:
    """K or V rows ``x: [..., D]`` -> their page values ``[..., D]`` in ``dtype``, model frame.

    ``from_model``: ``x`` holds model-frame values; they take the pool form first
    (``prepare(x, pool_dtype, cfg.rotate)``, ``pool_dtype`` default ``x.dtype``), exactly what a
    tail slot of that dtype holds. Else ``x`` is already in the pool form (rows of a pool). Then
    ``from_pool``, ``@ H`` and the cast.
    """
    if from_model:
        x = prepare(x, pool_dtype or x.dtype, cfg.rotate)
    return _model_frame(from_pool(x), cfg).to(dtype)


def write_record_pages(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    tiles: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cfg: KVarNConfig,
    tail_k: torch.Tensor | None = None,
    tail_v: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
) -> None:
    """Page ``n`` of ``k_pages, v_pages: [P, G, Hkv, D]`` <- the record tile ``cache[block_table[rows[n], tiles[n]]]``.

    ``rows, tiles: [N]`` (``N <= P``): each page's batch row and tile index in ``block_table: [B, W]``;
    ``cache: [num_blocks, Hkv, record_bytes]``. Values of :func:`records_to_pages` in the pages'
    dtype. With ``sink_slots: [B]`` (pool slots, ``-1`` for none) an entry with ``tiles[n] == 0``
    whose row has a sink is read from pool slot ``sink_slots[rows[n]]`` of ``tail_k, tail_v:
    [S, G, Hkv, D]`` instead (:func:`rows_to_pages` of the pool form). Pages ``N ..`` are not touched.
    """
    rows, tiles = rows.long(), tiles.long()
    n = rows.shape[0]
    if not n:
        return
    blocks = block_table[rows, tiles].long()
    for pages, x in zip((k_pages, v_pages), records_to_pages(cache[blocks], cfg, k_pages.dtype), strict=True):
        pages[:n] = x
    if sink_slots is None:
        return
    slot = torch.where(tiles == 0, sink_slots[rows].long(), -1)
    take = (slot >= 0).nonzero().flatten()
    if take.numel():
        for pages, pool in ((k_pages, tail_k), (v_pages, tail_v)):
            pages[take] = rows_to_pages(pool.index_select(0, slot[take]), cfg, pages.dtype, from_model=False)


def write_row_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    dst: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cfg: KVarNConfig,
    from_model: bool,
    slots: torch.Tensor | None = None,
    pool_dtype: torch.dtype | None = None,
) -> None:
    """Row ``dst[i]`` of the flat pages (``k_pages.view(-1, Hkv, D)``) <- source row ``rows[i]``, for K and V.

    ``from_model``: ``k, v: [T, Hkv, D]`` model-frame K/V and ``rows`` indexes their tokens; they go
    through the pool form of ``pool_dtype`` (:func:`rows_to_pages`). Else ``k, v: [S, G, Hkv, D]`` are
    pools (pool form) and ``rows`` indexes ``k[slots].reshape(-1, Hkv, D)`` (``slots: [B]``; without
    it, ``k.reshape(-1, Hkv, D)``). ``rows, dst: [R]``; a negative ``rows[i]`` writes zeros (the
    unused rows of a page).
    """
    rows, dst = rows.long(), dst.long()
    valid = rows >= 0
    for x, pages in ((k, k_pages), (v, v_pages)):
        flat = pages.view(-1, *pages.shape[2:])
        if not from_model:
            x = x if slots is None else x.index_select(0, slots.long())
            x = x.reshape(-1, *x.shape[2:])
        src = x.index_select(0, rows[valid])
        flat.index_copy_(0, dst[valid], rows_to_pages(src, cfg, pages.dtype, pool_dtype, from_model))
        flat.index_fill_(0, dst[~valid], 0)
