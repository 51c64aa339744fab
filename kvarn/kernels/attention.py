"""Triton attention over the paged KVarN cache: decode and multi-query (causal within the chunk).

This module is the launcher: it checks the arguments (:mod:`~kvarn.kernels.attention_checks`), picks
the launch shape, the split-K factor, where the queries are rotated and where the splits are merged
(the rules of :mod:`~kvarn.kernels.launch_rules`), and runs one to three kernels:

1. (only without ``FUSED_Q``, see :func:`~kvarn.kernels.launch_rules.fuse_query_rotation`)
   :mod:`~kvarn.kernels.attention_prologue`: rotate the queries and pre-scale them by
   ``softmax_scale * log2(e)`` (tf32 dot with the +-1 Hadamard, exact products);
2. :mod:`~kvarn.kernels.attention_decode`: one program per (query block, KV head, split) (with
   ``FUSED_Q``: rotates and scales its own queries, the same products), then walks its share of the
   tiles (:mod:`~kvarn.kernels.attention_walk`; the per-tile math is in
   :mod:`~kvarn.kernels.attention_tiles`). With ``MERGE`` (the
   default, :func:`merge_counters`) it also finishes the call (:mod:`~kvarn.kernels.attention_merge`):
   the last split of each (query block, KV head) to finish merges the splits, un-rotates and casts;
3. (only without ``MERGE``) :mod:`~kvarn.kernels.attention_epilogue`: merge the splits (log-sum-exp),
   un-rotate (two tf32 dots on a hi/lo split) and cast to the query dtype.

Every kernel gets the record layout as ``LAYOUT`` (:func:`kvarn.kernels._common.record_layout`).
The tuning knobs are keyword arguments of :func:`paged_attention`; their defaults are the rules of
:mod:`~kvarn.kernels.launch_rules`, whose measurements are in the tuning table of ``docs/internals/kernels.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels import _plan
from kvarn.kernels._common import (
    LOG2E,
    cdiv,
    index_list,
    interpreting,
    inv_sqrt,
    next_pow2,
    record_layout,
)
from kvarn.kernels.attention_checks import (
    check_args,
    check_counts,
    check_one_tile,
    check_out,
    check_sink_logits,
    check_window,
    per_tile_smooth_knobs,
    tail_block_rows,
)
from kvarn.kernels.attention_decode import _attn_kernel
from kvarn.kernels.attention_epilogue import _epilogue_kernel
from kvarn.kernels.attention_prologue import _prologue_kernel
from kvarn.kernels.launch_rules import (
    ATTN_NUM_STAGES,
    ATTN_NUM_WARPS,
    EDGE_NUM_WARPS,
    MERGE_CHUNK,
    active_splits,
    decode_max_regs,
    decode_shape_default,
    default_splits,
    fold_offsets_default,
    fuse_query_rotation,
    merge_in_kernel,
    min_split_tiles_default,
    pair_tiles_default,
    tokens_m_default,
    visible_units,
)
from kvarn.kernels.store import write_tail

MIN_DOT_ROWS = 16
"""``tl.dot`` needs at least 16 rows: blocks of (query, head) rows are padded up to it."""
TOKENS_M_MIN_ROWS = 8
"""Rows (query heads) of a program with ``tokens_m``: the N of the MMA (``m16n8``), padded up to it."""
MIN_COUNTERS = 4096
"""Entries of a device's merge-counter buffer when first allocated (16 KiB)."""

