"""Sliding windows and learned sink logits in the reference attention, against a naive dense oracle in fp64.

The oracle (:func:`naive_paged_attention`) builds, for each query, the list of keys it sees from the rule
alone (records before its tile, tile 0 from the sink slot, its own tile in full precision, within
``p - W + 1 .. p``) and takes an explicit softmax with the sink logit in the denominator. The block-table
entries before each sequence's window are poisoned, so a reference that reads one fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_oracle import POISON_BLOCK, attention_args, build_cache

from kvarn import reference as R
from kvarn.config import KVarNConfig
from kvarn.reference.attention import attend


def _h(d: int) -> torch.Tensor:
    return R.hadamard_matrix(d).double()


def naive_paged_attention(args: tuple, window: int | None, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """:func:`kvarn.reference.paged_attention` of ``args`` (:func:`kernel_oracle.attention_args`' order) in fp64,
    one query at a time over an explicit list of the keys it sees -> ``[Nq, Hq, D]`` fp64 (model frame)."""
    query, cache, table, lens, tail_k, tail_v, slots, cfg, qsl, sinks, scale, key, value = args
    nq, hq, d = query.shape
    hkv, g = cache.shape[1], cfg.group_size
    scale = 1 / math.sqrt(d) if scale is None else scale
    h = _h(d) if cfg.rotate else torch.eye(d, dtype=torch.float64)
    qsl = torch.arange(lens.shape[0] + 1) if qsl is None else qsl
    out = torch.zeros(nq, hq, d, dtype=torch.float64)

    def pooled(x):  # model-frame step rows -> the values a pool slot holds, rotated fp64
        return R.from_pool(R.prepare(x, tail_k.dtype, cfg.rotate)).double()

    for b in range(lens.shape[0]):
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        n, length = q1 - q0, int(lens[b])
        start, own = length - n, (length - n) // g
        if n == 0:
            continue
        # what each position holds: as a record tile (or the sink slot's tile 0), and in full precision
        seen = 0 if window is None else max(0, start - window + 1) // g
        last = (length - 1) // g
        rec = torch.zeros(2, max(last, 1) * g, hkv, d, dtype=torch.float64)
        for t in range(seen, last):
            if t == 0 and sinks is not None and int(sinks[b]) >= 0:
                rec[0, :g], rec[1, :g] = (R.from_pool(pool[int(sinks[b])]).double() for pool in (tail_k, tail_v))
            else:
                kr, vr = R.decode_records(cache[int(table[b, t])][None], cfg)  # [1, Hkv, G, D]
                rec[0, t * g : (t + 1) * g], rec[1, t * g : (t + 1) * g] = kr[0].transpose(0, 1), vr[0].transpose(0, 1)
        exact = torch.stack([R.from_pool(pool[int(slots[b])]).double() for pool in (tail_k, tail_v)])  # [2, G, ..]
        exact = torch.cat([exact, torch.zeros(2, length - own * g, hkv, d, dtype=torch.float64)], 1)
        if key is not None:
            exact[0, start - own * g : length - own * g] = pooled(key[q0:q1])
            exact[1, start - own * g : length - own * g] = pooled(value[q0:q1])
        for i in range(n):
            p = start + i
            lo = 0 if window is None else max(0, p - window + 1)
            j = torch.arange(lo, p + 1)
            from_rec = j < p // g * g  # tiles before the query's own
            kv = torch.where(
                from_rec[None, :, None, None],
                rec[:, j.clamp(max=rec.shape[1] - 1)],
                exact[:, (j - own * g).clamp(min=0)],
            )
            k, v = kv  # [L, Hkv, D] rotated
            qr = query[q0 + i].double() @ h  # [Hq, D]
            for head in range(hq):
                kvh = head // (hq // hkv)
                s = scale * (k[:, kvh] @ qr[head])  # [L]
                z = -math.inf if sink_logits is None else float(sink_logits[head])
                top = max(float(s.max()), z)
                w = torch.exp(s - top)
                out[q0 + i, head] = (w @ v[:, kvh]) / (math.exp(z - top) + float(w.sum()))
    return out @ h


def _poison_before_window(state: dict, args: tuple, window: int | None) -> tuple:
    """``args`` with each sequence's block-table entries before its first query's window set to a block id past the
    cache (a read of one is an ``IndexError``) and, where the window has left tile 0, its sink slot poisoned too."""
    table = state["block_table"].clone()
    sinks = args[9]
    sinks = None if sinks is None else sinks.clone()
    lens, qsl = args[3], args[8]
    g = args[7].group_size
    for b in range(lens.shape[0]):
        n = 1 if qsl is None else int(qsl[b + 1] - qsl[b])
        first = int(lens[b]) - n
        seen = 0 if window is None else max(0, first - window + 1) // g
        table[b, :seen] = POISON_BLOCK
        if seen and sinks is not None and int(sinks[b]) >= 0:
            sinks[b] = 10**6
    return (*args[:2], table, *args[3:9], sinks, *args[10:])


def _case(preset: str, lengths: list[int], n_q: list[int] | None, sink: bool, hq=4, hkv=2, seed=0):
    cfg = KVarNConfig.from_preset(preset, head_dim=64)
    state = build_cache(cfg, lengths, hkv, torch.float16, seed=seed)
    qsl = None if n_q is None else torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    nq = len(lengths) if n_q is None else sum(n_q)
    query = torch.randn(nq, hq, 64, generator=torch.Generator().manual_seed(seed + 1))
    return state, attention_args(state, query, cfg, qsl=qsl, sink=sink)


def _check(args: tuple, window, sink_logits) -> torch.Tensor:
    want = naive_paged_attention(args, window, sink_logits)
    got = R.paged_attention(*args, window=window, sink_logits=sink_logits)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    scale = float(want.abs().max()) or 1.0
    err = float((got.double() - want).abs().max()) / scale
    assert err < 2e-5, f"reference differs from the naive oracle by {err:.2e} (relative to max |out|)"
    return got


G64_LENGTHS = [1, 5, 64, 65, 100, 129, 200, 257]
"""Decode lengths over 64-token tiles: a first token, inside tile 0, at and past tile boundaries, several tiles."""


@pytest.mark.parametrize("sink", [False, True], ids=["no_sink_slot", "sink_slot"])
@pytest.mark.parametrize("window", [1, 7, 50, 64, 90, 128, 1000], ids=lambda w: f"W{w}")
def test_decode_window_against_naive(window, sink):
    """Decode rows: windows inside a tile (7, 50, 90), of one token, of whole tiles (64, 128), past the sequence."""
    state, args = _case("kvarn_k4v2_g64", G64_LENGTHS, None, sink)
    _check(_poison_before_window(state, args, window), window, None)


@pytest.mark.parametrize("window", [1, 33, 64, 100, 200, None], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("sink", [False, True], ids=["no_sink_slot", "sink_slot"])
def test_multi_query_window_and_sink_logits_against_naive(window, sink):
    """Chunks under the own-tile rule (spanning tiles, starting mid-tile, a first token), windows with sink logits."""
    lengths = [90, 200, 64, 1, 150]
    n_q = [30, 80, 2, 1, 0]
    state, args = _case("kvarn_k4v2_g64", lengths, n_q, sink, hq=4, hkv=1, seed=3)
    z = torch.tensor([-1.0, 0.5, 3.0, -20.0])
    _check(_poison_before_window(state, args, window), window, z)


@pytest.mark.parametrize("z", [-1e4, -30.0, 0.0, 30.0, 1e4], ids=lambda z: f"z{z:g}")
def test_sink_logits_of_any_size(z):
    """Large negative logits change nothing, large positive ones take nearly all the mass; 128-token tiles."""
    _, args = _case("kvarn_k2v2_g128", [3, 130, 300], [1, 4, 1], True, hq=4, hkv=2, seed=5)
    logits = torch.tensor([z, -z, z / 2, 1.0])
    _check(args, 70, logits)


def test_sink_logits_minus_infinity_is_no_sink_bit_for_bit():
    _, args = _case("kvarn_k4v2_g64", G64_LENGTHS, None, True, seed=7)
    plain = R.paged_attention(*args, window=50)
    for z in (float("-inf"), -1e4):
        assert torch.equal(R.paged_attention(*args, window=50, sink_logits=torch.full((4,), z)), plain)


def test_sink_logit_weights_a_virtual_zero_key():
    """W = 1: a query sees only itself, so its output is its own value times ``e^s / (e^z + e^s)``."""
    _, args = _case("kvarn_k4v2_g64", [70, 5], None, False, hq=2, hkv=2, seed=9)
    z = torch.tensor([0.25, -2.0])
    alone = R.paged_attention(*args, window=1)
    got = R.paged_attention(*args, window=1, sink_logits=z)
    query, scale = args[0], 1 / 8
    key = R.from_pool(args[4][args[6].long(), torch.tensor([5, 4])]).double()  # the token itself, in its slot
    s = scale * (R.rotate(query.double().float()).double() * key).sum(-1)  # [B, H]
    weight = torch.exp(s) / (torch.exp(z.double()) + torch.exp(s))
    torch.testing.assert_close(got.double(), alone.double() * weight[..., None], atol=1e-6, rtol=1e-5)


def test_window_past_the_sequence_is_no_window_bit_for_bit():
    _, args = _case("kvarn_k4v2_g64", [90, 200, 64], [30, 80, 2], True, seed=11)
    assert torch.equal(R.paged_attention(*args, window=201), R.paged_attention(*args))


def test_window_leaves_the_sink_slot_unread():
    """Once the window has left tile 0 the sink slot is not read (NaN there changes nothing)."""
    _, args = _case("kvarn_k4v2_g64", [200, 150], None, True, seed=13)
    tail_k = args[4].clone()
    tail_k[args[9][args[9] >= 0].long()] = float("nan")
    for window, read in ((80, False), (180, True)):  # 200 - 180 < 64: the window still reaches tile 0
        same = torch.equal(
            R.paged_attention(*args[:4], tail_k, *args[5:], window=window), R.paged_attention(*args, window=window)
        )
        assert same != read


@pytest.mark.parametrize(("short", "long", "window"), [(310, 312, 100), (128, 200, 64), (700, 711, 1), (3, 65, 2)])
def test_attend_with_window_is_length_invariant(short, long, window):
    gen = torch.Generator().manual_seed(short)
    q, k, v = (torch.randn(long, h, 64, generator=gen) for h in (8, 2, 2))
    z = torch.randn(8, generator=gen)
    alone = attend(q[:short], k[:short], v[:short], 0.125, window=window, sink_logits=z)
    assert torch.equal(attend(q, k, v, 0.125, window=window, sink_logits=z)[:short], alone)
    tail = attend(q[short - 3 : short], k[:short], v[:short], 0.125, window=window, sink_logits=z)
    assert torch.equal(tail, alone[-3:])


def _dense(q, k, v, scale, window, z):
    """Causal GQA attention of the last ``n`` positions, fp64, explicit mask and denominator."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
    s = scale * q.double().transpose(0, 1) @ kk.transpose(1, 2)  # [Hq, n, L]
    pos_q = torch.arange(length - n, length)[:, None]
    pos_k = torch.arange(length)[None, :]
    seen = (pos_k <= pos_q) & (pos_k > pos_q - (window or length + 1))
    s = s.masked_fill(~seen, -math.inf)
    zz = (torch.full((hq,), -math.inf) if z is None else z).double()[:, None, None]
    top = torch.maximum(s.amax(-1, keepdim=True), zz)
    w = torch.exp(s - top)
    return ((w @ vv) / (torch.exp(zz - top) + w.sum(-1, keepdim=True))).transpose(0, 1)


@given(
    length=st.integers(1, 300),
    n=st.integers(1, 80),
    window=st.one_of(st.none(), st.integers(1, 320)),
    with_z=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attend_matches_dense(length, n, window, with_z, seed):
    n = min(n, length)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(m, h, 64, generator=gen) for m, h in ((n, 4), (length, 2), (length, 2)))
    z = torch.randn(4, generator=gen) * 5 if with_z else None
    got = attend(q, k, v, 0.125, window=window, sink_logits=z)
    torch.testing.assert_close(got.double(), _dense(q, k, v, 0.125, window, z), atol=2e-6, rtol=1e-5)


@given(
    lengths=st.lists(st.integers(1, 260), min_size=1, max_size=3),
    window=st.integers(1, 300),
    spans=st.lists(st.integers(1, 140), min_size=3, max_size=3),
    sink=st.booleans(),
    seed=st.integers(0, 2**10),
)
def test_paged_attention_matches_naive(lengths, window, spans, sink, seed):
    """Random lengths, chunks and windows (edge anywhere in a tile), 64-token tiles, with sink logits."""
    n_q = [min(s, n) for s, n in zip(lengths, spans, strict=False)]
    state, args = _case("kvarn_k4v2_g64", lengths, n_q, sink, hq=2, hkv=1, seed=seed)
    _check(_poison_before_window(state, args, window), window, torch.tensor([0.5, -3.0]))


def test_bad_window_and_sink_logits_are_refused():
    _, args = _case("kvarn_k4v2_g64", [70], None, False)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            R.paged_attention(*args, window=bad)
    for bad in (torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"sink_logits must be a float tensor of one logit per query head, \[4\]"):
            R.paged_attention(*args, sink_logits=bad)


def test_gather_tiles_from_a_first_tile():
    state, _ = _case("kvarn_k4v2_g64", [300], None, True)
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    cache, row, tk, tv = state["cache"], state["block_table"][0], state["tail_k"], state["tail_v"]
    full = R.gather_tiles(cache, row, 4, tk, tv, cfg)
    poisoned = row.clone()
    poisoned[:2] = POISON_BLOCK
    part = R.gather_tiles(cache, poisoned, 4, tk, tv, cfg, sink_slot=int(state["sink_slots"][0]), first_tile=2)
    assert all(torch.equal(a[128:], b) for a, b in zip(full, part, strict=True))
