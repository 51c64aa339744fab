"""The end of an attention program: its split's partial, the split merge, the output.

``@triton.jit`` helpers of :mod:`kvarn.kernels.attention_decode`. With ``MERGE`` the attention
launch finishes the call itself (no epilogue launch): a program with one split normalizes its
rows, leaves the rotated frame and stores the output in the query dtype; with several splits each
program writes its partial (running max, sum, unnormalized output) and counts itself in on its
(query block, KV head)'s counter; the program that arrives last merges every split's partial of
those rows (log-sum-exp), leaves the rotated frame, stores the output and sets the counter back
to 0, so the counter buffer is all zeros again after every launch (and every CUDA-graph replay).
Without ``MERGE`` the program stores its partial (or its normalized rows) for
:mod:`kvarn.kernels.attention_epilogue`, the same math in a second launch.

Learned sink logits (``HAS_SINK_LOGITS``: one raw logit ``z`` per query head in the softmax
denominator only, :func:`kvarn.reference.paged_attention`; not kvarn's full-precision sink tile)
join where the rows are normalized, and only there (:func:`_with_sink`): a program with one split
before it divides, the merge of the splits after it has summed them (here or in the epilogue).
The partials never hold it, so no split counts it twice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels._common import LOG2E, NEG_BIG, fwht_rows, hadamard_pm, hdot, store_model

LOG2E_K = tl.constexpr(LOG2E)


@triton.jit
def _sink_logits(sink_logits, head, ok):
    """The sink logits of rows ``head: [R]`` (query heads; ``ok``: real rows) in the kernels' exp2 domain:
    ``z * log2(e)`` fp32, ``-inf`` for the other rows (no sink). The scores are ``scale * log2(e) * q . k``
    already (the queries carry the factor), the logits are raw."""
    return tl.load(sink_logits + head, mask=ok, other=float("-inf")).to(tl.float32) * LOG2E_K


@triton.jit
def _with_sink(acc, den, m, z):
    """A softmax state ``acc: [R, D]``, ``den: [R]`` relative to running max ``m: [R]``, with each row's sink logit
    ``z: [R]`` (exp2 domain) added to the denominator: both rescaled to ``max(m, z)``, ``2^(z - max)`` added to
    ``den``. ``z = -inf`` changes nothing; a row without keys (``acc = 0``) stays 0."""
    m_f = tl.maximum(m, z)
    a = tl.exp2(m - m_f)
    return acc * a[:, None], den * a + tl.exp2(z - m_f)


@triton.jit
def _arrived_last(counter, num_splits):
    """Count this program in at ``counter``: whether it is the last of the ``num_splits`` to arrive.

    The barrier orders every thread's partial stores before the (release) increment; the last
    arrival's acquire orders its reads of the other programs' partials after their increments.
    """
    tl.debug_barrier()
    old = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    return old == num_splits - 1


@triton.jit
def _merge_rows(part, ws_m, ws_l, row_off, row_ok, num_splits, s_ws, D: tl.constexpr, CH: tl.constexpr, z=None):
    """Log-sum-exp merge of the split partials of ``R`` rows -> normalized ``[R, D]`` fp32 (rotated frame).

    ``row_off: [R]`` is each row's index in one split's ``ws_m`` / ``ws_l`` (its partial output row
    starts at ``row_off * D``), ``s_ws`` the stride of a split there. Reads ``CH`` splits at a
    time, through L2 (``.cg``): the other programs wrote them in this launch. ``z: [R]``: the rows' sink
    logits (:func:`_sink_logits`), added once the splits are summed; ``None``: none.
    """
    R: tl.constexpr = row_off.shape[0]
    sp = tl.arange(0, CH)
    dd = tl.arange(0, D)
    m_run = tl.full([R], NEG_BIG, tl.float32)
    den = tl.zeros([R], tl.float32)
    o = tl.zeros([R, D], tl.float32)
    for c in tl.range(0, num_splits, CH, num_stages=1):
        ok = ((c + sp) < num_splits)[:, None] & row_ok[None, :]  # [CH, R]
        off = (c + sp).to(tl.int64)[:, None] * s_ws + row_off[None, :]  # [CH, R]
        m = tl.load(ws_m + off, mask=ok, other=NEG_BIG, cache_modifier=".cg")
        lsum = tl.load(ws_l + off, mask=ok, other=0.0, cache_modifier=".cg")
        a_ptr = part + off[:, :, None] * D + dd[None, None, :]  # [CH, R, D]
        a = tl.load(a_ptr, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[None, :])  # [CH, R]
        den = den * alpha + tl.sum(w * lsum, axis=0)
        o = o * alpha[:, None] + tl.sum(a * w[:, :, None], axis=0)
        m_run = m_new
    if z is not None:
        o, den = _with_sink(o, den, m_run, z)
    return o / tl.where(den > 0.0, den, 1.0)[:, None]


@triton.jit
def _h_pairs(x, h):
    """``x @ H_2n`` for ``x: [M, 2n]`` given ``h = H_n``, through index bit 0 of the channels.

    ``H_2n[i, j] = (-1)^(i0 j0) H_n[i >> 1, j >> 1]``, so the even output channels are
    ``(x_even + x_odd) @ H_n`` and the odd ones ``(x_even - x_odd) @ H_n``.
    """
    M: tl.constexpr = x.shape[0]
    N2: tl.constexpr = x.shape[1]
    e, o = tl.split(tl.reshape(x, (M, N2 // 2, 2)))
    return tl.reshape(tl.join(hdot(e + o, h), hdot(e - o, h)), (M, N2))


@triton.jit
def _unrotate(x, INV_SQRT_D: tl.constexpr):
    """``x @ H_D / sqrt(D)`` for ``x: [M, D]`` fp32 (``M >= 16``, ``D <= 256``), with ``H`` blocks of at most 64."""
    M: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    if D <= 64:
        y = hdot(x, hadamard_pm(D))
    elif D == 128:
        y = _h_pairs(x, hadamard_pm(64))
    else:
        h = hadamard_pm(D // 4)
        e, o = tl.split(tl.reshape(x, (M, D // 2, 2)))
        y = tl.reshape(tl.join(_h_pairs(e + o, h), _h_pairs(e - o, h)), (M, D))
    return y * INV_SQRT_D


@triton.jit
def _store_output(o, dst, row_ok, ROTATE: tl.constexpr, OUT_BF16: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """Normalized rotated rows ``o: [M, D]`` -> the model frame, cast, stored at ``dst: [M, D]`` where ``row_ok``."""
    if ROTATE:
        o = fwht_rows(o, INV_SQRT_D)
    store_model(dst, o, row_ok[:, None], OUT_BF16)


@triton.jit
def _finish(
    result,
    rows,
    compact,
    outs,
    counter,
    num_splits,
    CH: tl.constexpr,
    flags: tl.constexpr,
    sink_logits=None,
    HAS_SINK_LOGITS: tl.constexpr = False,
):
    """Write what a program computed: its partial or rows, and with ``MERGE`` the output (see module doc).

    ``result = (m_i, l_i, acc)``; ``rows = (q_row, head, row_ok, hq, split)`` of the program's
    ``[BLOCK_M]`` rows, of which the first ``R`` are its distinct (query, head) rows (rows past
    them are masked off); ``compact = (row_off, row_ok)``: the index in one split's ``ws_m`` and
    whether it is real, of those ``R`` rows. ``outs = (part, ws_m, ws_l, s_ws, final, s_o, s_oh)``:
    the fp32 partials ``[splits, Nq, Hq, D]`` (``s_ws = Nq * Hq``), ``ws_m, ws_l: [splits, Nq, Hq]``
    and the output ``[Nq, Hq, D]`` (strides ``s_o, s_oh``). ``flags = (SPLIT, MERGE, ROTATE,
    OUT_BF16, INV_SQRT_D)``. ``HAS_SINK_LOGITS``: the heads' logits ``sink_logits: [Hq]`` (raw) join the
    denominator: one split adds them before it normalizes, several leave them to the merge (here, or the
    epilogue's).
    """
    m_i, l_i, acc = result
    q_row, head, row_ok, hq, split = rows
    sinks = None
    if HAS_SINK_LOGITS:  # the rows' logits, and the compact rows' (their heads from their offsets)
        sinks = (_sink_logits(sink_logits, head, row_ok), _sink_logits(sink_logits, compact[0] % hq, compact[1]))
    part, ws_m, ws_l, s_ws, final, s_o, s_oh = outs
    SPLIT: tl.constexpr = flags[0]
    MERGE: tl.constexpr = flags[1]
    BLOCK_M: tl.constexpr = acc.shape[0]
    D: tl.constexpr = acc.shape[1]
    dd = tl.arange(0, D)
    dst = final + q_row[:, None] * s_o + head[:, None] * s_oh + dd[None, :]  # [BLOCK_M, D]
    row_off = q_row * hq + head  # [BLOCK_M]
    if not SPLIT:
        if sinks is not None:
            acc, l_i = _with_sink(acc, l_i, m_i, sinks[0])
        res = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if MERGE:
            _store_output(res, dst, row_ok, flags[2], flags[3], flags[4])
        else:
            tl.store(part + row_off[:, None] * D + dd[None, :], res, mask=row_ok[:, None])
    else:
        ws_rows = split.to(tl.int64) * s_ws + row_off
        tl.store(ws_m + ws_rows, m_i, mask=row_ok)
        tl.store(ws_l + ws_rows, l_i, mask=row_ok)
        tl.store(part + ws_rows[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])
        if MERGE:
            if _arrived_last(counter, num_splits):
                R: tl.constexpr = compact[0].shape[0]
                z_c = None
                if sinks is not None:
                    z_c = sinks[1]
                o = _merge_rows(part, ws_m, ws_l, compact[0], compact[1], num_splits, s_ws, D, CH, z_c)  # [R, D]
                tl.store(counter, 0)
                if flags[2]:  # the R merged rows leave the rotated frame before they are spread over BLOCK_M
                    o = fwht_rows(o, flags[4])
                o = tl.reshape(tl.broadcast_to(o[None, :, :], (BLOCK_M // R, R, D)), (BLOCK_M, D))
                store_model(dst, o, row_ok[:, None], flags[3])
