"""Triton store path, host side: tiles -> cache records, and tokens -> tail pool.

The entry points check their arguments and launch the encode kernel (:mod:`kvarn.kernels.encode`:
Sinkhorn + RTN + packing in one launch) and the tail pool's kernels (:mod:`kvarn.kernels.tail`).
``prepare`` (sanitize, rotate, round) is a separate kernel shared by :func:`write_tail` and
:func:`store_tiles`, so both paths hand the encoder bit-identical tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels import _plan
from kvarn.kernels._common import (
    cdiv,
    check_cache,
    check_dtype,
    index_list,
    inv_sqrt,
    record_layout,
)
from kvarn.kernels.encode import _encode_kernel
from kvarn.kernels.launch_rules import default_encode_warps
from kvarn.kernels.tail import GATHER_ROWS, PREPARE_ROWS, _gather_tiles_kernel, _prepare_kernel


def _launch_encode(
    k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs=None, smooth_src=None
) -> None:
    if n_tiles == 0 or n_heads == 0:
        return
    src_idx, dst_idx, smooth_src = index_list(src_idx), index_list(dst_idx), index_list(smooth_src)
    if smooth_src is not None:  # per-sequence vectors: the first tiles publish theirs first
        _launch_encode_phase(
            k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, None, smooth_src, 0
        )
    _launch_encode_phase(
        k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs, smooth_src, 1
    )


def _launch_encode_phase(
    k, v, src_idx, n_tiles, n_heads, strides, dst, dst_idx, d_strides, cfg, num_warps, max_regs, smooth_src, phase=1
) -> None:
    iters = cfg.sinkhorn_iters if cfg.normalize else 0
    _encode_kernel[(n_tiles, n_heads, 2 if phase else 1)](
        k,
        v,
        src_idx if src_idx is not None else k,
        strides[0],
        strides[1],
        strides[2],
        dst,
        dst_idx if dst_idx is not None else dst,
        d_strides[0],
        d_strides[1],
        smooth_src if smooth_src is not None else dst,
        HAS_SRC_IDX=src_idx is not None,
        HAS_DST_IDX=dst_idx is not None,
        HAS_SMOOTH_SRC=smooth_src is not None,
        SMOOTH_PHASE=phase,
        IS_BF16=k.dtype == torch.bfloat16,
        LAYOUT=record_layout(cfg),
        ITERS=iters,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        K_CLIP_UNIT=(cfg.k_clip or (1, 1))[0],
        K_CLIP_COUNT=(cfg.k_clip or (1, 1))[1],
        V_CLIP_UNIT=(cfg.v_clip or (1, 1))[0],
        V_CLIP_COUNT=(cfg.v_clip or (1, 1))[1],
        num_warps=num_warps or default_encode_warps(cfg),
        maxnreg=max_regs,
    )


def _check_kv_tiles(k: torch.Tensor, v: torch.Tensor, cfg: KVarNConfig, layout: str) -> None:
    check_dtype("k", k)
    if v.dtype != k.dtype or v.shape != k.shape or v.device != k.device:
        raise ValueError(
            f"k and v must match in shape, dtype and device, got {tuple(k.shape)} {k.dtype} and "
            f"{tuple(v.shape)} {v.dtype}"
        )
    g_axis = -2 if layout == "tiles" else 1
    if k.dim() < (2 if layout == "tiles" else 4) or k.shape[-1] != cfg.head_dim or k.shape[g_axis] != cfg.group_size:
        want = "[..., G, D]" if layout == "tiles" else "[N, G, Hkv, D]"
        raise ValueError(
            f"k must have shape {want} with G = {cfg.group_size} and D = {cfg.head_dim}, got {tuple(k.shape)}"
        )


def encode_records(
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: KVarNConfig,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
) -> torch.Tensor:
    """Prepared tiles ``k, v: [..., G, D]`` (rotated, fp16/bf16, pool form) -> records ``[..., record_bytes]`` uint8.

    Knobs (keyword only, as for every store op): ``num_warps`` of the encode kernel (default
    :func:`~kvarn.kernels.launch_rules.default_encode_warps`) and ``max_regs``, its register cap per
    thread (default: none, ptxas picks); ``empty`` allocates outputs and workspaces (``torch.empty``'s
    signature; tests pass one that pre-fills them).
    """
    _check_kv_tiles(k, v, cfg, "tiles")
    lead = k.shape[:-2]
    kf = k.reshape(-1, cfg.group_size, cfg.head_dim).contiguous()
    vf = v.reshape(-1, cfg.group_size, cfg.head_dim).contiguous()
    n = kf.shape[0]
    out = empty(n, cfg.record_bytes, dtype=torch.uint8, device=k.device)
    strides = (kf.stride(0), kf.stride(1), 0)
    _launch_encode(kf, vf, None, n, 1, strides, out, None, (out.stride(0), 0), cfg, num_warps, max_regs)
    return out.reshape(*lead, cfg.record_bytes)


def commit_tiles(
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
) -> None:
    """Quantize full pool tiles ``tail_*[tail_slots[i]]`` (``[num_slots, G, Hkv, D]``) into ``cache[block_ids[i]]``.

    Entries with a negative slot are skipped: their programs exit at once (a fixed-size list's padding).
    ``smooth_src: [N]`` as in :func:`kvarn.reference.commit_tiles` (per-sequence smoothing only).
    """
    check_cache(cache, cfg)
    _check_pool(tail_k, tail_v, cache, cfg)
    if tail_slots.shape != block_ids.shape or tail_slots.dim() != 1:
        raise ValueError(
            f"tail_slots and block_ids must be [N] of one length, got {tuple(tail_slots.shape)} and "
            f"{tuple(block_ids.shape)}"
        )
    _check_smooth_src(smooth_src, block_ids, cfg)
    n = tail_slots.shape[0]
    strides = (tail_k.stride(0), tail_k.stride(1), tail_k.stride(2))
    _launch_encode(
        tail_k,
        tail_v,
        tail_slots,
        n,
        cache.shape[1],
        strides,
        cache,
        block_ids,
        (cache.stride(0), cache.stride(1)),
        cfg,
        num_warps,
        max_regs,
        smooth_src,
    )


def store_tiles(
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor,
    cache: torch.Tensor,
    cfg: KVarNConfig,
    smooth_src: torch.Tensor | None = None,
    *,
    num_warps: int | None = None,
    max_regs: int | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
) -> None:
    """Quantize whole model-frame tiles ``k, v: [N, G, Hkv, D]`` into ``cache[block_ids]``, in place.

    ``smooth_src: [N]`` as in :func:`kvarn.reference.store_tiles` (per-sequence smoothing only).

    Runs the :func:`write_tail` kernel into a ``[N, G, Hkv, D]`` workspace, then the
    :func:`commit_tiles` encoder: the same kernels as the tail path, so a tile gets the same bytes
    whichever path completed it (the extra pass costs 2 x 2 bytes per element of memory traffic,
    small next to the encoder's arithmetic).
    """
    check_cache(cache, cfg)
    _check_kv_tiles(k, v, cfg, "store")
    if k.dim() != 4 or k.shape[2] != cache.shape[1]:
        raise ValueError(f"k must be [N, G, Hkv, D] with Hkv = {cache.shape[1]}, got {tuple(k.shape)}")
    if block_ids.dim() != 1 or block_ids.shape[0] != k.shape[0]:
        raise ValueError(f"block_ids must be [N] with N = {k.shape[0]}, got {tuple(block_ids.shape)}")
    _check_smooth_src(smooth_src, block_ids, cfg)
    n, g, hkv, d = k.shape
    if n == 0:
        return
    work_k = empty((n, g, hkv, d), dtype=k.dtype, device=k.device)
    work_v = empty((n, g, hkv, d), dtype=k.dtype, device=k.device)
    mapping = torch.arange(n * g, device=k.device)
    write_tail(k.reshape(n * g, hkv, d), v.reshape(n * g, hkv, d), work_k, work_v, mapping, cfg)
    strides = (work_k.stride(0), work_k.stride(1), work_k.stride(2))
    tiles = torch.arange(n, dtype=torch.int32, device=k.device)  # same kernel variant as commit_tiles
    d_strides = (cache.stride(0), cache.stride(1))
    _launch_encode(
        work_k, work_v, tiles, n, hkv, strides, cache, block_ids, d_strides, cfg, num_warps, max_regs, smooth_src
    )


def _check_smooth_src(smooth_src: torch.Tensor | None, block_ids: torch.Tensor, cfg: KVarNConfig) -> None:
    """Raise unless ``smooth_src`` is given exactly for a ``seq_smooth`` format, shaped like ``block_ids``."""
    if cfg.seq_smooth != (smooth_src is not None):
        raise ValueError(
            "smooth_src (each tile's sequence's first block id) is needed by, and only by, smooth_scope='sequence' "
            f"formats; {cfg.name} has smooth_scope={cfg.smooth_scope!r}, smooth_keys={cfg.smooth_keys}"
        )
    if smooth_src is not None and (smooth_src.shape != block_ids.shape or smooth_src.device != block_ids.device):
        raise ValueError(
            f"smooth_src must be shaped like block_ids {tuple(block_ids.shape)} on its device, got "
            f"{tuple(smooth_src.shape)} on {smooth_src.device}"
        )


def _check_pool(tail_k: torch.Tensor, tail_v: torch.Tensor, cache: torch.Tensor, cfg: KVarNConfig) -> None:
    check_dtype("tail_k", tail_k)
    if tail_v.dtype != tail_k.dtype or tail_v.shape != tail_k.shape or tail_v.stride() != tail_k.stride():
        raise ValueError("tail_k and tail_v must match in shape, dtype and strides")
    want = (cfg.group_size, cache.shape[1], cfg.head_dim)
    if tail_k.dim() != 4 or tuple(tail_k.shape[1:]) != want:
        raise ValueError(f"tail_k must be [num_slots, {', '.join(map(str, want))}], got {tuple(tail_k.shape)}")
    if tail_k.stride(-1) != 1:
        raise ValueError("tail_k must be contiguous along head_dim")


def write_tail(
    k: torch.Tensor,
    v: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slot_mapping: torch.Tensor,
    cfg: KVarNConfig,
) -> None:
    """``prepare`` new tokens ``k, v: [T, Hkv, D]`` into the pool at ``tail_slot_mapping: [T]`` (``slot * R + offset``).

    ``R = tail_k.shape[1]``: ``G`` for a pool ``[num_slots, G, Hkv, D]``, fewer for tails kept as rows of a
    cache's blocks (``kvarn.paged.PagedKV.tail_block_view``). A negative mapping entry skips its token. The
    pool holds the pool form (:func:`kvarn.reference.prepare`: an fp16 pool the rotated values times
    ``1 / pool_factor``).
    Eager calls replay a launch plan per call shape (:data:`WRITE_TAIL_PLANS`, :mod:`kvarn.kernels._plan`).
    """
    inputs = (k, v, tail_k, tail_v, tail_slot_mapping)
    return WRITE_TAIL_PLANS.call(
        lambda: (cfg,),
        inputs,
        lambda empty: _write_tail(k, v, tail_k, tail_v, tail_slot_mapping, cfg),
    )


WRITE_TAIL_PLANS = _plan.Planner()
"""Launch plans of :func:`write_tail` (``WRITE_TAIL_PLANS.enabled = False`` turns replays off)."""


def _write_tail(k, v, tail_k, tail_v, tail_slot_mapping, cfg: KVarNConfig) -> None:
    """:func:`write_tail` itself (the launcher its plans record)."""
    check_dtype("k", k)
    check_dtype("tail_k", tail_k)
    if v.shape != k.shape or v.dtype != k.dtype or k.dim() != 3 or k.shape[-1] != cfg.head_dim:
        raise ValueError(f"k and v must both be [T, Hkv, {cfg.head_dim}] of one dtype, got {tuple(k.shape)}")
    if tail_v.dtype != tail_k.dtype or tail_v.shape != tail_k.shape or tail_v.stride() != tail_k.stride():
        raise ValueError("tail_k and tail_v must match in shape, dtype and strides")
    if tail_k.dim() != 4 or not 0 < tail_k.shape[1] <= cfg.group_size or tail_k.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"tail_k must be [num_slots, rows <= {cfg.group_size}, {k.shape[1]}, {cfg.head_dim}], "
            f"got {tuple(tail_k.shape)}"
        )
    if tail_slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"tail_slot_mapping must be [T] with T = {k.shape[0]}, got {tuple(tail_slot_mapping.shape)}")
    if k.shape[0] == 0:
        return
    if k.stride() != v.stride() or k.stride(-1) != 1:  # one set of strides for both (vLLM's views of qkv share them)
        k, v = k.contiguous(), v.contiguous()
    tail_slot_mapping = index_list(tail_slot_mapping)
    if tail_k.stride(-1) != 1:
        raise ValueError("tail_k must be contiguous along head_dim")
    n_heads = k.shape[1]
    n_rows = k.shape[0] * n_heads
    _plan.launch(
        _prepare_kernel,
        (cdiv(n_rows, PREPARE_ROWS), 2),
        k,
        v,
        tail_k,
        tail_v,
        tail_slot_mapping,
        n_rows,
        n_heads,
        k.stride(0),
        k.stride(1),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        LAYOUT=record_layout(cfg),
        ROWS=PREPARE_ROWS,
        ROTATE=cfg.rotate,
        IN_BF16=k.dtype == torch.bfloat16,
        POOL_BF16=tail_k.dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        SLOT_ROWS=tail_k.shape[1],
        num_warps=4,
    )


def gather_tail_tiles(
    rows_k: torch.Tensor,
    rows_v: torch.Tensor,
    tables: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Copy whole tiles kept as block rows into pool slots. See :func:`kvarn.reference.gather_tail_tiles`.

    One launch of ``len(slots)`` programs per ``GATHER_ROWS`` rows; padding entries (negative slots)
    exit at once, so a captured graph can launch a fixed-size list.
    """
    check_dtype("tail_k", tail_k)
    g, heads, d = tail_k.shape[1:]
    for name, x in (("rows_k", rows_k), ("rows_v", rows_v), ("tail_v", tail_v)):
        if x.dtype != tail_k.dtype or x.dim() != 4 or tuple(x.shape[2:]) != (heads, d) or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [*, *, {heads}, {d}] {tail_k.dtype} with unit last stride")
    if rows_v.shape != rows_k.shape or rows_v.stride() != rows_k.stride() or tail_v.stride() != tail_k.stride():
        raise ValueError("rows_k and rows_v, tail_k and tail_v must match in shape and strides")
    rows = rows_k.shape[1]
    if tables.dim() != 2 or tables.shape[1] * rows < g:
        raise ValueError(f"tables must be [num_slots, N] with N * {rows} >= {g}, got {tuple(tables.shape)}")
    if slots.dim() != 1:
        raise ValueError(f"slots must be [N], got {tuple(slots.shape)}")
    if slots.numel() == 0:
        return
    tables, slots = index_list(tables), index_list(slots)
    _plan.launch(
        _gather_tiles_kernel,
        (slots.shape[0], cdiv(g * heads, GATHER_ROWS), 2),
        rows_k,
        rows_v,
        tables,
        tail_k,
        tail_v,
        slots,
        heads,
        tables.stride(0),
        rows_k.stride(0),
        rows_k.stride(1),
        rows_k.stride(2),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        G=g,
        D=d,
        R=rows,
        ROWS=GATHER_ROWS,
        num_warps=4,
    )
