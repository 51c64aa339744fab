"""The paged cache: record encoding, the two store paths, gathering, and attention over it."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from tolerances import ATTENTION_VS_SDPA, ROUNDTRIP_REL

from kvarn.config import PRESETS, KVarNConfig
from kvarn.reference import (
    attend,
    commit_tiles,
    decode_records,
    encode_records,
    from_pool,
    gather_tiles,
    paged_attention,
    pool_exponent,
    prepare,
    rotate,
    store_tiles,
    unpack_record,
    write_tail,
)
from kvarn.reference.packing import unpack_codes


def _cfg(preset="kvarn_k4v2_g64", d=64, **kw):
    return KVarNConfig.from_preset(preset, head_dim=d, **kw)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_record_fields_follow_the_stored_formulas(preset):
    cfg = _cfg(preset, 64)
    g = torch.Generator().manual_seed(0)
    k = prepare(torch.randn(3, cfg.group_size, 64, generator=g, dtype=torch.float32), torch.float16)
    v = prepare(torch.randn(3, cfg.group_size, 64, generator=g, dtype=torch.float32), torch.float16)
    rec = encode_records(k, v, cfg)
    assert rec.shape == (3, cfg.record_bytes) and rec.dtype == torch.uint8
    # read the fields straight from the bytes at the documented offsets
    off, d, gs = cfg.offsets, cfg.head_dim, cfg.group_size

    def field(name, n, dtype):
        return rec[:, off[name] : off[name] + 2 * n].contiguous().view(dtype).float()

    k_codes = unpack_codes(rec[:, : cfg.k_codes_bytes].reshape(3, d * cfg.k_bits // 8, gs), cfg.k_bits)
    v_codes = unpack_codes(rec[:, off["v_codes"] : cfg.scales_offset].reshape(3, gs * cfg.v_bits // 8, d), cfg.v_bits)
    k_scale, k_zero = field("k_scale", d, torch.float16), field("k_zero", d, torch.float16)
    k_tok = field("k_tok", gs, torch.bfloat16)
    v_scale, v_zero = field("v_scale", gs, torch.float16), field("v_zero", gs, torch.float16)
    v_chan = field("v_chan", d, torch.bfloat16)
    # K~[t, d] = (code[d, t] * k_scale[d] + k_zero[d]) * k_tok[t]
    # V~[t, d] = (code[t, d] * v_scale[t] + v_zero[t]) * v_chan[d]
    k_expect = (k_codes.float() * k_scale[..., None] + k_zero[..., None]) * k_tok[:, None, :]
    v_expect = (v_codes.float() * v_scale[..., None] + v_zero[..., None]) * v_chan[:, None, :]
    k_dec, v_dec = decode_records(rec, cfg)
    torch.testing.assert_close(k_dec, k_expect.transpose(-1, -2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_dec, v_expect, rtol=1e-6, atol=1e-6)
    k_half, _ = unpack_record(rec, cfg)
    assert torch.equal(k_half.codes, k_codes)
    # and the reconstruction is close to what was encoded
    k, v = from_pool(k), from_pool(v)  # the rotated values the fp16 pool form stands for
    assert float((k_dec - k).norm() / k.norm()) < ROUNDTRIP_REL[cfg.k_bits]
    assert float((v_dec - v).norm() / v.norm()) < ROUNDTRIP_REL[cfg.v_bits]


def test_unpack_record_rejects_wrong_size():
    cfg = _cfg()
    with pytest.raises(ValueError, match="records must be uint8"):
        decode_records(torch.zeros(2, cfg.record_bytes + 1, dtype=torch.uint8), cfg)


@given(
    st.integers(1, 4).flatmap(lambda n: st.lists(st.integers(1, 64 * n), min_size=1, max_size=4).map(lambda c: (n, c))),
    st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_tail_commit_path_equals_direct_store(n_and_chunks, dtype):
    """Tokens arriving in arbitrary chunks through the tail pool give the bytes of a direct store."""
    n_tiles, chunks = n_and_chunks
    cfg = _cfg()
    gs, hkv, d = cfg.group_size, 2, cfg.head_dim
    total = n_tiles * gs
    g = torch.Generator().manual_seed(len(chunks))
    k = (torch.randn(total, hkv, d, generator=g) * 3).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    blocks = torch.randperm(8, generator=g)[:n_tiles] + 1
    direct = torch.zeros(9, hkv, cfg.record_bytes, dtype=torch.uint8)
    store_tiles(k.view(n_tiles, gs, hkv, d), v.view(n_tiles, gs, hkv, d), blocks, direct, cfg)

    paged = torch.zeros_like(direct)
    tail_k = torch.full((n_tiles, gs, hkv, d), float("nan"), dtype=dtype)  # a slot per tile
    tail_v = tail_k.clone()
    pos = 0
    bounds = sorted({min(c, total) for c in chunks} | {total})
    for end in bounds:
        t = torch.arange(pos, end)
        write_tail(k[pos:end], v[pos:end], tail_k, tail_v, t, cfg)
        done = list(range(pos // gs, end // gs))  # tiles completed by this chunk
        commit_tiles(tail_k, tail_v, torch.tensor(done, dtype=torch.long), blocks[done], paged, cfg)
        pos = end
    assert torch.equal(paged, direct)


def test_write_tail_skips_negative_slots_and_rotates():
    cfg = _cfg()
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    tail_k = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    tail_v = tail_k.clone()
    write_tail(k, k, tail_k, tail_v, torch.tensor([5, -1, 6]), cfg)
    assert pool_exponent(torch.float16, 64) == 3 and pool_exponent(torch.bfloat16, 64) == 0
    assert torch.equal(tail_k[0, 5], (rotate(k[0]) / 8).half()) and torch.equal(tail_k[0, 6], (rotate(k[2]) / 8).half())
    assert tail_k[0, :5].abs().sum() == 0 and tail_k[0, 7:].abs().sum() == 0


def test_store_never_writes_nonfinite():
    cfg = _cfg()
    k = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    k[0, 3, 0, 5] = float("nan")
    k[0, 4, 1, 6] = float("inf")
    k[0, 5, 1, :] = -3e38
    cache = torch.zeros(1, 2, cfg.record_bytes, dtype=torch.uint8)
    store_tiles(k, k, torch.tensor([0]), cache, cfg)
    kd, vd = decode_records(cache, cfg)
    assert torch.all(torch.isfinite(kd)) and torch.all(torch.isfinite(vd))
    tail = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    write_tail(k[0, 3:6], k[0, 3:6], tail, tail.clone(), torch.arange(3), cfg)
    assert torch.all(torch.isfinite(tail.float()))


@pytest.mark.parametrize("d", [64, 128])
def test_an_fp16_pool_holds_rotations_past_65504_and_attends_like_an_fp32_one(d):
    """fp16 K/V whose rotation leaves fp16's range go through the pool unsaturated."""
    cfg = _cfg("kvarn_k4v2_g64", d)
    g = torch.Generator().manual_seed(d)
    n, hkv = 100, 2  # one tile committed from the pool, 36 tokens left in it
    k = (20000 + 2000 * torch.randn(n, hkv, d, generator=g)).half()
    v = (-20000 + 2000 * torch.randn(n, hkv, d, generator=g)).half()
    q = torch.randn(1, 4, d, generator=g) * 1e-3
    outs = {}
    for dtype in (torch.float16, torch.float32):
        tail_k = torch.zeros(2, 64, hkv, d, dtype=dtype)
        tail_v = torch.zeros_like(tail_k)
        cache = torch.zeros(2, hkv, cfg.record_bytes, dtype=torch.uint8)
        kd, vd = k.to(dtype), v.to(dtype)  # the same values; a cache stores in its model dtype
        write_tail(kd, vd, tail_k, tail_v, torch.arange(n), cfg)
        commit_tiles(tail_k, tail_v, torch.tensor([0]), torch.tensor([1]), cache, cfg)
        direct = torch.zeros_like(cache)
        store_tiles(kd[None, :64], vd[None, :64], torch.tensor([1]), direct, cfg)
        assert torch.equal(cache, direct), "the pool path and the whole-tile path gave different bytes"
        held = from_pool(tail_k)
        assert torch.isfinite(held).all() and float(held.abs().max()) > 65504
        table, lens, slots = torch.tensor([[1, 0]]), torch.tensor([n]), torch.tensor([1])
        outs[dtype] = paged_attention(q.to(dtype), cache, table, lens, tail_k, tail_v, slots, cfg)
    got, want = outs[torch.float16].float(), outs[torch.float32].float()
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 5e-3  # 1.6e-3 measured; a saturated pool gives 0.6


