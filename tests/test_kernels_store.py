"""Store kernels (``kvarn.kernels.store``: encode, tail pool, commit) against the reference, under the
Triton interpreter on tiny shapes (``interpreted.py``)."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from interpreted import DTYPES, INTERPRETER_MARKS, attention, seq_cfg, smooth_cfg, store
from kernel_oracle import check_attention, check_prepared, check_records, make_kv, poisoned_empty

from kvarn import reference as R
from kvarn.config import PRESETS, KVarNConfig

pytestmark = INTERPRETER_MARKS


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_encode_records_matches_reference(preset, dtype):
    cfg = KVarNConfig.from_preset(preset, head_dim=64)
    k, v = make_kv(2, cfg.group_size, 1, 64, dtype, seed=zlib.crc32(preset.encode()) % 1000)
    kr = R.prepare(k[:, :, 0], dtype)
    vr = R.prepare(v[:, :, 0], dtype)
    got = store.encode_records(kr, vr, cfg, empty=poisoned_empty)
    check_records(got, R.encode_records(kr, vr, cfg), kr, vr, cfg)


@pytest.mark.parametrize("kind", ["zero", "constant", "huge", "tiny"])
def test_encode_records_hard_tiles(kind):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    dtype = torch.bfloat16
    k, v = make_kv(1, 64, 1, 64, dtype, seed=7, kind=kind)
    kr, vr = R.prepare(k[:, :, 0], dtype), R.prepare(v[:, :, 0], dtype)
    got = store.encode_records(kr, vr, cfg)
    check_records(got, R.encode_records(kr, vr, cfg), kr, vr, cfg)


def test_encode_records_no_normalize_no_rotate():
    cfg = KVarNConfig.from_preset("kvarn_k4v4_g64", head_dim=64, normalize=False, rotate=False)
    k, v = make_kv(2, 64, 1, 64, torch.float16, seed=3)
    k, v = k[:, :, 0], v[:, :, 0]
    check_records(store.encode_records(k, v, cfg), R.encode_records(k, v, cfg), k, v, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 256])
def test_store_tiles_prepares_and_writes_only_its_blocks(dtype, d):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=d)
    hkv, n = 2, 2
    k, v = make_kv(n, 64, hkv, d, dtype, seed=5)
    k[0, 1, 0, 2] = float("nan")
    k[1, 3, 1, 5] = float("inf")
    v[0, 2, 1, 7] = float("-inf")
    block_ids = torch.tensor([3, 1], dtype=torch.int32)
    got = torch.full((5, hkv, cfg.record_bytes), 0xAB, dtype=torch.uint8)
    want = got.clone()
    store.store_tiles(k, v, block_ids, got, cfg, empty=poisoned_empty)
    R.store_tiles(k, v, block_ids, want, cfg)
    untouched = [0, 2, 4]
    assert torch.equal(got[untouched], want[untouched])
    kr = R.prepare(k, dtype).transpose(1, 2)
    vr = R.prepare(v, dtype).transpose(1, 2)
    check_records(got[block_ids.long()], want[block_ids.long()], kr, vr, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_write_tail_then_commit(dtype):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, d, slots = 64, 2, 64, 3
    k, v = make_kv(1, 70, hkv, d, dtype, seed=9)
    k, v = k[0], v[0]
    k[5, 0, 1] = float("nan")
    mapping = torch.cat([torch.arange(64) + g, torch.tensor([-1, 2 * g, 2 * g + 1, -5, 0, 3])]).to(torch.int64)
    got_k = torch.full((slots, g, hkv, d), float("nan"), dtype=dtype)
    got_v = got_k.clone()
    want_k, want_v = got_k.clone(), got_v.clone()
    store.write_tail(k, v, got_k, got_v, mapping, cfg)
    R.write_tail(k, v, want_k, want_v, mapping, cfg)
    assert torch.equal(got_k.isnan(), want_k.isnan()), "wrote outside the mapped pool rows"
    written = ~want_k.isnan()
    check_prepared(got_k[written], want_k[written])
    check_prepared(got_v[written], want_v[written])
    cache_got = torch.full((4, hkv, cfg.record_bytes), 0x5A, dtype=torch.uint8)
    cache_want = cache_got.clone()
    # a padded commit list (as a captured decode step has): slot -1 entries write nothing
    slots_t, blocks = torch.tensor([-1, 1, -1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    store.commit_tiles(want_k, want_v, slots_t, blocks, cache_got, cfg)
    R.commit_tiles(want_k, want_v, slots_t, blocks, cache_want, cfg)
    assert (cache_got[[0, 1, 3]] == 0x5A).all() and (cache_want[[0, 1, 3]] == 0x5A).all()
    check_records(cache_got[2], cache_want[2], want_k[1].transpose(0, 1), want_v[1].transpose(0, 1), cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_write_tail_and_gather_tail_tiles_on_block_rows(dtype):
    """``write_tail`` into a cache's block rows (``slot * rows + row`` mappings) and ``gather_tail_tiles`` back into
    pool slots: the reference's bytes, nothing written outside the mapped rows or the listed slots."""
    from kvarn.paged import PagedKV, tail_geometry

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, d = 64, 2, 64
    rows, n = tail_geometry(cfg, 2)
    k, v = make_kv(1, 2 * g, hkv, d, dtype, seed=3)
    k, v = k[0], v[0]
    gen = torch.Generator().manual_seed(4)
    tables = (torch.randperm(2 * n + 1, generator=gen)[: 2 * n] + 1).view(2, n).to(torch.int32)
    j = torch.arange(g)
    # two tiles' tokens into their blocks' rows, two padding entries
    mapping = torch.cat([tables[t, j // rows].long() * rows + j % rows for t in range(2)])
    mapping[[3, 70]] = -1
    caches = [torch.randint(0, 256, (2 * n + 2, hkv, cfg.record_bytes), dtype=torch.uint8) for _ in range(2)]
    caches[1].copy_(caches[0])
    before = caches[0].clone()
    pool = torch.zeros(4, g, hkv, d, dtype=dtype)
    views = [PagedKV(cfg, c, pool, pool).tail_block_view(rows) for c in caches]
    store.write_tail(k, v, *views[0], mapping, cfg)
    R.write_tail(k, v, *views[1], mapping, cfg)
    written = torch.zeros_like(before, dtype=torch.bool)
    for m in mapping[mapping >= 0].tolist():
        blk, r = divmod(m, rows)
        written[blk, :, r * 2 * d * 2 : (r + 1) * 2 * d * 2] = True
    for c in caches:
        assert torch.equal(c[~written], before[~written]), "wrote outside the mapped block rows"
    keep = mapping >= 0
    for got, want in zip(views[0], views[1], strict=True):
        blk, r = mapping[keep] // rows, mapping[keep] % rows
        check_prepared(got[blk, r], want[blk, r])
    by_slot = torch.zeros(4, n, dtype=torch.int32)
    by_slot[[2, 0]] = tables
    slots = torch.tensor([2, -1, 0, -1], dtype=torch.int32)
    pools = [torch.full((4, g, hkv, d), float("nan"), dtype=dtype) for _ in range(4)]
    store.gather_tail_tiles(*views[0], by_slot, pools[0], pools[1], slots)
    R.gather_tail_tiles(*views[0], by_slot, pools[2], pools[3], slots)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
        assert got[[1, 3]].isnan().all(), "wrote a slot the list does not name"
    assert torch.equal(pools[2][2, 4], views[0][0][tables[0, 0], 4])  # slot 2 holds tile 0: row 4 of its first block


@pytest.mark.parametrize("d", [64, 128])
def test_fp16_pool_form_holds_rotations_past_65504(d):
    """In the kernels: write_tail, commit and attention agree with the reference's fp16 pool form."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=d)
    gen = torch.Generator().manual_seed(d)
    n, hkv = 80, 1
    k = (20000 + 2000 * torch.randn(n, hkv, d, generator=gen)).half()
    v = (-20000 + 2000 * torch.randn(n, hkv, d, generator=gen)).half()
    got_k = torch.full((2, 64, hkv, d), float("nan"), dtype=torch.float16)
    got_v, want_k, want_v = got_k.clone(), got_k.clone(), got_k.clone()
    store.write_tail(k, v, got_k, got_v, torch.arange(n), cfg)
    R.write_tail(k, v, want_k, want_v, torch.arange(n), cfg)
    written = ~want_k.isnan()
    check_prepared(got_k[written], want_k[written])
    check_prepared(got_v[written], want_v[written])
    assert float(R.from_pool(got_k[written][None]).abs().max()) > 65504
    cache_got = torch.zeros(2, hkv, cfg.record_bytes, dtype=torch.uint8)
    cache_want = cache_got.clone()
    one, block = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    store.commit_tiles(want_k, want_v, one, block, cache_got, cfg)
    R.commit_tiles(want_k, want_v, one, block, cache_want, cfg)
    check_records(cache_got[1], cache_want[1], want_k[0].transpose(0, 1), want_v[0].transpose(0, 1), cfg)
    pool_k, pool_v = want_k.nan_to_num(0.0), want_v.nan_to_num(0.0)
    query = (torch.randn(1, 2, d, generator=gen) * 1e-3).half()
    table, lens, slots = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), one + 1
    args = (query, cache_want, table, lens, pool_k, pool_v, slots, cfg, None, None, None)
    check_attention(attention.paged_attention(*args, empty=poisoned_empty), args)


@pytest.mark.parametrize("exp", [-40, -100])
def test_encode_records_tiny_tiles_rescale_like_the_reference(exp):
    # A tile half under 2^-24 is rescaled before the Sinkhorn stage (kvarn.reference.quantize,
    # tiny tiles): the kernel stores it as the same tile at unit range, column scales 2^exp smaller.
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k, v = make_kv(1, 64, 1, 64, torch.float32, seed=13)
    unit = []
    for x in (k[:, :, 0], v[:, :, 0]):
        r = R.prepare(x)
        _, e = torch.frexp(r.abs().amax())
        unit.append(torch.ldexp(r, 1 - e.float()).to(torch.bfloat16))  # largest |value| in [1, 2)
    tiny = [torch.ldexp(u.float(), torch.tensor(float(exp))).to(torch.bfloat16) for u in unit]
    got_unit, got_tiny = store.encode_records(*unit, cfg), store.encode_records(*tiny, cfg)
    check_records(got_unit, R.encode_records(*unit, cfg), *unit, cfg)
    want = R.scale_records(got_unit, torch.tensor([exp]), torch.tensor([exp]), cfg)
    assert torch.equal(got_tiny, want)


@pytest.mark.parametrize(
    "preset,d,dtype",
    [
        ("kvarn_k4v2_g64", 64, torch.float16),
        ("kvarn_k2v2_g128", 64, torch.bfloat16),
        ("kvarn_k4v4_g64", 128, torch.bfloat16),
        ("kvarn_k4v2_g64", 256, torch.float16),
    ],
)
def test_encode_records_smooth_matches_reference(preset, d, dtype):
    cfg = smooth_cfg(preset, d)
    k, v = make_kv(2, cfg.group_size, 1, d, dtype, seed=d + cfg.k_bits)
    kr, vr = R.prepare(k[:, :, 0], dtype), R.prepare(v[:, :, 0], dtype)
    got = store.encode_records(kr, vr, cfg, empty=poisoned_empty)
    want = R.encode_records(kr, vr, cfg)
    assert float(R.unpack_record(want, cfg)[0].smooth.float().min()) < 0.5, "the test tiles should smooth some channel"
    stats = check_records(got, want, kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0


@pytest.mark.parametrize("kind", ["zero", "constant", "huge", "tiny"])
def test_encode_records_smooth_hard_tiles(kind):
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
    k, v = make_kv(1, 64, 1, 64, torch.bfloat16, seed=7, kind=kind)
    kr, vr = R.prepare(k[:, :, 0], torch.bfloat16), R.prepare(v[:, :, 0], torch.bfloat16)
    check_records(store.encode_records(kr, vr, cfg), R.encode_records(kr, vr, cfg), kr, vr, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_store_tiles_and_commit_smooth(dtype):
    """store_tiles and write_tail + commit_tiles of a smoothed format: the reference's records, one path's bytes."""
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
    g, hkv, d, n = 64, 2, 64, 2
    k, v = make_kv(n, g, hkv, d, dtype, seed=19)
    k[0, 1, 0, 2] = float("nan")
    block_ids = torch.tensor([3, 1], dtype=torch.int32)
    got = torch.full((5, hkv, cfg.record_bytes), 0xAB, dtype=torch.uint8)
    want = got.clone()
    store.store_tiles(k, v, block_ids, got, cfg, empty=poisoned_empty)
    R.store_tiles(k, v, block_ids, want, cfg)
    assert torch.equal(got[[0, 2, 4]], want[[0, 2, 4]])
    kr, vr = R.prepare(k, dtype).transpose(1, 2), R.prepare(v, dtype).transpose(1, 2)
    check_records(got[block_ids.long()], want[block_ids.long()], kr, vr, cfg)
    pool_k = torch.full((n + 1, g, hkv, d), float("nan"), dtype=dtype)
    pool_v = pool_k.clone()
    mapping = torch.arange(g, (n + 1) * g)
    store.write_tail(k.reshape(n * g, hkv, d), v.reshape(n * g, hkv, d), pool_k, pool_v, mapping, cfg)
    via_tail = torch.full_like(got, 0x5A)
    slots = torch.tensor([1, -1, 2], dtype=torch.int32)
    store.commit_tiles(pool_k, pool_v, slots, torch.tensor([3, 0, 1], dtype=torch.int32), via_tail, cfg)
    assert (via_tail[[0, 2, 4]] == 0x5A).all()
    assert torch.equal(via_tail[block_ids.long()], got[block_ids.long()]), "the two store paths give different bytes"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_store_and_commit_sequence_smooth(dtype):
    """The first tile publishes its vector, later tiles (same call or later) take it: the reference's bytes."""
    cfg = seq_cfg("kvarn_k4v2_g64", 64)
    g, hkv, d, n = 64, 2, 64, 3
    k, v = make_kv(n, g, hkv, d, dtype, seed=23)
    k[0, 0] *= 40  # a BOS-like first token, left out of the vector
    block_ids = torch.tensor([4, 1, 2], dtype=torch.int32)
    src = torch.tensor([4, 4, 2], dtype=torch.int32)  # tiles 0, 1: one sequence (first in block 4); tile 2: another
    got = torch.full((6, hkv, cfg.record_bytes), 0xAB, dtype=torch.uint8)
    want = got.clone()
    store.store_tiles(k, v, block_ids, got, cfg, src, empty=poisoned_empty)
    R.store_tiles(k, v, block_ids, want, cfg, src)
    assert torch.equal(got[[0, 3, 5]], want[[0, 3, 5]])
    kr, vr = R.prepare(k, dtype).transpose(1, 2), R.prepare(v, dtype).transpose(1, 2)
    stats = check_records(got[block_ids.long()], want[block_ids.long()], kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0
    field = slice(cfg.offsets["k_smooth"], cfg.record_bytes)
    assert torch.equal(got[1, :, field], got[4, :, field]) and not torch.equal(got[2, :, field], got[4, :, field])
    # the later tile alone, its first record already in the cache: same bytes
    alone = got.clone()
    alone[1] = 0
    store.store_tiles(k[1:2], v[1:2], block_ids[1:2], alone, cfg, src[1:2])
    assert torch.equal(alone, got)
    # write_tail + commit_tiles (padded list) give the store's bytes
    pool_k = torch.full((n + 1, g, hkv, d), float("nan"), dtype=dtype)
    pool_v = pool_k.clone()
    store.write_tail(
        k.reshape(n * g, hkv, d), v.reshape(n * g, hkv, d), pool_k, pool_v, torch.arange(g, (n + 1) * g), cfg
    )
    via_tail = torch.full_like(got, 0x5A)
    slots = torch.tensor([2, -1, 1, 3], dtype=torch.int32)
    ids = torch.tensor([1, 0, 4, 2], dtype=torch.int32)
    store.commit_tiles(pool_k, pool_v, slots, ids, via_tail, cfg, torch.tensor([4, 0, 4, 2], dtype=torch.int32))
    assert torch.equal(via_tail[block_ids.long()], got[block_ids.long()]), "the two store paths give different bytes"
    assert (via_tail[[0, 3, 5]] == 0x5A).all()
    with pytest.raises(ValueError, match="smooth_src"):
        store.store_tiles(k, v, block_ids, got, cfg)
    # index lists given as expanded views (stride 0) are read as the lists they stand for
    view = got.clone()
    view[[1, 4]] = 0
    one = torch.tensor([4], dtype=torch.int32)
    store.store_tiles(k[:2], v[:2], block_ids[:2], view, cfg, one.expand(2))
    assert torch.equal(view, got)


def test_store_sequence_smooth_with_a_source_record_never_written():
    """A later tile whose source record holds garbage (never stored): the vector is clamped to
    ``[SMOOTH_MIN, 1]`` (NaN bytes to ``SMOOTH_MIN``) exactly as the reference does, and nothing
    non-finite is stored."""
    from kvarn.reference.smooth import SMOOTH_MIN

    cfg = seq_cfg("kvarn_k4v2_g64", 64)
    k, v = make_kv(1, 64, 2, 64, torch.float16, seed=31)
    field = slice(cfg.offsets["k_smooth"], cfg.record_bytes)
    # 0, NaN (0x7F / 0xFF), -0, a subnormal, 448, 1.0, 0.5, a negative, 2^-6
    garbage = torch.tensor([0x00, 0x7F, 0xFF, 0x80, 0x01, 0x7E, 0x38, 0x30, 0xB8, 0x08], dtype=torch.uint8)
    got = torch.zeros(3, 2, cfg.record_bytes, dtype=torch.uint8)
    got[2, :, field] = garbage.repeat(7)[:64]
    want = got.clone()
    ids, src = torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    store.store_tiles(k, v, ids, got, cfg, src, empty=poisoned_empty)
    R.store_tiles(k, v, ids, want, cfg, src)
    kr, vr = R.prepare(k, torch.float16).transpose(1, 2), R.prepare(v, torch.float16).transpose(1, 2)
    stats = check_records(got[:1], want[:1], kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0
    s = got[0, :, field].contiguous().view(torch.float8_e4m3fn).float()
    assert ((s >= SMOOTH_MIN) & (s <= 1)).all()
    assert torch.isfinite(R.decode_records(got[:1], cfg)[0]).all()


def test_encode_records_sequence_smooth_takes_each_tile_as_a_first():
    cfg = seq_cfg("kvarn_k2v2_g128", 64)
    k, v = make_kv(2, 128, 1, 64, torch.float16, seed=29)
    kr, vr = R.prepare(k[:, :, 0], torch.float16), R.prepare(v[:, :, 0], torch.float16)
    stats = check_records(store.encode_records(kr, vr, cfg), R.encode_records(kr, vr, cfg), kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0