_counters: dict[tuple[str, int], torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's int32 counter buffer of the in-kernel split merge, at least ``n`` entries, all zero.

    Each launch leaves the counters it used at zero, so the one buffer serves every launch on the
    device, eager or replayed from a CUDA graph. It is grown (zero-filled) outside graph capture
    only: while a graph is being captured a buffer that is too small gives ``None`` and the
    launcher falls back to the epilogue launch. Outgrown buffers are kept alive, since a captured
    graph may still point at one. Launches that run concurrently on several streams must not
    share counters: pass each its own zeroed ``counters=`` to :func:`paged_attention`.
    """
    buf = _device_buffer(_counters, device, n, lambda size: torch.zeros(size, dtype=torch.int32, device=device))
    return None if buf is None else _plan.persistent(buf)


def _device_buffer(buffers: dict, device: torch.device, n: int, make: Callable) -> torch.Tensor | None:
    """``buffers``' tensor for ``device``, at least ``n`` entries; a new one (``make(size)``, at least
    ``MIN_COUNTERS`` and twice the old) where it is missing or too small, except while a CUDA graph is
    captured (then ``None``). Outgrown tensors are kept alive: a captured graph may still point at one."""
    key = (device.type, device.index or 0)
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired.append(buf)
        buf = buffers[key] = make(max(n, MIN_COUNTERS, 0 if buf is None else 2 * buf.numel()))
    return buf


def _step_kv(key, value, qsl, seq_lens, tail_k, cfg: KVarNConfig, empty: Callable):
    """Where a launch reads the step's own tokens: ``(key, value)`` in the pool form, or ``None`` (the tail slot).

    Only a multi-query launch (``qsl`` given) reads ``key, value``: :func:`~kvarn.kernels.store.write_tail`
    takes them into a scratch pool of ``tail_k``'s dtype (one more launch), contiguous ``[Nq, Hkv, D]``
    rows. Without them the step's tokens come from the tail slot, which holds them only where each
    sequence's queries lie in one tile: a ``ValueError`` otherwise (a check that reads ``seq_lens``
    back to the host, skipped during graph capture). Decode gives ``None``.
    """
    if qsl is None:
        return None
    if key is None:
        check_one_tile(seq_lens, qsl, cfg.group_size)
        return None
    nq, hkv, d = key.shape
    g = cfg.group_size
    k = empty(cdiv(nq, g), g, hkv, d, dtype=tail_k.dtype, device=key.device)
    v = empty(cdiv(nq, g), g, hkv, d, dtype=tail_k.dtype, device=key.device)
    write_tail(key, value, k, v, _rows(nq, key.device), cfg)
    return k, v


_aranges: dict[tuple[str, int], torch.Tensor] = {}


def _rows(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` as int32 on ``device`` (the scratch pool's slot mapping): a view of one buffer per
    device, declared persistent to launch plans (its values never change). Outgrown buffers stay alive
    (a captured graph may read one); while a graph is captured a buffer that is too small gives a
    fresh ``arange`` instead."""
    buf = _device_buffer(_aranges, device, n, lambda size: torch.arange(size, dtype=torch.int32, device=device))
    if buf is None:
        return torch.arange(n, dtype=torch.int32, device=device)
    return _plan.persistent(buf[:n])


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain int32 list (:func:`~kvarn.kernels._common.index_list`)."""
    return index_list(t if t.dtype == torch.int32 else t.to(torch.int32))


def _launch_prologue(
    query: torch.Tensor, cfg: KVarNConfig, scale: float, empty: Callable, records=None, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query: [Nq, Hq, D]`` -> rotated, scaled fp32 ``[Nq, Hq, D]``, and the same smoothed with each
    sequence's vector for ``seq_smooth`` decode (``records = (cache, block_table, seq_lens)``, the vector
    from the first record in the ``window``, 0 for none; else the first output again)."""
    nq, hq, d = query.shape
    q = empty(nq, hq, d, dtype=torch.float32, device=query.device)
    q_s, cache, block_table, seq_lens, gq = q, q, q, q, 1
    if records is not None:
        cache, block_table, seq_lens = records
        q_s = empty(nq, hq, d, dtype=torch.float32, device=query.device)
        gq = hq // cache.shape[1]
    _plan.launch(
        _prologue_kernel,
        (nq,),
        query,
        q,
        query.stride(0),
        query.stride(1),
        hq,
        q_s,
        cache,
        block_table,
        seq_lens,
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        BLOCK_H=max(MIN_DOT_ROWS, next_pow2(hq)),
        LAYOUT=record_layout(cfg),
        ROTATE=cfg.rotate,
        IN_BF16=query.dtype == torch.bfloat16,
        FACTOR=_query_factor(cfg, scale),
        GQ=gq,
        SMOOTH=records is not None,
        WINDOW=window,
        num_warps=EDGE_NUM_WARPS,
    )
    return q, q_s


