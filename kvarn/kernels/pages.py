"""Triton read-back of pages: cache records and K/V rows -> model-frame pages in the attention dtype.

Mirrors :mod:`kvarn.reference.pages` (:func:`write_record_pages`, :func:`write_row_pages`, the
reference's signatures) and writes straight into the pages ``[P, G, Hkv, D]`` (fp16/bf16): no fp32
intermediate tensor, no gathered copy of the records, no transpose or cast launch. Each page
element is written once; reads are the records (or pool tiles) and the source rows, once.

- :func:`write_record_pages`, grid ``(N, Hkv, 2)``: one program per (page, KV head, K or V). It
  reads its block id from the block table (``block_table[rows[n], tiles[n]]``), dequantizes the
  tile half (``dequant._dequant_values``, compiled without FMA contraction as ``decode_records``
  is), leaves the rotated frame with two tf32 dots on a hi/lo split of the fp32 values
  (``_common.hdot``: the ``+-1`` Hadamard's products exact, ~22 bits of each value kept), casts
  and stores ``pages[n, :, h, :]``. A smoothed K half (``smooth_keys``) is multiplied by its stored
  ``s`` in the model frame (the reference un-smooths in the rotated frame and then rotates: the
  same value to fp32 rounding). A first tile (``tiles[n] == 0``) whose row has a sink slot reads
  the pool tile instead: pool-form values are exact in tf32, so one dot per product.
- :func:`write_row_pages`, grid ``(cdiv(R * Hkv, PREPARE_ROWS), 2)``: ``PREPARE_ROWS`` (row, KV
  head) pairs of K or V per program. ``FROM_MODEL``: the model-frame rows take the pool form by
  ``tail.prepare_rows``, the helper ``write_tail``'s kernel calls (with the same block of rows and
  the same 4 warps, so the same tensor-core rotation): a step's token gets the bits
  ``write_tail`` would store in a tail slot (the own-tile rule). Then, as for pool rows (the
  head slot's tokens), ``* pool_factor``, ``@ H`` (one tf32 dot, exact products), cast, store at
  flat page row ``dst[i]``. A negative source row writes zeros.

The casts round to nearest even (``inf`` past the dtype's range), as ``.to(dtype)`` does. Against
the reference (an fp32 matmul with ``H``) only the fp32 summation order differs, and for records
the hi/lo split's truncation (relative ``2^-22`` of each value): a page element can be one ulp of
the page dtype off where its fp32 value lies near a rounding boundary, or an element much smaller
than its row (cancellation) off by a small multiple of ``2^-24`` of the row's magnitude
(``tests/test_kernels_pages.py`` allows ``2^-16``). ``cfg.rotate=False`` formats skip the rotations; their
record pages then equal the reference's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn.config import KVarNConfig
from kvarn.kernels._common import (
    KERNEL_DTYPES,
    STEP_COUNTS,
    cdiv,
    check_cache,
    check_dtype,
    fp8e4m3_to_f32,
    hadamard_pm,
    hdot,
    index_list,
    inv_sqrt,
    load_f32,
    pool_factor,
    record_layout,
    rotate_rows,
    store_model,
)
from kvarn.kernels.dequant import _dequant_values, dequant_block
from kvarn.kernels.launch_rules import record_pages_warps
from kvarn.kernels.tail import PREPARE_ROWS, prepare_rows


@triton.jit
def _halves(x, HALF: tl.constexpr):
    """Columns ``[:HALF]`` and ``[HALF:]`` of ``x: [R, 2 HALF]``."""
    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, HALF)), (0, 2, 1)))  # [R, HALF, 2] -> 2 x [R, HALF]


@triton.jit
def _rotate_halves(x1, x2, INV_SQRT_D: tl.constexpr):
    """``[x1, x2] @ H_2n`` as its two column halves (``H_2n = [[H, H], [H, -H]] / sqrt 2``), tf32 dots:
    ``rotate_rows_split``'s arithmetic, left as halves. ``x1, x2: [R, HALF]`` exact in tf32."""
    h = hadamard_pm(x1.shape[1])
    y1 = tl.dot(x1, h, input_precision="tf32")
    y2 = tl.dot(x2, h, input_precision="tf32")
    return (y1 + y2) * INV_SQRT_D, (y1 - y2) * INV_SQRT_D


