"""The paged-attention kernel: one program per (query block, KV head, split).

A program serves ``BLOCK_Q`` queries x all ``Hq / Hkv`` query heads of one KV head (the rows of
its ``[BLOCK_M, ...]`` blocks), so each tile is read from memory once per KV head. It loads its
queries (:mod:`kvarn.kernels.attention_query`) and walks its split's share of the sequence's tiles
under the own-tile rule (:mod:`kvarn.reference.attention`): quantized tiles first
(:mod:`kvarn.kernels.attention_walk`), those before each row's own tile, then the full-precision
sink and the own tile (tail slot, and the step's K/V for a multi-query block;
:mod:`kvarn.kernels.attention_fp_tiles`), and ends in :mod:`kvarn.kernels.attention_merge`: the
output itself (one split, or the last split of its rows to finish merges them all), or its split's
partial for the epilogue kernel. The launcher is :mod:`kvarn.kernels.attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import STEP_COUNTS
from kvarn.kernels.attention_fp_tiles import _fp_block_tile, _fp_rows, _fp_tile
from kvarn.kernels.attention_merge import _finish
from kvarn.kernels.attention_query import _load_query, _query_rows, _records_query
from kvarn.kernels.attention_walk import _record_tiles


@triton.jit
def _query_block(pid, query_start_loc, num_seqs, BLOCK_Q: tl.constexpr):
    """Multi-query grid: program ``pid``'s ``(seq, q_start, n_q, q_first)``.

    Sequence ``b`` owns programs ``query_start_loc[b] // BLOCK_Q + b ..`` (one spare per sequence,
    so every sequence's blocks fit); a binary search finds ``pid``'s. ``q_start, n_q``: the
    sequence's first query row and query count; ``q_first``: the program's first query in it.
    """
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid
    seq = lo
    q_start = tl.load(query_start_loc + seq)
    n_q = tl.load(query_start_loc + seq + 1) - q_start
    q_first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    return seq, q_start, n_q, q_first


@triton.jit
def _program_rows(N: tl.constexpr, q_start, q_first, n_q, kvh, GQ: tl.constexpr, GQP: tl.constexpr):
    """The first ``N`` rows of a program: ``(q_row, head, row_ok, q_local)``, each ``[N]``.

    Row ``r`` is query ``q_first + r // GQP`` of the sequence (global row ``q_row``) and query
    head ``kvh * GQ + r % GQP``; ``row_ok`` says it is a real one.
    """
    rows = tl.arange(0, N)
    hj = rows % GQP
    q_local = q_first + rows // GQP
    row_ok = (hj < GQ) & (q_local < n_q)
    return (q_start + q_local).to(tl.int64), kvh * GQ + hj, row_ok, q_local


@triton.jit
def _read_rows(rows, q_start, kvh, GQ: tl.constexpr, GQP: tl.constexpr, STACK: tl.constexpr):
    """The rows whose queries a program reads: ``rows = (q_row, head, row_ok)`` of :func:`_program_rows`, or
    with ``STACK`` (decode) row ``r`` reading head ``r % GQP`` of the query (real where ``r % GQP < GQ``): rows from
    ``GQP`` on carry the queries of the other tile of a step (:func:`~kvarn.kernels.attention_walk._quantized_tiles_st`)
    and are never written."""
    q_row, head, row_ok = rows
    if STACK:
        r = tl.arange(0, q_row.shape[0]) % GQP
        return q_row * 0 + q_start, kvh * GQ + r, r < GQ
    return q_row, head, row_ok


@triton.jit
def _split_units(
    seq,
    seq_len,
    n_q,
    q_first,
    split,
    num_splits,
    min_units,
    sink_slots,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_KV: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """What split ``split`` of sequence ``seq`` reads: ``(n_full, own, u0, u1, qt0, sink_slot, has_sink, n_act, t0)``.

    The program's units are ``n_full`` record tiles, then one full-precision unit (the own tile,
    :func:`_fp_tiles`) ``own = (n_slot, fp0, j0, n_step)``: ``n_slot`` tail slot tokens at
    positions ``fp0 ..`` and, with ``HAS_KV``, ``n_step`` of the step's tokens at positions
    ``j0 ..``. Decode: ``(seq_len - 1) // G`` records and the other ``1 .. G`` tokens from the
    slot. A multi-query block: the records before the tile of its last query, the own-tile unit
    from the tile of its first query on, the step's tokens (``HAS_KV``) or the slot's (the
    sequence's queries in one tile) up to its last query. The split's units are
    ``u0 .. u1 - 1``, its records from ``qt0``; with ``has_sink`` tile 0 is read from pool slot
    ``sink_slot`` instead of its record. Each split takes ``max(cdiv(n_units, num_splits), min_units)``
    units, so only the first ``n_act`` splits have any: a launch sized for the longest sequence
    (vLLM's block table width) gives short sequences few, full splits and few partials to merge.

    ``WINDOW > 0`` (a sliding window of that many keys): the units start at ``t0``, the tile of the first
    key the program's first query sees; the splits share units ``t0 ..`` (the block-table entries before
    ``t0`` are never read), and tile 0's sink slot is read only where ``t0 = 0``. Else ``t0 = 0``.
    """
    if MULTI_Q:
        first = seq_len - n_q  # the step's first position
        p_last = first + tl.minimum(n_q, q_first + BLOCK_Q) - 1
        n_full = p_last // G
        fp0 = (first + q_first) // G * G
        if HAS_KV:
            n_slot = tl.maximum(first - fp0, 0)
        else:
            n_slot = p_last + 1 - fp0
        j0 = tl.maximum(first, fp0)
        n_units = n_full + 1
    else:
        n_full = (seq_len - 1) // G  # Triton's // and % truncate: an empty sequence reads nothing
        n_slot = (seq_len - 1) % G + 1  # the fastest form timed (others cost registers)
        fp0 = n_full * G
        j0 = seq_len
        p_last = seq_len - 1
        n_units = n_full + (n_slot > 0).to(tl.int32)
    t0 = 0
    if WINDOW > 0:
        if MULTI_Q:
            p_first = seq_len - n_q + q_first
        else:
            p_first = seq_len - 1
        t0 = tl.maximum(p_first - (WINDOW - 1), 0) // G
    per = tl.maximum(tl.cdiv(n_units - t0, num_splits), min_units)
    n_act = tl.maximum(tl.cdiv(n_units - t0, per), 1)  # an empty sequence (padding) still gets its zero rows
    u0 = t0 + split * per
    u1 = tl.minimum(u0 + per, n_units)
    if HAS_SINK:
        sink_slot = tl.load(sink_slots + seq)
    else:
        sink_slot = seq * 0 - 1
    has_sink = (sink_slot >= 0) & (n_full > 0)
    qt0 = u0
    if has_sink & (u0 == 0):
        qt0 = 1
    return n_full, (n_slot, fp0, j0, p_last + 1 - j0), u0, u1, qt0, sink_slot, has_sink, n_act, t0


@triton.jit
def _window_rows(pos_q, seq_len, WINDOW: tl.constexpr, MULTI_Q: tl.constexpr):
    """Each row's first key in its sliding window of ``WINDOW`` keys (``[BLOCK_M]``), or ``None`` without one
    (``WINDOW = 0``). The rows of a decode program are all at ``seq_len - 1`` (``STACK``'s second copies too,
    whose ``pos_q`` runs on)."""
    win_lo = None
    if WINDOW > 0:
        if MULTI_Q:
            win_lo = pos_q - (WINDOW - 1)
        else:
            win_lo = pos_q * 0 + (seq_len - WINDOW)
    return win_lo


@triton.jit
def _fp_tiles(
    state,
    query,
    src,
    units,
    LAYOUT: tl.constexpr,
    ROTATE: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR,
    FUSED_Q: tl.constexpr,
    POOL_BF16: tl.constexpr,
    LATE_Q: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_KV: tl.constexpr,
    TAIL_ROWS: tl.constexpr = 0,
    win_lo=None,
):
    """The full-precision units of a split, the sink (tile 0) and the own tile, into ``state = (m, l, acc)``.

    ``TAIL_ROWS > 0`` (decode, no sink): the own tile is kept as rows of blocks, ``TAIL_ROWS`` a
    block, and ``tail_slots`` holds ``cdiv(G, TAIL_ROWS)`` blocks a sequence (:func:`_fp_block_tile`).

    ``src = (q_base, row_ok, pool, step)``, ``units = (sink_here, sink_slot, own_here, (tail_slots,
    seq), own, pos_q, lo_q)`` with ``own`` from :func:`_split_units` and ``lo_q`` each row's
    own-tile start; ``step = (key, value, row)``: the step's pool-form K/V ``[rows, Hkv, D]`` and
    the row of position ``j0`` (read with ``HAS_KV``). A multi-query row sees the sink below
    ``lo_q`` and the own-tile unit from ``lo_q`` to its position. Scored with the unsmoothed
    ``query``, or with ``LATE_Q`` with the unsmoothed queries loaded here from ``q_base`` (``query``
    is then not read). ``win_lo: [BLOCK_M]``: each row's first key in its sliding window (``None``: no window),
    masked in the sink and the own tile alike.
    """
    q_base, row_ok, pool, step = src
    sink_here, sink_slot, own_here, tails, own, pos_q, lo_q = units
    tail_slots, seq = tails
    n_slot, fp0, j0, n_step = own
    if sink_here | own_here:
        if LATE_Q:
            q_use = _load_query(q_base, row_ok, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q)
        else:
            q_use = query
        q_rows = _query_rows(q_use, LAYOUT)  # (qn [BLOCK_M, D], rf [BLOCK_M])
        own_lo = win_lo  # each row's first key of the own-tile unit (None: the unit's first)
        if MULTI_Q:
            own_lo = lo_q
            if win_lo is not None:
                own_lo = tl.maximum(lo_q, win_lo)
        if sink_here:
            if MULTI_Q:
                state = _fp_tile(q_rows, state, pool, sink_slot, LAYOUT.G, 0, lo_q - 1, POOL_BF16, win_lo)
            else:
                state = _fp_tile(q_rows, state, pool, sink_slot, LAYOUT.G, 0, pos_q, POOL_BF16, win_lo)
        if TAIL_ROWS > 0:
            if own_here:
                n_cols: tl.constexpr = (LAYOUT.G + TAIL_ROWS - 1) // TAIL_ROWS  # blocks of a tail
                table = tail_slots + seq * n_cols
                state = _fp_block_tile(q_rows, state, pool, table, n_slot, fp0, pos_q, TAIL_ROWS, POOL_BF16, own_lo)
        elif own_here:
            slot = tl.load(tail_slots + seq)
            if MULTI_Q:
                state = _fp_tile(q_rows, state, pool, slot, n_slot, fp0, pos_q, POOL_BF16, own_lo)
                if HAS_KV:
                    key, value, row = step
                    D: tl.constexpr = LAYOUT.D
                    kvh = pool[5]
                    stride = tl.num_programs(1) * D  # [rows, Hkv, D] contiguous
                    off = row.to(tl.int64) * stride + kvh * D
                    state = _fp_rows(q_rows, state, key, value, off, stride, n_step, j0, pos_q, own_lo, POOL_BF16)
            else:
                state = _fp_tile(q_rows, state, pool, slot, n_slot, fp0, pos_q, POOL_BF16, own_lo)
    return state


TIMELINE_ENTRY = tl.constexpr(0)
TIMELINE_UNITS = tl.constexpr(1)
TIMELINE_RECORDS = tl.constexpr(2)
TIMELINE_FP = tl.constexpr(3)
TIMELINE_DONE = tl.constexpr(4)
TIMELINE_SM = tl.constexpr(7)
"""Columns of a ``TIMELINE`` row (:func:`kvarn.kernels.attention.decode_timeline`): ``%globaltimer`` (ns) at the
program's entry, once its units are known (``seq_lens`` read), after its record tiles, after its
full-precision units, after its finish (partial, merge, output); the SM it ran on."""


@triton.jit
def _stamp(TL: tl.constexpr, col: tl.constexpr, dep):
    """With ``TL`` (a buffer's address, else nothing) write ``%globaltimer`` at the program's row, column ``col``.

    A diagnostic (GPU only: inline PTX, never under the interpreter): ``dep`` is a scalar the stamp
    waits for (a loop's result), so the time is taken after the work that produced it. The row is
    ``(pid(0) * Hkv + pid(1)) * splits + pid(2)``; at ``col`` ``TIMELINE_ENTRY`` the SM id is written too.
    """
    if TL != 0:
        row = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], tl.int64, is_pure=False, pack=1)
        base = tl.full([], TL, tl.int64).to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * 8
        tl.store(base + col, now)
        if col == TIMELINE_ENTRY:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(base + TIMELINE_SM, sm.to(tl.int64))


@triton.jit(do_not_specialize=STEP_COUNTS)
def _attn_kernel(
    q,
    q_smooth,
    cache,
    block_table,
    seq_lens,
    tail_k,
    tail_v,
    tail_slots,
    sink_slots,
    sink_logits,
    query_start_loc,
    key,
    value,
    part,
    ws_m,
    ws_l,
    final,
    counters,
    num_seqs,
    hq,
    s_iq,
    s_iqh,
    s_o,
    s_oh,
    s_cb,
    s_ch,
    s_bt,
    p_slot,
    p_tok,
    p_head,
    s_ws,
    num_splits,
    min_units,
    GQ: tl.constexpr,
    GQP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LAYOUT: tl.constexpr,
    MULTI_Q: tl.constexpr,
    HAS_SINK: tl.constexpr,
    POOL_BF16: tl.constexpr,
    USE_ASM: tl.constexpr,
    IN_BF16: tl.constexpr,
    FACTOR: tl.constexpr,
    FUSED_Q: tl.constexpr,
    PAIR: tl.constexpr,
    TOKENS_M: tl.constexpr,
    FOLD: tl.constexpr,
    MERGE_CH: tl.constexpr,
    FLAGS: tl.constexpr,
    SMOOTH_Q: tl.constexpr = False,
    LATE_Q: tl.constexpr = False,
    HAS_KV: tl.constexpr = False,
    STACK: tl.constexpr = False,
    TAIL_ROWS: tl.constexpr = 0,
    TIMELINE: tl.constexpr = 0,
    WINDOW: tl.constexpr = 0,
    HAS_SINK_LOGITS: tl.constexpr = False,
):
    """Grid ``(query blocks, Hkv, num_splits)``; see :func:`kvarn.kernels.attention_merge._finish` for what it writes.

    ``q: [Nq, Hq, D]`` (strides ``s_iq, s_iqh``): with ``FUSED_Q`` the fp16/bf16 queries, rotated and scaled by
    ``FACTOR`` here, else the prologue's rotated fp32 queries. ``part: [splits, Nq, Hq, D]`` fp32 partials
    (``s_ws = Nq * Hq``, ``hq = Hq``), ``final: [Nq, Hq, D]`` the output (strides ``s_o, s_oh``), ``counters:
    [query blocks * Hkv]`` int32 zeros (with ``MERGE``). ``GQ`` query heads per KV head, padded to ``GQP`` (a
    power of two); row ``r`` of a block is query ``r // GQP``, head ``r % GQP``. ``FLAGS = (SPLIT, MERGE, ROTATE,
    OUT_BF16, INV_SQRT_D)``. ``TOKENS_M`` (decode only): tokens on the dots' M; ``FOLD``; ``STACK``: the walks of
    :mod:`~kvarn.kernels.attention_walk`. ``SMOOTH_Q`` (``SEQ_SMOOTH`` decode with the prologue): ``q_smooth``
    holds the prologue's queries for the records (smoothed with the sequence's vector), laid out as ``q``; else
    the program smooths its own (:mod:`~kvarn.kernels.attention_query`). ``LATE_Q`` (``SMOOTH_Q``, or
    ``SEQ_SMOOTH`` with ``FUSED_Q``): the unsmoothed queries are loaded only after the tile loop, for the sink and
    tail. ``HAS_KV`` (multi-query only): ``key, value: [Nq, Hkv, D]`` hold the step's own K/V in the pool form
    (contiguous, rows as ``q``'s), read for the own-tile positions from the step's first on; else those are read
    from the tail slot too (:func:`_split_units`). ``TAIL_ROWS > 0``: own tiles in block rows of ``tail_k,
    tail_v`` (strides ``p_*``), ``tail_slots: [B, cdiv(G, TAIL_ROWS)]`` (:func:`_fp_block_tile`). ``WINDOW``: see
    :func:`_split_units`; ``HAS_SINK_LOGITS`` (``sink_logits: [Hq]``): :mod:`~kvarn.kernels.attention_merge`.
    """
    G: tl.constexpr = LAYOUT.G
    ROTATE: tl.constexpr = FLAGS[2]
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _stamp(TIMELINE, TIMELINE_ENTRY, split)
    if MULTI_Q:
        seq, q_start, n_q, q_first = _query_block(pid, query_start_loc, num_seqs, BLOCK_Q)
    else:
        seq, q_start, n_q, q_first = pid, pid, 1, 0
    has_q = q_first < n_q  # else a spare query block of a multi-query launch: nothing to do
    seq_len = tl.load(seq_lens + seq, mask=has_q, other=0)
    q_row, head, row_ok, q_local = _program_rows(BLOCK_M, q_start, q_first, n_q, kvh, GQ, GQP)
    pos_q = seq_len - n_q + q_local  # [BLOCK_M]
    ld_row, ld_head, ld_ok = _read_rows((q_row, head, row_ok), q_start, kvh, GQ, GQP, STACK)
    q_base = q + ld_row[:, None] * s_iq + ld_head[:, None] * s_iqh  # [BLOCK_M, 1]
    n_full, own, u0, u1, qt0, sink_slot, has_sink, n_act, t0 = _split_units(seq, seq_len, n_q, q_first, split,
        num_splits, min_units, sink_slots, G, BLOCK_Q, MULTI_Q, HAS_SINK, HAS_KV, WINDOW)  # fmt: skip
    win_lo = _window_rows(pos_q, seq_len, WINDOW, MULTI_Q)
    _stamp(TIMELINE, TIMELINE_UNITS, n_act + u0 + u1)
    if has_q & ((split < n_act) | (not FLAGS[1])):  # without MERGE the epilogue reads every split's partial
        lo_q = pos_q // G * G if MULTI_Q else pos_q  # each row's own tile: records (and the sink) before it only
        walk = ((cache, s_cb, s_ch, kvh), block_table + seq.to(tl.int64) * s_bt, qt0, tl.minimum(u1, n_full), lo_q - 1)
        qs_base = q_smooth + ld_row[:, None] * s_iq + ld_head[:, None] * s_iqh
        query, rec_query = _records_query(q_base, qs_base, ld_ok, walk, n_full, LAYOUT, ROTATE, IN_BF16, FACTOR,
            FUSED_Q, SMOOTH_Q, LATE_Q, t0)  # fmt: skip
        state = _record_tiles(rec_query, walk, q_base, ld_ok, LAYOUT, MULTI_Q, USE_ASM, PAIR, TOKENS_M, FUSED_Q,
            IN_BF16, FACTOR, FOLD, STACK, GQP, win_lo)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_RECORDS, tl.max(state[0], axis=0).to(tl.int32, bitcast=True))
        pool = (tail_k, tail_v, p_slot, p_tok, p_head, kvh)
        own_here = (own[0] + own[3] > 0) & (u0 <= n_full) & (n_full < u1)
        units = (has_sink & (u0 == 0), sink_slot, own_here, (tail_slots, seq), own, pos_q, lo_q)
        src = (q_base, ld_ok, pool, (key, value, q_start + own[2] - (seq_len - n_q)))
        m_i, l_i, acc = _fp_tiles(state, query, src, units, LAYOUT, ROTATE, IN_BF16, FACTOR, FUSED_Q, POOL_BF16,
            LATE_Q, MULTI_Q, HAS_KV, TAIL_ROWS, win_lo)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_FP, tl.max(m_i, axis=0).to(tl.int32, bitcast=True))
        q_row_c, head_c, row_ok_c, _ = _program_rows(BLOCK_Q * GQP, q_start, q_first, n_q, kvh, GQ, GQP)
        compact = (q_row_c * hq + head_c, row_ok_c)  # the program's distinct rows
        _finish((m_i, l_i, acc), (q_row, head, row_ok, hq, split), compact, (part, ws_m, ws_l, s_ws, final, s_o, s_oh),
            counters + pid * tl.num_programs(1) + kvh, n_act, MERGE_CH, FLAGS, sink_logits,
            HAS_SINK_LOGITS)  # fmt: skip
        _stamp(TIMELINE, TIMELINE_DONE, split)