def _query_factor(cfg: KVarNConfig, scale: float) -> float:
    """What rotated queries are multiplied by: ``scale * log2(e)``, and ``1 / sqrt(D)`` of the Hadamard."""
    return scale * LOG2E * (inv_sqrt(cfg.head_dim) if cfg.rotate else 1.0)


def _launch_epilogue(
    part, ws_m, ws_l, splits: int, hq: int, out_dtype, cfg: KVarNConfig, empty: Callable, out=None, sink_logits=None
):
    """Split partials ``part: [splits, Nq, Hq, D]`` -> the output ``[Nq, Hq, D]`` in ``out_dtype`` (into ``out``);
    ``sink_logits: [Hq]`` join the merge of several splits (one split's partial holds them already)."""
    _, nq, _, d = part.shape
    if out is None:
        out = empty(nq, hq, d, dtype=out_dtype, device=part.device)
    _plan.launch(
        _epilogue_kernel,
        (nq,),
        part,
        ws_m,
        ws_l,
        out,
        nq * hq,
        splits,
        hq,
        out.stride(0),
        out.stride(1),
        part if sink_logits is None else sink_logits,
        BLOCK_H=max(MIN_DOT_ROWS, next_pow2(hq)),
        LAYOUT=record_layout(cfg),
        SPLIT=splits > 1,
        ROTATE=cfg.rotate,
        OUT_BF16=out_dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(d),
        HAS_SINK_LOGITS=sink_logits is not None,
        num_warps=EDGE_NUM_WARPS,
    )
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
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = ATTN_NUM_STAGES,
    fuse_query: bool | None = None,
    fuse_merge: bool | None = None,
    pair_tiles: bool | None = None,
    tokens_m: bool | None = None,
    fold_offsets: bool | None = None,
    counters: torch.Tensor | None = None,
    min_split_tiles: int | None = None,
    stack_tiles: bool | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query: [Nq, Hq, D]`` over the paged cache -> ``[Nq, Hq, D]`` in ``query.dtype``.

    Same contract as :func:`kvarn.reference.paged_attention`: ``cache: [num_blocks, Hkv, record_bytes]``,
    ``block_table: [B, max_blocks]``, ``seq_lens: [B]``, ``tail_k, tail_v: [num_slots, G, Hkv, D]``,
    ``tail_slots: [B]`` (or ``[B, N]`` with ``tail_k, tail_v: [num_blocks, R, Hkv, D]``: own tiles kept as
    rows of blocks, decode without a sink), ``query_start_loc: [B + 1]`` or ``None`` (one query per sequence),
    ``sink_slots: [B]`` or ``None``, ``scale`` default ``1 / sqrt(D)``, ``key, value: [Nq, Hkv, D]``
    or ``None``, the own-tile rule. A decode launch (one query per sequence) reads the step's token
    from the tail slot (written there before attention) and ignores ``key, value``; see :func:`_step_kv`.

    ``window`` (keyword only; ``None`` or a positive int, the layer's sliding window ``W``) and
    ``sink_logits`` (keyword only; ``[Hq]`` fp32, fp16 or bf16, each query head's raw learned sink logit, or
    ``None``; not the sink *slots* above) as in the reference: a query at ``p`` sees keys ``p - W + 1 .. p``,
    and the logits join the softmax denominator only. A decode program walks the tiles from the one
    holding ``p - W + 1``; a multi-query program from the one of its first query's first key, masking each
    query's keys before its window. Block-table entries (and the sink slot) before those tiles are never
    read. The window is a compile-time constant of the kernels (one compile per window size); the
    default split count counts the tiles a window leaves (:func:`~kvarn.kernels.launch_rules.visible_units`).

    Knobs (keyword only; each default is the function of that name in :mod:`~kvarn.kernels.launch_rules`):
    ``num_splits`` forces the split-K factor (default :func:`default_splits`);
    ``num_warps`` (default :func:`decode_shape_default`), ``num_stages`` launch the attention kernel;
    ``fuse_query`` forces where the queries are rotated (default :func:`fuse_query_rotation`);
    ``fuse_merge`` whether the attention launch merges the splits (else the epilogue launch; default
    :func:`merge_in_kernel`);
    ``counters`` (int32 zeros, at least query blocks x Hkv entries; left zero) replaces the
    device's :func:`merge_counters`; ``pair_tiles`` walks two tiles per loop step (default
    :func:`pair_tiles_default`); ``tokens_m`` (decode only) puts the tokens on the M side of the
    score and value dots, the query heads on N (default :func:`tokens_m_default`);
    ``fold_offsets`` unpacks the K codes with one shift per code word and no subtraction
    (:func:`~kvarn.kernels.attention_codes._unpack_raw`) and takes their offsets out of the zero-point term instead
    (default :func:`fold_offsets_default`; ``False`` centers each code before the dot, as the V codes always are:
    see :mod:`~kvarn.kernels.attention_tiles`); ``min_split_tiles``: the fewest tiles a split of a
    sequence walks (default :func:`min_split_tiles_default`); ``stack_tiles`` (decode with ``tokens_m``, at most 4
    query heads per KV head, padded to a power of two, not with ``pair_tiles``) scores and weighs two tiles a
    loop step in one dot each, stacked on M, the second tile in the query columns the heads leave free
    (default :func:`decode_shape_default`, only at its own warps when ``num_warps`` is forced); a forced
    ``num_warps`` of 1 or 2 takes the register cap too (``DECODE_MAX_REGS``); ``empty`` allocates the output and the
    workspaces (``torch.empty``'s signature; tests pass one that fills with NaN); ``out`` (``[Nq, Hq,
    D]`` in ``query.dtype``, unit last stride, e.g. a view of the caller's buffer) receives the
    result instead of a new tensor and is returned (no copy launch after the kernel).

    A ``smooth_keys`` config with per-tile vectors rotates each record tile's smoothed queries in
    the attention kernel itself: it needs ``fuse_query`` and ``tokens_m`` left at their defaults
    (or ``True`` / ``False``), and its launch is not tuned (no register cap). With one vector per
    sequence (``smooth_scope="sequence"``) the queries are smoothed once per program and every
    variant runs as for an unsmoothed config.

    Eager calls replay a launch plan from the third call of a shape on (:data:`PLANS`,
    :mod:`kvarn.kernels._plan`): decode calls, and multi-query calls given ``key, value``.
    """
    knobs = (num_splits, num_warps, num_stages, fuse_query, fuse_merge, pair_tiles, tokens_m, fold_offsets)
    knobs += (min_split_tiles, stack_tiles, window)
    inputs = (query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, query_start_loc, sink_slots, key, value)
    inputs += (counters, out, sink_logits)
    key_of = None
    if empty is torch.empty and (query_start_loc is None or key is not None):  # no check that reads seq_lens
        key_of = lambda: _plan_key(inputs, cfg, scale, knobs)

    def run(alloc: Callable) -> torch.Tensor:
        return _paged_attention(
            query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, cfg, query_start_loc, sink_slots,
            scale, key, value, *knobs, counters, alloc, out, sink_logits,
        )  # fmt: skip

    return PLANS.call(key_of, inputs, run)


PLANS = _plan.Planner()
"""Launch plans of eager calls (:mod:`kvarn.kernels._plan`): decode calls, and multi-query calls given the
step's ``key, value`` (without them the launcher reads ``seq_lens`` back to check the queries' tiles);
``PLANS.enabled = False`` turns replays off."""


def _plan_key(inputs: tuple, cfg: KVarNConfig, scale, knobs: tuple) -> tuple | None:
    """The launcher's part of a call's plan key: the config, scale and knobs (the planner adds the inputs'
    layouts). ``out`` is checked here too (:func:`~kvarn.kernels.attention_checks.check_out`): a replay skips
    the launcher's checks, and whether ``out`` shares the query's memory is not in the key."""
    check_out(inputs[-2], inputs[0])
    return cfg, scale, knobs, _TIMELINE[0]


def _paged_attention(
    query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, cfg, query_start_loc, sink_slots, scale, key,
    value, num_splits, num_warps, num_stages, fuse_query, fuse_merge, pair_tiles, tokens_m, fold_offsets,
    min_split_tiles, stack_tiles, window, counters, empty, out, sink_logits,
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_attention` itself (the launcher its plans record)."""
    check_args(query, cache, block_table, seq_lens, tail_k, tail_v, cfg, query_start_loc, (key, value))
    block_rows = tail_block_rows(tail_slots, tail_k, cfg, seq_lens.shape[0], query_start_loc, sink_slots)
    fuse_query, tokens_m = per_tile_smooth_knobs(cfg, fuse_query, tokens_m)
    check_counts(num_splits=num_splits, min_split_tiles=min_split_tiles)
    check_window(window)
    sink_logits = check_sink_logits(sink_logits, query)
    nq, hq, d = query.shape
    hkv = cache.shape[1]
    batch = seq_lens.shape[0]
    multi_q = query_start_loc is not None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = check_out(out, query)
    if query.stride(-1) != 1:
        query = query.contiguous()
    seq_lens, query_start_loc = index_list(seq_lens), index_list(query_start_loc)
    if nq == 0:
        return torch.empty_like(query) if out is None else out
    dev = query.device
    gqp = next_pow2(hq // hkv)
    block_q = max(1, MIN_DOT_ROWS // gqp) if multi_q else 1
    n_blocks = cdiv(nq, block_q) + batch if multi_q else batch  # one spare block per sequence
    max_units = visible_units(block_table.shape[1] + 1, cfg.group_size, window, block_q)
    splits = num_splits or default_splits(cfg, n_blocks * hkv, max_units, multi_q, dev, tokens_m, ATTN_NUM_WARPS)
    if tokens_m is None:
        tokens_m = tokens_m_default(cfg, multi_q, n_blocks * hkv * splits, dev)
    tokens_m = not multi_q and tokens_m
    warps, stack = decode_shape_default(
        cfg, tokens_m, gqp, n_blocks * hkv * splits, cdiv(max_units, splits), dev, min(block_table.shape[1], max_units)
    )
    if num_warps is not None:  # the rule's stacking was timed at its own warps only
        stack, warps = stack and num_warps == warps, num_warps
    pair = pair_tiles_default(cfg, tokens_m) if pair_tiles is None else pair_tiles
    stack = _stack_tiles(stack_tiles, stack, gqp, tokens_m, pair)
    step = _step_kv(key, value, query_start_loc, seq_lens, tail_k, cfg, empty)
    if warps != ATTN_NUM_WARPS and not num_splits:  # the split choice depends on the launch's warps
        splits = default_splits(cfg, n_blocks * hkv, max_units, multi_q, dev, tokens_m, warps)
    if fuse_merge is None:
        fuse_merge = merge_in_kernel(n_blocks * hkv, splits, dev)
    if fuse_merge and splits > 1 and counters is None:
        counters = merge_counters(dev, n_blocks * hkv)
    merge = fuse_merge and (splits == 1 or counters is not None)
    if merge and splits > 1 and (counters.dtype != torch.int32 or counters.numel() < n_blocks * hkv):
        raise ValueError(f"counters must be int32 with at least {n_blocks * hkv} entries")
    part, ws_m, ws_l = _workspaces(merge, splits, query.shape, dev, empty)
    min_units = min_split_tiles or min_split_tiles_default(cfg, tokens_m, n_blocks * hkv)
    fused_q = fuse_query
    if fused_q is None:
        active = n_blocks * hkv * active_splits(max_units, splits, min_units)
        fused_q = fuse_query_rotation(cfg, n_blocks * hkv * splits, cdiv(max_units, splits), dev, warps, active)
    smooth_q = cfg.seq_smooth and not fused_q and not multi_q  # the prologue smooths the queries too
    q = q_s = query
    if not fused_q:
        records = (cache, block_table, seq_lens) if smooth_q else None
        q, q_s = _launch_prologue(query, cfg, scale, empty, records, (window or 0) if smooth_q else 0)
    final = (empty(nq, hq, d, dtype=query.dtype, device=dev) if out is None else out) if merge else part
    grid = (n_blocks, hkv, splits)
    if block_rows:  # the kernel reads cdiv(G, R) blocks a row, rows contiguous
        tail_slots = tail_slots[:, : cdiv(cfg.group_size, block_rows)]
    slots = _as_int32(tail_slots)  # a no-op for int32 lists: no cast launch per call
    sinks = slots if sink_slots is None else _as_int32(sink_slots)
    pool = (tail_k, tail_v, slots, sinks, tail_k if sink_logits is None else sink_logits, *(step or (tail_k, tail_v)))
    ws = (part, ws_m, ws_l, final, part if counters is None else counters)
    flags = (splits > 1, merge, cfg.rotate, query.dtype == torch.bfloat16, inv_sqrt(d))
    launch = {"num_warps": warps, "num_stages": num_stages, "FUSED_Q": fused_q, "FACTOR": _query_factor(cfg, scale)}
    launch.update(SMOOTH_Q=smooth_q, LATE_Q=smooth_q or (cfg.seq_smooth and fused_q))
    launch.update(HAS_SINK=sink_slots is not None, HAS_KV=step is not None)
    launch.update(WINDOW=window or 0, HAS_SINK_LOGITS=sink_logits is not None)
    launch["TOKENS_M"] = tokens_m
    launch["PAIR"] = pair
    launch["FOLD"] = fold_offsets_default(cfg, launch["TOKENS_M"]) if fold_offsets is None else fold_offsets
    launch["min_units"] = min_units
    launch["STACK"] = stack
    if block_rows:
        launch["TAIL_ROWS"] = block_rows
    _launch_attention(
        grid, (q, q_s), query, cache, block_table, seq_lens, query_start_loc, pool, ws, cfg, flags, launch
    )
    if merge:
        return final
    return _launch_epilogue(part, ws_m, ws_l, splits, hq, query.dtype, cfg, empty, out, sink_logits)


def _stack_tiles(stack_tiles: bool | None, default: bool, gqp: int, tokens_m: bool, pair: bool) -> bool:
    """``stack_tiles`` as launched (``tokens_m``, ``pair`` as launched): the default, or the caller's choice
    checked against the launch before anything is launched."""
    if stack_tiles is None:
        return default and not pair
    if stack_tiles and (not tokens_m or 2 * gqp > TOKENS_M_MIN_ROWS or pair):
        raise ValueError(
            "stack_tiles=True needs a decode launch that takes tokens_m (one query per sequence, tokens_m=True "
            "or on by default; not for records smoothed per tile), at most "
            f"{TOKENS_M_MIN_ROWS // 2} query heads per KV head (padded to a power of two; got {gqp}) and pair_tiles "
            "not True"
        )
    return stack_tiles


def _workspaces(merge: bool, splits: int, shape, dev, empty: Callable) -> tuple[torch.Tensor, ...]:
    """The split partials ``[splits, Nq, Hq, D]`` (none when one split merges in the kernel) and the
    per-split running max and sum ``[splits, Nq, Hq]`` (only with several splits), fp32."""
    nq, hq, d = shape
    part = empty(0 if merge and splits == 1 else splits, nq, hq, d, dtype=torch.float32, device=dev)
    if splits == 1:
        return part, part, part
    ws_m = empty(splits, nq, hq, dtype=torch.float32, device=dev)
    return part, ws_m, empty(splits, nq, hq, dtype=torch.float32, device=dev)


_TIMELINE = [0]
"""The ``TIMELINE`` buffer address of attention launches (0: none), set by :func:`decode_timeline`."""


@contextlib.contextmanager
def decode_timeline(buf: torch.Tensor):
    """Within the block, attention launches stamp per-program times into ``buf`` (a diagnostic, CUDA only).

    ``buf``: int64, contiguous, ``[rows, 8]`` on the GPU the calls run on, with a row for every program of
    the launches (``query blocks x Hkv x splits``; decode: ``batch x Hkv x splits``), row
    ``(block * Hkv + kv_head) * splits + split``. Columns (``%globaltimer``, ns, and the SM id) are
    :data:`~kvarn.kernels.attention_decode.TIMELINE_ENTRY` ..; in a launch that merges in the kernel a program
    without units writes the first two.
    The stamped kernel is a separate compile (the address is one of its constants) and a separate plan
    key; ``benchmarks/timeline_decode.py`` reads the stamps.
    """
    if buf.dtype != torch.int64 or buf.dim() != 2 or buf.shape[1] != 8 or not buf.is_contiguous():
        got = f"{buf.dtype} {tuple(buf.shape)}"
        raise ValueError(f"decode_timeline needs a contiguous int64 [rows, 8] buffer, got {got}")
    if buf.device.type != "cuda":
        raise ValueError("decode_timeline stamps %globaltimer on a CUDA device; the buffer is on " + str(buf.device))
    if _TIMELINE[0]:
        raise RuntimeError("decode_timeline is already active")
    _TIMELINE[0] = buf.data_ptr()
    try:
        yield buf
    finally:
        _TIMELINE[0] = 0


def _launch_attention(grid, qs, query, cache, block_table, seq_lens, qsl, pool, ws, cfg, flags, launch) -> None:
    """Launch the attention kernel; ``qs = (q, q_s)``: ``query`` or the prologue's outputs (``launch["FUSED_Q"]``);
    ``launch`` holds the kernel's keyword arguments and ``min_units`` (1 if absent)."""
    q, q_s = qs
    hkv = grid[1]
    nq, hq, d = query.shape
    gqa = hq // hkv
    gqp = next_pow2(gqa)
    multi_q = qsl is not None
    block_q = max(1, MIN_DOT_ROWS // gqp) if multi_q else 1
    tail_k, tail_v, tail_slots, sinks, sink_logits, key, value = pool
    part, ws_m, ws_l, final, counters = ws
    launch = dict(launch)
    min_units = launch.pop("min_units", 1)
    _plan.launch(
        _attn_kernel,
        grid,
        q,
        q_s,
        cache,
        block_table,
        seq_lens,
        tail_k,
        tail_v,
        tail_slots,
        sinks,
        sink_logits,
        qsl if multi_q else seq_lens,
        key,
        value,
        part,
        ws_m,
        ws_l,
        final,
        counters,
        seq_lens.shape[0],
        hq,
        q.stride(0),
        q.stride(1),
        final.stride(0) if flags[1] else hq * d,
        final.stride(1) if flags[1] else d,
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        nq * hq,
        grid[2],
        min_units,
        GQ=gqa,
        GQP=gqp,
        BLOCK_Q=block_q,
        BLOCK_M=max(TOKENS_M_MIN_ROWS if launch["TOKENS_M"] else MIN_DOT_ROWS, block_q * gqp),
        LAYOUT=record_layout(cfg),
        MULTI_Q=multi_q,
        POOL_BF16=tail_k.dtype == torch.bfloat16,
        USE_ASM=not interpreting(),
        IN_BF16=query.dtype == torch.bfloat16,
        MERGE_CH=max(1, MERGE_CHUNK // (block_q * gqp * d)),
        FLAGS=flags,
        maxnreg=decode_max_regs(cfg, launch["num_warps"], multi_q),
        TIMELINE=_TIMELINE[0],
        **launch,
    )