@triton.jit
def _store_cols(rows, keep, y, C0: tl.constexpr, PAGE_BF16: tl.constexpr):
    """``y: [R, B]`` fp32 cast (nearest even) into channels ``C0 .. C0 + B`` of the page rows at ``rows: [R]``."""
    ch = C0 + tl.arange(0, y.shape[1])
    store_model(rows[:, None] + ch[None, :], y, keep[:, None] & (ch[None, :] >= 0), PAGE_BF16)


@triton.jit
def _pool_rows_to_page(
    src,
    ok,
    out,
    keep,
    D: tl.constexpr,
    POOL_BF16: tl.constexpr,
    PAGE_BF16: tl.constexpr,
    ROTATE: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Pool-form rows at ``src: [R]`` (row pointers, ``ok`` masks them: 0) -> ``* pool_factor``, ``@ H``, cast ->
    page rows at ``out: [R]`` (``keep`` masks them). The pool form is exact in tf32: one dot per product."""
    FACTOR: tl.constexpr = pool_factor(D, POOL_BF16)
    if ROTATE and D > 128:
        HALF: tl.constexpr = D // 2
        ch = tl.arange(0, HALF)
        m = ok[:, None] & (ch[None, :] < HALF)
        x1 = load_f32(src[:, None] + ch[None, :], m, POOL_BF16) * FACTOR
        x2 = load_f32(src[:, None] + HALF + ch[None, :], m, POOL_BF16) * FACTOR
        y1, y2 = _rotate_halves(x1, x2, INV_SQRT_D)
        _store_cols(out, keep, y1, 0, PAGE_BF16)
        _store_cols(out, keep, y2, HALF, PAGE_BF16)
    else:
        ch = tl.arange(0, D)
        x = load_f32(src[:, None] + ch[None, :], ok[:, None] & (ch[None, :] < D), POOL_BF16) * FACTOR
        if ROTATE:
            x = rotate_rows(x, D, INV_SQRT_D)
        _store_cols(out, keep, x, 0, PAGE_BF16)


@triton.jit
def _dequant_cols(rec, half, C0: tl.constexpr, B: tl.constexpr, L: tl.constexpr):
    """Channels ``C0 .. C0 + B`` of the K (``half`` 0) or V half of record ``rec``, dequantized: ``[G, B]`` fp32
    (``D > 128``; :func:`~kvarn.kernels.dequant.dequant_block`)."""
    if half == 0:
        x = tl.trans(dequant_block(rec, C0, B, 0, L.G, L.D, L.G, L.K_BITS, L.K_CODES, L.K_SCALE, L.K_ZERO, L.K_TOK))
    else:
        x = dequant_block(rec, 0, L.G, C0, B, L.G, L.D, L.V_BITS, L.V_CODES, L.V_SCALE, L.V_ZERO, L.V_CHAN)
    return x


@triton.jit
def _smooth_factor(rec, half, C0: tl.constexpr, B: tl.constexpr, L: tl.constexpr):
    """Channels ``C0 .. C0 + B`` of a smoothed K half's stored ``s`` (``half`` 0), ones for V: ``[B]`` fp32."""
    s = fp8e4m3_to_f32(tl.load(rec + L.K_SMOOTH + C0 + tl.arange(0, B)))
    return tl.where(half == 0, s, 1.0)


@triton.jit
def _record_half_to_page(rec, out, half, L: tl.constexpr, PAGE_BF16: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """The K (``half`` 0) or V half of record ``rec`` -> model frame -> page rows at ``out: [G]``.

    Dequantized in fp32 (``dequant._dequant_values``), then ``@ H`` as two tf32 dots on a hi/lo split
    (``hdot``: the +-1 products exact, ~22 bits of each value kept); ``D > 128`` in channel halves of
    ``H_2n = [[H, H], [H, -H]]``. A smoothed K half is multiplied by its ``s`` in the model frame.
    """
    keep = tl.arange(0, L.G) >= 0
    if L.D > 128:
        HALF: tl.constexpr = L.D // 2
        h = hadamard_pm(HALF)
        p1 = hdot(_dequant_cols(rec, half, 0, HALF, L), h)  # [G, HALF]
        p2 = hdot(_dequant_cols(rec, half, HALF, HALF, L), h)
        y1 = (p1 + p2) * INV_SQRT_D
        y2 = (p1 - p2) * INV_SQRT_D
        if L.K_SMOOTH >= 0:
            y1 = y1 * _smooth_factor(rec, half, 0, HALF, L)[None, :]
            y2 = y2 * _smooth_factor(rec, half, HALF, HALF, L)[None, :]
        _store_cols(out, keep, y1, 0, PAGE_BF16)
        _store_cols(out, keep, y2, HALF, PAGE_BF16)
    else:
        if half == 0:
            x = tl.trans(_dequant_values(rec, L.D, L.G, L.K_BITS, L.K_CODES, L.K_SCALE, L.K_ZERO, L.K_TOK))
        else:
            x = _dequant_values(rec, L.G, L.D, L.V_BITS, L.V_CODES, L.V_SCALE, L.V_ZERO, L.V_CHAN)  # [G, D]
        y = hdot(x, hadamard_pm(L.D)) * INV_SQRT_D
        if L.K_SMOOTH >= 0:
            y = y * _smooth_factor(rec, half, 0, L.D, L)[None, :]
        _store_cols(out, keep, y, 0, PAGE_BF16)


@triton.jit
def _record_pages_kernel(
    cache,
    c_block,
    c_head,
    block_table,
    bt_row,
    bt_col,
    rows,
    tiles,
    k_pages,
    v_pages,
    s_page,
    s_tok,
    s_head,
    tail_k,
    tail_v,
    p_slot,
    p_tok,
    p_head,
    sink_slots,
    HAS_SINK: tl.constexpr,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    PAGE_BF16: tl.constexpr,
    POOL_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Grid ``(N, Hkv, 2)``: page ``n``, KV head ``h``, K (0) or V (1) -> ``pages[n, :, h, :]``."""
    L: tl.constexpr = LAYOUT
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    half = tl.program_id(2)
    row = tl.load(rows + n).to(tl.int64)
    tile = tl.load(tiles + n).to(tl.int64)
    tok = tl.arange(0, L.G)
    out = tl.where(half == 0, k_pages, v_pages) + n * s_page + h * s_head + tok * s_tok  # [G] page rows
    slot = -1
    if HAS_SINK:
        slot = tl.where(tile == 0, tl.load(sink_slots + row).to(tl.int64), -1)
    if slot >= 0:  # the first tile in full precision, from its sink slot
        src = tl.where(half == 0, tail_k, tail_v) + slot * p_slot + h * p_head + tok * p_tok
        all_rows = tok < L.G
        _pool_rows_to_page(src, all_rows, out, all_rows, L.D, POOL_BF16, PAGE_BF16, ROTATE, INV_SQRT_D)
    else:
        rec = cache + tl.load(block_table + row * bt_row + tile * bt_col).to(tl.int64) * c_block + h * c_head
        if ROTATE:
            _record_half_to_page(rec, out, half, L, PAGE_BF16, INV_SQRT_D)
        elif half == 0:  # unrotated formats: the dequantized values themselves
            x = _dequant_values(rec, L.D, L.G, L.K_BITS, L.K_CODES, L.K_SCALE, L.K_ZERO, L.K_TOK)
            _store_cols(out, tok < L.G, tl.trans(x), 0, PAGE_BF16)
        else:
            x = _dequant_values(rec, L.G, L.D, L.V_BITS, L.V_CODES, L.V_SCALE, L.V_ZERO, L.V_CHAN)
            _store_cols(out, tok < L.G, x, 0, PAGE_BF16)


@triton.jit(do_not_specialize=STEP_COUNTS)
def _row_pages_kernel(
    k,
    v,
    rows,
    slots,
    dst,
    n_rows,
    n_heads,
    s_slot,
    s_tok,
    s_head,
    k_pages,
    v_pages,
    d_row,
    d_head,
    LAYOUT: tl.constexpr,
    ROWS: tl.constexpr,
    FROM_MODEL: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    POOL_BF16: tl.constexpr,
    PAGE_BF16: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
):
    """Grid ``(cdiv(R * Hkv, ROWS), 2)``: ``ROWS`` (row, head) pairs of K (0) or V (1) -> flat page rows ``dst``."""
    G: tl.constexpr = LAYOUT.G
    D: tl.constexpr = LAYOUT.D
    which = tl.program_id(1)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = r < n_rows
    i = (r // n_heads).to(tl.int64)
    h = (r % n_heads).to(tl.int64)
    row = tl.load(rows + i, mask=in_range, other=-1).to(tl.int64)
    q = tl.load(dst + i, mask=in_range, other=0).to(tl.int64)
    ok = in_range & (row >= 0)  # a negative source row: zeros
    row = tl.where(ok, row, 0)
    out = tl.where(which == 0, k_pages, v_pages) + q * d_row + h * d_head  # [ROWS] page rows
    if FROM_MODEL:
        src = tl.where(which == 0, k, v) + row * s_tok + h * s_head  # [ROWS] row pointers
        x = prepare_rows(src, ok, D, ROTATE, IN_BF16, POOL_BF16, INV_SQRT_D) * pool_factor(D, POOL_BF16)
        if ROTATE and D > 128:
            x1, x2 = _halves(x, D // 2)
            y1, y2 = _rotate_halves(x1, x2, INV_SQRT_D)
            _store_cols(out, in_range, y1, 0, PAGE_BF16)
            _store_cols(out, in_range, y2, D // 2, PAGE_BF16)
        else:
            if ROTATE:
                x = rotate_rows(x, D, INV_SQRT_D)
            _store_cols(out, in_range, x, 0, PAGE_BF16)
    else:
        if HAS_SLOTS:
            slot = tl.load(slots + row // G, mask=ok, other=0).to(tl.int64)
        else:
            slot = row // G
        src = tl.where(which == 0, k, v) + slot * s_slot + (row % G) * s_tok + h * s_head
        _pool_rows_to_page(src, ok, out, in_range, D, POOL_BF16, PAGE_BF16, ROTATE, INV_SQRT_D)


def _check_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, heads: int, cfg: KVarNConfig) -> None:
    check_dtype("k_pages", k_pages)
    want = (cfg.group_size, heads, cfg.head_dim)
    if k_pages.dim() != 4 or tuple(k_pages.shape[1:]) != want:
        raise ValueError(f"k_pages must be [pages, {', '.join(map(str, want))}], got {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype or v_pages.device != k_pages.device:
        raise ValueError("k_pages and v_pages must match in shape, dtype and device")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("k_pages and v_pages must be contiguous")


def _check_pool(tail_k: torch.Tensor, tail_v: torch.Tensor, heads: int, cfg: KVarNConfig) -> None:
    check_dtype("tail_k", tail_k)
    want = (cfg.group_size, heads, cfg.head_dim)
    if tail_k.dim() != 4 or tuple(tail_k.shape[1:]) != want:
        raise ValueError(f"tail_k must be [num_slots, {', '.join(map(str, want))}], got {tuple(tail_k.shape)}")
    if tail_v.dtype != tail_k.dtype or tail_v.shape != tail_k.shape or tail_v.stride() != tail_k.stride():
        raise ValueError("tail_k and tail_v must match in shape, dtype and strides")
    if tail_k.stride(-1) != 1:
        raise ValueError("tail_k must be contiguous along head_dim")


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

    See :func:`kvarn.reference.write_record_pages` (sinks: ``sink_slots: [B]``, pool ``tail_k, tail_v``).
    """
    check_cache(cache, cfg)
    heads = cache.shape[1]
    _check_pages(k_pages, v_pages, heads, cfg)
    if rows.dim() != 1 or tiles.shape != rows.shape or rows.shape[0] > k_pages.shape[0]:
        raise ValueError(
            f"rows and tiles must be [N] of one length, N <= {k_pages.shape[0]} pages, got "
            f"{tuple(rows.shape)} and {tuple(tiles.shape)}"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [B, W], got {tuple(block_table.shape)}")
    has_sink = sink_slots is not None
    if has_sink:
        if tail_k is None or tail_v is None:
            raise ValueError("sink_slots needs the pool (tail_k, tail_v) that holds the sinks")
        _check_pool(tail_k, tail_v, heads, cfg)
    n = rows.shape[0]
    if n == 0:
        return
    pool = tail_k if has_sink else k_pages  # not read without a sink
    rows, tiles = index_list(rows), index_list(tiles)
    _record_pages_kernel[(n, heads, 2)](
        cache,
        cache.stride(0),
        cache.stride(1),
        block_table,
        block_table.stride(0),
        block_table.stride(1),
        rows,
        tiles,
        k_pages,
        v_pages,
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        pool,
        tail_v if has_sink else v_pages,
        pool.stride(0),
        pool.stride(1),
        pool.stride(2),
        index_list(sink_slots) if has_sink else rows,
        HAS_SINK=has_sink,
        LAYOUT=record_layout(cfg),
        ROTATE=cfg.rotate,
        PAGE_BF16=k_pages.dtype == torch.bfloat16,
        POOL_BF16=pool.dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        num_warps=record_pages_warps(cfg),
        enable_fp_fusion=False,
    )


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

    See :func:`kvarn.reference.write_row_pages`: ``from_model`` (``k, v: [T, Hkv, D]`` through the
    pool form of ``pool_dtype``) or pool rows (``k, v: [S, G, Hkv, D]``, ``rows`` indexing
    ``k[slots]``'s rows); a negative ``rows[i]`` writes zeros.
    """
    check_dtype("k", k)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"k and v must match in shape and dtype, got {tuple(k.shape)} and {tuple(v.shape)}")
    heads = k.shape[-2]
    _check_pages(k_pages, v_pages, heads, cfg)
    if rows.dim() != 1 or dst.shape != rows.shape:
        raise ValueError(f"rows and dst must be [R] of one length, got {tuple(rows.shape)} and {tuple(dst.shape)}")
    if from_model:
        pool_dtype = k.dtype if pool_dtype is None else pool_dtype
        if pool_dtype not in KERNEL_DTYPES:
            raise ValueError(f"pool_dtype must be float16 or bfloat16 for the Triton kernels, got {pool_dtype}")
        if k.dim() != 3 or k.shape[-1] != cfg.head_dim:
            raise ValueError(f"k must be [T, Hkv, {cfg.head_dim}] with from_model, got {tuple(k.shape)}")
        if k.stride() != v.stride() or k.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        strides = (0, k.stride(0), k.stride(1))
    else:
        _check_pool(k, v, heads, cfg)
        pool_dtype = k.dtype
        strides = (k.stride(0), k.stride(1), k.stride(2))
    n_rows = rows.shape[0] * heads
    if n_rows == 0:
        return
    rows, dst = index_list(rows), index_list(dst)
    _row_pages_kernel[(cdiv(n_rows, PREPARE_ROWS), 2)](
        k,
        v,
        rows,
        index_list(slots) if slots is not None else rows,
        dst,
        n_rows,
        heads,
        *strides,
        k_pages,
        v_pages,
        k_pages.stride(1),
        k_pages.stride(2),
        LAYOUT=record_layout(cfg),
        ROWS=PREPARE_ROWS,
        FROM_MODEL=from_model,
        HAS_SLOTS=slots is not None,
        ROTATE=cfg.rotate,
        IN_BF16=k.dtype == torch.bfloat16,
        POOL_BF16=pool_dtype == torch.bfloat16,
        PAGE_BF16=k_pages.dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(cfg.head_dim),
        num_warps=4,
    )