# --- attention ----------------------------------------------------------------------------------


def _paged_setup(cfg, seq_lens, hkv, dtype, seed, sink=False, n_q=None):
    """Random sequences in a permuted paged cache (block 0 unused) as a step with ``n_q[b]`` new tokens leaves it.

    Every tile before the last token's is a record; the tile the step starts in (position
    ``seq_len - n_q``) is in tail slot ``2 b``, the step's tokens of it included; with ``sink`` the
    first tile is also in slot ``2 b + 1``. ``n_q`` defaults to one query per sequence (decode).
    """
    g = torch.Generator().manual_seed(seed)
    gs, d = cfg.group_size, cfg.head_dim
    n_q = [1] * len(seq_lens) if n_q is None else n_q
    n_tiles = [(s - 1) // gs for s in seq_lens]
    num_blocks = sum(n_tiles) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    cache = torch.zeros(num_blocks, hkv, cfg.record_bytes, dtype=torch.uint8)
    nslots = 2 * len(seq_lens)
    tail_k = torch.zeros(nslots, gs, hkv, d, dtype=dtype)
    tail_v = torch.zeros_like(tail_k)
    max_blocks = max(max(n_tiles), 1)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kv = []
    for b, s in enumerate(seq_lens):
        k = (torch.randn(s, hkv, d, generator=g) * 2).to(dtype)
        v = torch.randn(s, hkv, d, generator=g).to(dtype)
        kv.append((k, v))
        blocks = torch.tensor([perm.pop() for _ in range(n_tiles[b])], dtype=torch.int32)
        table[b, : n_tiles[b]] = blocks
        full = n_tiles[b] * gs
        store_tiles(k[:full].view(-1, gs, hkv, d), v[:full].view(-1, gs, hkv, d), blocks, cache, cfg)
        head = (s - n_q[b]) // gs * gs
        held = torch.arange(head, min(s, head + gs))
        write_tail(k[held], v[held], tail_k, tail_v, 2 * b * gs + held - head, cfg)
        if sink and n_tiles[b]:
            write_tail(k[:gs], v[:gs], tail_k, tail_v, (2 * b + 1) * gs + torch.arange(gs), cfg)
    tail_slots = torch.arange(len(seq_lens)) * 2
    sink_slots = tail_slots + 1 if sink else None
    return cache, table, tail_k, tail_v, tail_slots, sink_slots, kv


def _sdpa(q, k, v, n_q):
    """Causal SDPA of the last ``n_q`` positions: q [n, Hq, D], k/v [L, Hkv, D] fp32 -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    L = k.shape[0]
    mask = torch.arange(L)[None, :] <= torch.arange(L - n_q, L)[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=mask,
    )
    return out.transpose(0, 1)


def _own_tile_keys(cache, table, b, p, kv, pool_dtype, sink, cfg):
    """What a query at position ``p`` of sequence ``b`` sees, model frame: records before its tile, its tile exact."""
    gs = cfg.group_size
    own = p // gs
    dummy = torch.zeros(1, gs, cache.shape[1], cfg.head_dim)
    k, v = gather_tiles(cache, table[b], own, dummy, dummy, cfg)
    if sink and own > 0:  # the sink: the exact first tile
        k[:gs] = from_pool(prepare(kv[b][0][:gs], pool_dtype))
        v[:gs] = from_pool(prepare(kv[b][1][:gs], pool_dtype))
    exact_k = from_pool(prepare(kv[b][0][own * gs : p + 1], pool_dtype))
    exact_v = from_pool(prepare(kv[b][1][own * gs : p + 1], pool_dtype))
    return rotate(torch.cat([k, exact_k])), rotate(torch.cat([v, exact_v]))


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g64", "kvarn_k2v2_g128"])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_follows_the_own_tile_rule(preset, sink, dtype):
    """Each query: SDPA over the tiles before its own (records, the first from the sink) and its own tile exact.

    Decode rows (tile in the slot, a full one when ``seq_len % G == 0``) and chunks that start
    inside a tile and span tiles (the slot's tokens, then the step's ``key``/``value``) in one batch.
    """
    cfg = _cfg(preset, 64)
    gs = cfg.group_size
    seq_lens = [1, gs - 1, gs, gs + 1, 3 * gs + 17, 2 * gs, 2 * gs + 5]
    n_q = [1, 3, 1, 2, 5, gs + 9, gs + 5]  # the last two span tiles, one from inside a tile
    hq, hkv = 8, 2
    cache, table, tk, tv, ts, ss, kv = _paged_setup(cfg, seq_lens, hkv, dtype, seed=1, sink=sink, n_q=n_q)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    q = torch.randn(int(qsl[-1]), hq, 64).to(dtype)
    key = torch.cat([k[s - n :] for (k, _), s, n in zip(kv, seq_lens, n_q, strict=True)])
    value = torch.cat([v[s - n :] for (_, v), s, n in zip(kv, seq_lens, n_q, strict=True)])
    lens = torch.tensor(seq_lens)
    out = paged_attention(q, cache, table, lens, tk, tv, ts, cfg, qsl, ss, key=key, value=value)
    assert not torch.isnan(out).any()
    for b, s in enumerate(seq_lens):
        for i in range(n_q[b]):
            p = s - n_q[b] + i
            k, v = _own_tile_keys(cache, table, b, p, kv, dtype, sink, cfg)
            expect = _sdpa(q[qsl[b] + i : qsl[b] + i + 1], k, v, 1)
            torch.testing.assert_close(out[qsl[b] + i].float(), expect[0], atol=ATTENTION_VS_SDPA * 4, rtol=0.02)
    # one tile per sequence: the step's tokens may come from the slot instead (same values)
    single = [b for b, (s, n) in enumerate(zip(seq_lens, n_q, strict=True)) if (s - n) // gs == (s - 1) // gs]
    rows = torch.cat([torch.arange(int(qsl[b]), int(qsl[b + 1])) for b in single])
    sub_qsl = torch.tensor([0, *torch.tensor([n_q[b] for b in single]).cumsum(0).tolist()])
    sinks = None if ss is None else ss[single]
    sub = paged_attention(q[rows], cache, table[single], lens[single], tk, tv, ts[single], cfg, sub_qsl, sinks)
    assert torch.equal(sub, out[rows])
    with pytest.raises(ValueError, match="span tiles"):
        paged_attention(q, cache, table, lens, tk, tv, ts, cfg, qsl, ss)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("sink", [False, True])
def test_a_sequence_attends_alike_in_any_batch(window, sink, monkeypatch):
    """Bit for bit, a sequence's rows do not depend on the sequences batched with it, nor on how
    many query blocks are attended at once: decode rows and prompt chunks of several tiles."""
    cfg = _cfg("kvarn_k4v2_g64")
    seq_lens, n_q = [5, 64, 130, 301, 257, 200], [1, 1, 1, 1, 70, 131]
    hq, hkv = 6, 2
    cache, table, tk, tv, ts, ss, kv = _paged_setup(cfg, seq_lens, hkv, torch.float16, seed=7, sink=sink, n_q=n_q)
    gen = torch.Generator().manual_seed(7)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()])
    q = torch.randn(int(qsl[-1]), hq, 64, generator=gen).half()
    key = torch.cat([k[s - n :] for (k, _), s, n in zip(kv, seq_lens, n_q, strict=True)])
    value = torch.cat([v[s - n :] for (_, v), s, n in zip(kv, seq_lens, n_q, strict=True)])
    logits = torch.randn(hq, generator=gen)
    lens = torch.tensor(seq_lens)

    def run(rows, seqs, sub_qsl):
        sinks = None if ss is None else ss[seqs]
        return paged_attention(
            q[rows], cache, table[seqs], lens[seqs], tk, tv, ts[seqs], cfg, sub_qsl, sinks,
            key=key[rows], value=value[rows], window=window, sink_logits=logits,
        )  # fmt: skip

    together = run(torch.arange(int(qsl[-1])), list(range(len(seq_lens))), qsl)
    assert torch.isfinite(together).all()
    monkeypatch.setattr("kvarn.reference.attention.MAX_BLOCKS", 3)
    for b in range(len(seq_lens)):
        alone = run(torch.arange(int(qsl[b]), int(qsl[b + 1])), [b], torch.tensor([0, n_q[b]]))
        assert torch.equal(alone, together[qsl[b] : qsl[b + 1]]), f"sequence {b}"


def test_decode_default_is_one_query_per_sequence():
    cfg = _cfg()
    cache, table, tk, tv, ts, _, _ = _paged_setup(cfg, [70, 130], 1, torch.float16, seed=2)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    a = paged_attention(q, cache, table, torch.tensor([70, 130]), tk, tv, ts, cfg)
    b = paged_attention(q, cache, table, torch.tensor([70, 130]), tk, tv, ts, cfg, torch.tensor([0, 1, 2]))
    assert torch.equal(a, b)


def test_attention_is_close_to_exact_fp16_attention():
    """End to end against unquantized attention: the error a 4/4-bit cache should leave.

    Eight sequences of random K/V (near-uniform attention, so the outputs are small beside the
    error), one seeded query each: 0.14-0.17 over seeds 3-8; one query alone ranges 0.11-0.24.
    """
    cfg = _cfg("kvarn_k4v4_g64")
    cache, table, tk, tv, ts, _, kv = _paged_setup(cfg, [300] * 8, 2, torch.float16, seed=3)
    q = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(3)).half()
    out = paged_attention(q, cache, table, torch.tensor([300] * 8), tk, tv, ts, cfg)
    exact = torch.cat([_sdpa(q[b : b + 1], kv[b][0], kv[b][1], 1) for b in range(8)])
    assert float((out.float() - exact).norm() / exact.norm()) < 0.2


def test_attention_rejects_bad_gqa():
    cfg = _cfg()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(
            torch.randn(1, 3, 64),
            torch.zeros(1, 2, cfg.record_bytes, dtype=torch.uint8),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1]),
            torch.zeros(1, 64, 2, 64),
            torch.zeros(1, 64, 2, 64),
            torch.tensor([0]),
            cfg,
        )


def test_scale_argument():
    cfg = _cfg()
    cache, table, tk, tv, ts, _, _ = _paged_setup(cfg, [100], 1, torch.float32, seed=4)
    q = torch.randn(1, 2, 64)
    a = paged_attention(q * 2, cache, table, torch.tensor([100]), tk, tv, ts, cfg, scale=1 / math.sqrt(64))
    b = paged_attention(q, cache, table, torch.tensor([100]), tk, tv, ts, cfg, scale=2 / math.sqrt(64))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("short", "long"), [(310, 312), (128, 200), (700, 711), (3, 65)])
def test_attention_is_length_invariant(short, long):
    """A prompt's attention must not change when more tokens follow it (prefix caching)."""
    gen = torch.Generator().manual_seed(short)
    q, k, v = (torch.randn(long, h, 64, generator=gen) for h in (8, 2, 2))
    alone = attend(q[:short], k[:short], v[:short], 0.125)
    prefix = attend(q, k, v, 0.125)[:short]
    assert torch.equal(alone, prefix)
    tail = attend(q[short - 3 : short], k[:short], v[:short], 0.125)  # the same queries as a later chunk
    assert torch.equal(tail, alone[-3:])


def test_attend_matches_sdpa():
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, h, 64, generator=gen, dtype=torch.float64) for n, h in ((70, 8), (200, 2), (200, 2)))
    got = attend(q.float(), k.float(), v.float(), 0.125)
    want = _sdpa(q, k, v, 70)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
