"""Triton kernels vs the reference on the CPU, under the Triton interpreter, on tiny shapes.

``TRITON_INTERPRET=1`` must be set before Triton is first imported; ``conftest.py`` sets it when no
CUDA device is present (on a GPU machine these tests skip: ``test_kernels_gpu.py`` covers them
there), and this module reloads the kernel modules if they were defined in compiled mode anyway. The
interpreter runs the portable code paths: the GPU-only inline-asm unpack is covered on the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import pytest
import torch

pytest.importorskip("triton")

from kernel_oracle import (
    attention_args,
    build_cache,
    check_attention,
    check_prepared,
    check_records,
    expect_math_constants,
    make_kv,
    poisoned_empty,
    ragged_lengths,
    with_block_tails,
)

from kvarn import reference as R
from kvarn.config import PRESETS, SUPPORTED_HEAD_DIMS, KVarNConfig

KERNEL_MODULES = (
    "kvarn.kernels._common",
    "kvarn.kernels.launch_rules",
    "kvarn.kernels.encode",
    "kvarn.kernels.tail",
    "kvarn.kernels.store",
    "kvarn.kernels.dequant",
    "kvarn.kernels.attention_codes",
    "kvarn.kernels.attention_tiles",
    "kvarn.kernels.attention_fp_tiles",
    "kvarn.kernels.attention_epilogue",
    "kvarn.kernels.attention_merge",
    "kvarn.kernels.attention_query",
    "kvarn.kernels.attention_walk",
    "kvarn.kernels.attention_decode",
    "kvarn.kernels.attention_prologue",
    "kvarn.kernels.attention_checks",
    "kvarn.kernels.attention",
)
"""Every module of ``kvarn/kernels`` with kernels, each after the ones it imports from."""


def _interpreted_kernels():
    """The kernel modules, defined under the interpreter (reloaded if first imported compiled)."""
    mods = {n: importlib.import_module(n) for n in KERNEL_MODULES}
    store_mod = mods["kvarn.kernels.store"]
    if type(store_mod._encode_kernel).__name__ != "InterpretedFunction" and os.environ.get("TRITON_INTERPRET") == "1":
        mods = {n: importlib.reload(sys.modules[n]) for n in KERNEL_MODULES}
    names = ("_common", "store", "dequant", "attention", "launch_rules")
    return [mods[f"kvarn.kernels.{n}"] for n in names]


_common, store, dequant, attention, launch_rules = _interpreted_kernels()
INTERPRETED = type(store._encode_kernel).__name__ == "InterpretedFunction"

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETED, reason="kernels are compiled here (CUDA present); see test_kernels_gpu.py"),
]

DTYPES = (torch.float16, torch.bfloat16)


def test_constants_match_reference():
    expect_math_constants(_common)


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


@pytest.mark.parametrize("preset,d", [(p, 64) for p in PRESETS] + [("kvarn_k4v2_g128", 128)])
def test_decode_records_is_exact(preset, d):
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    k, v = make_kv(2, cfg.group_size, 1, d, torch.float16, seed=11)
    rec = R.encode_records(R.prepare(k[:, :, 0]), R.prepare(v[:, :, 0]), cfg)
    gk, gv = dequant.decode_records(rec, cfg, empty=poisoned_empty)
    wk, wv = R.decode_records(rec, cfg)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


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


@pytest.mark.parametrize(
    "preset,d,dtype,hq,hkv,tokens_m,splits",
    [
        ("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, 2),
        ("kvarn_k4v2_g128", 64, torch.bfloat16, 2, 1, False, 1),
        ("kvarn_k4v4_g64", 128, torch.float16, 2, 2, True, 3),
    ],
)
def test_paged_attention_decode_own_tiles_in_block_rows(preset, d, dtype, hq, hkv, tokens_m, splits):
    """Tails in vLLM's blocks: ``[B, N]`` tables of block rows (the cache's own bytes) instead of pool slots.
    The reference reads them as the pool they came from, bit for bit; the kernel matches it and never reads
    a row past a tile's tokens (the rest of those blocks is random bytes)."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = ragged_lengths(cfg.group_size, 10, seed=d + hq + 5)
    pooled = build_cache(cfg, lengths, hkv, dtype, seed=6)
    query = torch.randn(len(lengths), hq, d).to(dtype)
    args = attention_args(with_block_tails(pooled, cfg, seed=7), query, cfg)
    assert torch.equal(R.paged_attention(query.float(), *args[1:]), R.paged_attention(
        query.float(), *attention_args(pooled, query, cfg)[1:]))  # fmt: skip
    out = attention.paged_attention(*args, num_splits=splits, tokens_m=tokens_m, empty=poisoned_empty)
    check_attention(out, args)


@pytest.mark.parametrize("knobs", [{}, {"fuse_query": False}, {"tokens_m": True}], ids=["fused", "prologue", "tok_m"])
def test_paged_attention_sequence_smooth_own_tiles_in_block_rows(knobs):
    """Key smoothing with one vector per sequence (the ``_ks`` dtypes vLLM serves biased models in) with the own
    tiles in block rows: the records scored with smoothed queries, the own tile from the blocks with plain ones."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64, smooth_keys=True, smooth_scope="sequence")
    lengths = ragged_lengths(cfg.group_size, 8, seed=21)
    pooled = build_cache(cfg, lengths, 2, torch.float16, seed=8)
    query = torch.randn(len(lengths), 4, 64).to(torch.float16)
    args = attention_args(with_block_tails(pooled, cfg, seed=9), query, cfg)
    out = attention.paged_attention(*args, num_splits=2, empty=poisoned_empty, **knobs)
    check_attention(out, args)


def test_paged_attention_block_rows_refuses():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = with_block_tails(build_cache(cfg, [70, 5], 1, torch.float16, seed=1), cfg, seed=2)
    query = torch.randn(2, 2, 64).to(torch.float16)
    args = list(attention_args(state, query, cfg))
    with pytest.raises(ValueError, match="without a sink"):
        attention.paged_attention(*args[:9], state["sink_slots"], *args[10:])
    with pytest.raises(ValueError, match="N \\* "):
        attention.paged_attention(*args[:6], state["tail_slots"][:, :1], *args[7:])
    with pytest.raises(ValueError, match="tail_slots must be"):
        attention.paged_attention(*args[:6], state["tail_slots"][:, 0], *args[7:])


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
    """Issue 12.4 in the kernels: write_tail, commit and attention agree with the reference's fp16 pool form."""
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


ATTN_CASES = [
    ("kvarn_k4v2_g64", 64, torch.float16, 4, 2, False, None),
    ("kvarn_k4v2_g64", 64, torch.bfloat16, 8, 1, True, 2),
    ("kvarn_k2v2_g128", 64, torch.float16, 6, 2, True, None),
    ("kvarn_k4v4_g64", 128, torch.bfloat16, 2, 2, False, 4),
    ("kvarn_k4v4_g128", 64, torch.float16, 1, 1, True, 1),
    ("kvarn_k4v2_g64", 256, torch.bfloat16, 2, 1, True, 2),
]


ATTN_PROLOGUE_CASES = [
    ("kvarn_k4v2_g128", 64, torch.float16, 4, 2, True, 2),
    ("kvarn_k4v4_g64", 256, torch.bfloat16, 2, 1, False, None),
]
"""Cases run with the queries rotated by the prologue kernel (``fuse_query=False``), with the splits
merged in the attention kernel and, again, in the epilogue kernel (``fuse_merge=False``)."""


@pytest.mark.parametrize(
    "preset,d,dtype,hq,hkv,sink,splits,fuse,merge",
    [(*c, None, True) for c in ATTN_CASES]
    + [(*c, False, m) for c in ATTN_PROLOGUE_CASES for m in (True, False)]
    + [("kvarn_k4v2_g64", 128, torch.float16, 4, 2, True, 3, None, False)],
)
def test_paged_attention_decode(preset, d, dtype, hq, hkv, sink, splits, fuse, merge):
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = ragged_lengths(cfg.group_size, 12, seed=d + hq)
    state = build_cache(cfg, lengths, hkv, dtype, seed=1)
    query = torch.randn(len(lengths), hq, d).to(dtype)
    args = attention_args(state, query, cfg, sink=sink)
    out = attention.paged_attention(*args, num_splits=splits, fuse_query=fuse, fuse_merge=merge, empty=poisoned_empty)
    check_attention(out, args)


@pytest.mark.parametrize("preset,d,dtype,hq,hkv,sink,splits", [ATTN_CASES[0], ATTN_CASES[4]])
def test_paged_attention_fold_rows(preset, d, dtype, hq, hkv, sink, splits):
    """``fold_offsets=True`` on the row path (without ``tokens_m``, where the default does not fold)."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = ragged_lengths(cfg.group_size, 12, seed=d + hq + 2)
    state = build_cache(cfg, lengths, hkv, dtype, seed=3)
    query = torch.randn(len(lengths), hq, d).to(dtype)
    args = attention_args(state, query, cfg, sink=sink)
    out = attention.paged_attention(*args, num_splits=splits, fold_offsets=True, empty=poisoned_empty)
    check_attention(out, args)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "nofold"])
@pytest.mark.parametrize(
    "preset,d,hq,hkv,splits,pair",
    [
        ("kvarn_k4v2_g64", 64, 4, 2, None, True),
        ("kvarn_k2v2_g128", 64, 6, 2, 2, None),
        ("kvarn_k4v4_g64", 128, 16, 1, 3, None),
        ("kvarn_k4v2_g128", 64, 2, 2, 1, False),
    ],
)
def test_paged_attention_tokens_m(preset, d, hq, hkv, splits, pair, fold):
    """The tokens-as-M quantized tiles (``tokens_m=True``), offsets folded or not, against the reference."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = ragged_lengths(cfg.group_size, 12, seed=d + hq + 1)
    state = build_cache(cfg, lengths, hkv, torch.float16, seed=2)
    query = torch.randn(len(lengths), hq, d).to(torch.float16)
    args = attention_args(state, query, cfg, sink=hq % 4 == 0)
    out = attention.paged_attention(
        *args, num_splits=splits, tokens_m=True, pair_tiles=pair, fold_offsets=fold, empty=poisoned_empty
    )
    check_attention(out, args)


@pytest.mark.parametrize(
    "preset,d,dtype,hq,hkv,splits,sink,fold",
    [
        ("kvarn_k4v2_g64", 64, torch.float16, 8, 2, 2, True, True),  # 4 heads a KV head: the columns full
        ("kvarn_k4v4_g64", 64, torch.bfloat16, 2, 1, 3, True, False),  # 2 heads: 4 of 8 columns padding
        ("kvarn_k2v2_g128", 64, torch.float16, 4, 1, 2, True, False),  # 128-token tiles, four K fields
        ("kvarn_k4v2_g64", 128, torch.float16, 4, 1, 1, False, True),  # one split: odd tile counts
        ("kvarn_k4v2_g64", 64, torch.float16, 3, 1, 2, True, False),  # 3 heads padded to 4
        ("kvarn_k4v2_g64_ks", 64, torch.float16, 4, 2, None, True, False),  # one smoothing vector a sequence
        ("kvarn_k4v2_g64", 64, torch.bfloat16, 2, 2, 2, True, True),  # 1 head a KV head: 4 copies in 8 columns
    ],
)
def test_paged_attention_stack_tiles(preset, d, dtype, hq, hkv, splits, sink, fold):
    """Two tiles a loop step stacked on the dots' M (``stack_tiles=True``), against the reference."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = ragged_lengths(cfg.group_size, 10, seed=d + hq + 1, max_tiles=7 if hq == hkv else 3)
    state = build_cache(cfg, lengths, hkv, dtype, seed=2)
    query = torch.randn(len(lengths), hq, d).to(dtype)
    args = attention_args(state, query, cfg, sink=sink)
    for fuse in (None, False):  # queries rotated in the kernel, and by the prologue
        out = attention.paged_attention(
            *args, num_splits=splits, tokens_m=True, stack_tiles=True, fold_offsets=fold, fuse_query=fuse,
            empty=poisoned_empty,
        )  # fmt: skip
        check_attention(out, args)


@pytest.mark.parametrize(
    "hq,knobs",
    [(16, {"tokens_m": True}), (4, {"tokens_m": False}), (4, {"tokens_m": True, "pair_tiles": True})],
    ids=["8_heads", "row_path", "paired"],
)
def test_stack_tiles_refuses(hq, knobs, monkeypatch):
    """``stack_tiles=True`` needs ``tokens_m``, at most 4 (padded) query heads per KV head and no ``pair_tiles``;
    multi-query launches and records smoothed per tile (neither takes ``tokens_m``) are refused too, before
    anything is launched (the multi-query step's ``write_tail``)."""

    def launched(*args, **kwargs):
        raise AssertionError("a refused launch ran write_tail")

    monkeypatch.setattr(attention, "write_tail", launched)
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [70, 130], 2, torch.float16, seed=2)
    args = attention_args(state, torch.randn(2, hq, 64).half(), cfg)
    with pytest.raises(ValueError, match="stack_tiles=True needs"):
        attention.paged_attention(*args, stack_tiles=True, **knobs)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    multi = attention_args(state, torch.randn(3, 4, 64).half(), cfg, qsl=qsl)
    with pytest.raises(ValueError, match="stack_tiles=True needs"):
        attention.paged_attention(*multi, stack_tiles=True)
    per_tile = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64, smooth_keys=True)
    state = build_cache(per_tile, [70, 130], 2, torch.float16, seed=2)
    with pytest.raises(ValueError, match="stack_tiles=True needs"):
        attention.paged_attention(*attention_args(state, torch.randn(2, 4, 64).half(), per_tile), stack_tiles=True)


def test_tokens_m_default_rule(monkeypatch):
    """``tokens_m`` by default for decode launches on CUDA: every one at D = 128 (64-token tiles too)
    and at D = 256 (128-token tiles), over more than 2 waves at D = 64 (128-token tiles); 64-token
    tiles walked one a step with it (``pair_tiles_default``)."""
    monkeypatch.setattr(launch_rules, "_num_sms", lambda index: 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    k4v2 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
    d64 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    g64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=128)
    wave2 = launch_rules.TOKENS_M_MIN_WAVES * launch_rules.PROGRAMS_PER_SM * 132
    assert launch_rules.tokens_m_default(k4v2, False, 512, cuda)  # batch 1 at 32K in vLLM: 8 heads x 64 splits
    assert launch_rules.tokens_m_default(d64, False, wave2 + 1, cuda)
    assert not launch_rules.tokens_m_default(d64, False, wave2, cuda)
    d256 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=256)
    assert launch_rules.tokens_m_default(d256, False, 8, cuda)  # batch 1 at 4K, timed in session 13
    assert not launch_rules.tokens_m_default(k4v2, True, 10 * wave2, cuda)
    assert launch_rules.tokens_m_default(g64, False, 10 * wave2, cuda)
    assert launch_rules.tokens_m_default(g64, False, 8, cuda)
    g64_d64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    assert not launch_rules.tokens_m_default(g64_d64, False, 10 * wave2, cuda)
    assert launch_rules.pair_tiles_default(g64) and not launch_rules.pair_tiles_default(g64, tokens_m=True)
    assert not launch_rules.pair_tiles_default(g64_d64) and not launch_rules.pair_tiles_default(k4v2)
    assert not launch_rules.tokens_m_default(k4v2, False, 10 * wave2, cpu)


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "epilogue"])
def test_paged_attention_empty_sequence_rows(merge):
    """A sequence of length 0 (a CUDA-graph padding row) gets zero rows, and the counters end at zero,
    with idle splits (``min_split_tiles``) and the merge in the kernel or in the epilogue."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    g = cfg.group_size
    state = build_cache(cfg, [3 * g + 5, 70, 9 * g], 2, torch.float16, seed=22)
    query = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    args = list(attention_args(state, query[[0, 2, 3]], cfg))
    # insert the empty sequence as row 1: its block table row, length and tail slot are never read
    table, lens, slots = args[2], args[3], args[6]
    args[0] = query
    args[2] = torch.cat([table[:1], torch.zeros_like(table[:1]), table[1:]])
    args[3] = torch.cat([lens[:1], torch.zeros_like(lens[:1]), lens[1:]])
    args[6] = torch.cat([slots[:1], torch.zeros_like(slots[:1]), slots[1:]])
    counters = torch.zeros(16, dtype=torch.int32)
    out = attention.paged_attention(
        *args,
        num_splits=4,
        min_split_tiles=3,
        fuse_merge=merge,
        counters=counters if merge else None,
        empty=poisoned_empty,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not counters.any()
    keep = [0, 2, 3]
    ref_args = attention_args(state, query[keep], cfg)
    check_attention(out[keep], ref_args)


def test_fuse_query_rotation_one_warp_waves(monkeypatch):
    """One-warp launches at D = 128 keep the prologue where the in-kernel rotation's shared memory would cost the
    programs that get units a wave: none since session 26 (8 fused programs an SM); the rule checked with
    session 24's 7 fused programs an SM with 2-bit V and 6 with 4-bit V."""
    monkeypatch.setattr(launch_rules, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    k4v2 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
    k4v4 = KVarNConfig.from_preset("kvarn_k4v4_g128", head_dim=128)
    fuse = launch_rules.fuse_query_rotation
    assert fuse(k4v2, 1056, 8, cuda, 1) and fuse(k4v4, 1056, 8, cuda, 1)  # 4 / 32K: 8 an SM either way
    assert not fuse(k4v2, 1056, 9, cuda, 1)  # longer splits: the prologue (FUSE_MAX_TILES)
    monkeypatch.setattr(launch_rules, "FUSED_ONE_WARP_PROGRAMS_PER_SM", {2: 7, 4: 6})
    assert not fuse(k4v2, 1056, 8, cuda, 1)  # 8 programs an SM with the prologue, 7 fused
    assert fuse(k4v2, 1056, 8, cuda, 4)  # other warp counts: the rule as before
    assert fuse(k4v2, 924, 8, cuda, 1)  # 7 an SM: one wave either way
    assert fuse(k4v2, 1024, 5, cuda, 1, active=832)  # 2 / 32K: 52 of 64 splits get units, one fused wave
    assert not fuse(k4v4, 1024, 5, cuda, 1, active=832)  # 6 fused programs an SM: 792
    assert not fuse(k4v4, 900, 6, cuda, 1) and fuse(k4v4, 792, 6, cuda, 1)
    assert fuse(KVarNConfig.from_preset("kvarn_k2v2_g128", head_dim=128), 1056, 8, cuda, 1)  # 2-bit K: always
    assert fuse(KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64), 1056, 8, cuda, 1)  # measured at D = 128 only


def test_active_splits():
    """The splits of the longest sequence that get units, as ``_split_units`` hands them out."""
    assert launch_rules.active_splits(257, 64, 2) == 52  # 5 units each
    assert launch_rules.active_splits(257, 8, 1) == 8
    assert launch_rules.active_splits(257, 33, 3) == 33  # 8 units each
    assert launch_rules.active_splits(5, 8, 3) == 2
    assert launch_rules.active_splits(1, 8, 3) == 1


def test_min_split_tiles_default_rule():
    """At least 2 tiles a split for ``tokens_m`` decode launches (128-token tiles) with fewer than 16
    programs before splitting (batch 1 at 8 KV heads), 3 from 16 on; 1 for other launches (the row
    path, 64-token tiles, multi-query launches, which never take ``tokens_m``)."""
    k4v2 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
    g64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=128)
    assert launch_rules.min_split_tiles_default(k4v2, True, 8) == launch_rules.SHORT_SPLIT_TILES == 2
    assert launch_rules.min_split_tiles_default(k4v2, True, 16) == launch_rules.MIN_SPLIT_TILES == 3
    assert launch_rules.min_split_tiles_default(k4v2, False, 16) == 1
    assert launch_rules.min_split_tiles_default(g64, True, 16) == 1
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [70], 1, torch.float16, seed=1)
    args = attention_args(state, torch.randn(1, 2, 64).to(torch.float16), cfg)
    with pytest.raises(ValueError, match="min_split_tiles must be a positive int"):
        attention.paged_attention(*args, min_split_tiles=0)


def test_split_rule_on_an_h200(monkeypatch):
    """The decode launch the defaults pick on 132 SMs (8 KV heads, 128-token tiles): (splits, merge in
    the kernel, rotation in the kernel), the launches timed in ``benchmarks/RESULTS.md`` (2026-12-01,
    sessions 8 and 9)."""
    monkeypatch.setattr(launch_rules, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    k4v2 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)

    def launch(batch, ctx):
        programs, units = batch * 8, ctx // 128 + 1
        splits = launch_rules.default_splits(k4v2, programs, units, False, cuda)
        merge = launch_rules.merge_in_kernel(programs, splits, cuda)
        fused = launch_rules.fuse_query_rotation(k4v2, programs * splits, _common.cdiv(units, splits), cuda)
        return splits, merge, fused

    assert launch(1, 4096) == (33, True, True)  # one-tile splits: a launch under 2 programs per SM
    assert launch(1, 32768) == (64, True, True)  # MAX_SPLITS
    assert launch(8, 1024) == (4, True, True)  # 4-tile splits would fill half a wave: 2-tile splits
    assert launch(8, 4096) == (8, True, True)  # 3 waves wanted, at least 4 tiles per split
    # tokens_m launches (over 2 waves of 3 programs per SM): at most 2 whole waves of 4 per SM (1056 programs)
    assert launch(32, 4096) == (4, True, False)  # 9 tiles per split: the prologue rotates
    assert launch(64, 4096) == (2, True, False)
    assert launch(8, 32768) == (16, True, False)
    assert launch(16, 32768) == (8, True, False)
    assert launch(32, 32768) == (4, True, False)
    assert launch(64, 32768) == (2, True, False)
    assert launch(128, 32768) == (1, True, False)  # 1024 programs in one split
    assert launch(256, 32768)[:2] == (1, True)  # one split is finished in the kernel, however many programs
    # still tokens_m: 700 programs (2 whole waves would allow 1 split, 1.33 waves of 4 per SM, which
    # is not over the 792 programs of tokens_m)
    programs = 700
    assert launch_rules.default_splits(k4v2, programs, 257, False, cuda) == 2
    # launches that do not run the 128-register tokens_m kernel keep the rounded-up waves
    assert launch_rules.default_splits(k4v2, 128, 257, False, cuda, tokens_m=False) == 10
    assert launch_rules.default_splits(k4v2, 128, 257, False, cuda, num_warps=8) == 10
    # 2 warps are capped too (DECODE_MAX_REGS): the whole waves, as timed for decode_shape_default
    assert launch_rules.default_splits(k4v2, 128, 257, False, cuda, num_warps=2) == 8
    assert launch_rules.default_splits(k4v2, 128, 257, False, cuda, num_warps=1) == 8  # and 1 warp (255 registers)
    per_tile = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128, smooth_keys=True)
    assert launch_rules.default_splits(per_tile, 128, 257, False, cuda) == 10
    # D = 256 keeps the rounded-up waves; 64-token tiles at D = 128 take tokens_m and its whole waves
    d256 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=256)
    assert launch_rules.default_splits(d256, 128, 257, False, cuda) == 10
    g64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=128)
    assert launch_rules.default_splits(g64, 128, 513, False, cuda) == 8  # 16 x 32K, timed in session 13
    # one-tile splits up to 2 programs per SM, 4 at D = 64 (half a tile's work; 4 / 1K timed in session 22)
    d64 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    assert launch(4, 1024)[0] == 4 and launch_rules.default_splits(d64, 32, 9, False, cuda) == 9
    assert launch_rules.default_splits(d64, 64, 9, False, cuda) == 4  # 8 / 1K: 576 programs, over 4 per SM


def test_decode_shape_default_rule(monkeypatch):
    """Warps and stacked tiles by default (``decode_shape_default``, sessions 14, 20 and 21's timings): 1 warp
    at ``D = 128`` for up to 8 query heads a KV head with a block table of 2048+ tokens, or 64-token tiles over
    792 programs; else 2 warps for ``D = 64`` splits of 8+ tiles and ``D = 128`` splits of 16+ 128-token
    tiles; at 64-token tiles 2 warps for 2-bit values (4 warps for 4-bit) in splits of 16+ tiles, else 2
    warps from 396 programs (session 22; 792 before); 4 warps elsewhere; no stacking by default."""
    monkeypatch.setattr(launch_rules, "_num_sms", lambda index: 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    rule = launch_rules.decode_shape_default
    d64 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    g64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=128)
    k4v2 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
    k4v4_g64 = KVarNConfig.from_preset("kvarn_k4v4_g64", head_dim=128)
    # (config, tokens_m, padded heads a KV head, programs, tiles a split, device, block table width)
    # 1 warp: D = 128, up to 8 heads a KV head, 2048+ tokens of table (or 64-token tiles over 792 programs)
    assert rule(k4v2, True, 4, 1024, 33, cuda, 256) == (1, False)  # 16 x 32K
    assert rule(k4v2, True, 8, 1024, 33, cuda, 256) == (1, False)
    assert rule(k4v2, True, 4, 264, 1, cuda, 32) == (1, False)  # 1 x 4K: 33 one-tile splits
    assert rule(k4v2, True, 4, 1056, 8, cuda, 256) == (1, False)  # 4 x 32K (level with 4 warps)
    assert rule(k4v2, True, 4, 64, 2, cuda, 16) == (1, False)  # 2K of table
    assert rule(k4v2, True, 4, 72, 1, cuda, 15) == (4, False)  # 1 x 1K-2K: 4 warps were faster
    assert rule(k4v2, True, 4, 1024, 1, cuda, 8) == (4, False)  # 64 x 1K
    assert rule(k4v2, True, 16, 1024, 33, cuda, 256) == (2, False)  # 16 heads a KV head spill at 1 warp
    assert rule(g64, True, 4, 1024, 65, cuda, 512) == (1, False)  # 16 x 32K
    assert rule(g64, True, 4, 256, 2, cuda, 64) == (1, False)  # 1 x 4K
    assert rule(k4v4_g64, True, 4, 1024, 65, cuda, 512) == (1, False)
    assert rule(g64, True, 4, 1024, 8, cuda, 16) == (1, False)  # 64 x 1K: over 792 programs
    assert rule(g64, True, 4, 792, 8, cuda, 16) == (2, False)  # 2 warps from 396 programs (3 an SM)
    assert rule(g64, True, 4, 512, 3, cuda, 16) == (2, False)  # 16 x 1K, 4 splits
    assert rule(g64, True, 4, 395, 3, cuda, 16) == (4, False)
    assert rule(g64, True, 4, 64, 2, cuda, 16) == (4, False)  # 1 x 1K
    assert rule(g64, True, 4, 64, 1, cuda, 32) == (1, False)  # 2K of table
    # the older rules where 1 warp does not apply
    assert rule(d64, True, 4, 1280, 26, cuda, 256) == (2, False)  # 16 x 32K
    assert rule(d64, True, 4, 1280, 8, cuda, 256) == (2, False)
    assert rule(d64, True, 4, 1280, 7, cuda, 256) == (4, False)
    assert rule(d64, True, 4, 512, 4, cuda, 256) == (4, False)  # 1 x 32K
    assert rule(d64, False, 4, 1280, 26, cuda, 256) == (4, False)  # the row path keeps 4 warps
    assert rule(g64, True, 16, 1024, 65, cuda, 512) == (2, False)  # 16 heads: 2 warps, 2-bit values
    assert rule(g64, True, 16, 1024, 15, cuda, 512) == (2, False)  # over 792 programs
    assert rule(k4v4_g64, True, 16, 1024, 65, cuda, 512) == (4, False)  # stacking was slower for 4-bit values
    assert rule(k4v4_g64, True, 16, 1024, 5, cuda, 512) == (2, False)
    assert rule(g64, True, 16, 395, 5, cuda, 512) == (4, False)
    assert rule(k4v2, True, 16, 1024, 16, cuda, 256) == (2, False)
    assert rule(k4v2, True, 16, 1056, 8, cuda, 256) == (4, False)  # 2 warps were slower at 8 tiles a split
    assert rule(k4v2, False, 4, 1024, 32, cuda, 256) == (4, False)  # the row path keeps 4 warps
    assert rule(KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=256), True, 4, 1024, 65, cuda, 256) == (4, False)
    assert rule(d64, True, 4, 1280, 26, cpu, 256) == (4, False)
    assert rule(k4v2, True, 4, 1024, 33, cpu, 256) == (4, False)
    assert rule(KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64), True, 4, 1280, 26, cuda, 512) == (4, False)


def test_decode_shape_default_reaches_the_launch(monkeypatch):
    """The launcher takes ``decode_shape_default``'s warps and stacking (and the split count for those
    warps) unless the caller forces them; a forced ``num_warps`` wins over the rule."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [70, 200], 2, torch.float16, seed=2)
    args = attention_args(state, torch.randn(2, 8, 64).half(), cfg)
    seen, rule_args, warps_of_splits = [], [], []
    monkeypatch.setattr(attention, "_launch_attention", lambda grid, *a: seen.append((grid, a[-1])))
    monkeypatch.setattr(attention, "decode_shape_default", lambda *a: rule_args.append(a) or (2, True))
    real_splits = attention.default_splits
    monkeypatch.setattr(
        attention, "default_splits", lambda *a: warps_of_splits.append(a[-1]) or real_splits(*a)
    )  # fmt: skip
    monkeypatch.setattr(attention.PLANS, "enabled", False)
    attention.paged_attention(*args, tokens_m=True, num_splits=3)
    attention.paged_attention(*args, tokens_m=True, num_warps=4)  # forced warps: no stacking from the rule
    attention.paged_attention(*args, tokens_m=True, num_warps=2)  # the rule's warps: its stacking
    (grid, first), (_, second), (_, third) = seen
    assert (first["num_warps"], first["STACK"]) == (2, True) and grid == (2, 2, 3)
    # (config, tokens_m, padded heads a KV head, programs, tiles a split): 2 sequences x 2 KV heads x 3 splits
    width = state["block_table"].shape[1] + 1
    assert rule_args[0] == (cfg, True, 4, 12, -(-width // 3), torch.device("cpu"), width - 1)
    assert (second["num_warps"], second["STACK"]) == (4, False) and (third["num_warps"], third["STACK"]) == (2, True)
    assert warps_of_splits == [4, 4, 2]  # none for num_splits=3; a 2-warp launch asks again for its warps


def test_fold_offsets_default_rule():
    """``fold_offsets`` by default only with ``tokens_m`` at ``D = 128`` (measured faster only there)."""
    for preset in ("kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g128"):
        assert launch_rules.fold_offsets_default(KVarNConfig.from_preset(preset, head_dim=128), True)
        assert not launch_rules.fold_offsets_default(KVarNConfig.from_preset(preset, head_dim=128), False)
    for d in (64, 256):
        assert not launch_rules.fold_offsets_default(KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=d), True)


def test_paged_attention_merge_counters():
    """The in-kernel merge leaves its counters at zero (the next launch, or graph replay, reuses them)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [5 * 64 + 3, 64, 2 * 64 + 63]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=3)
    query = torch.randn(len(lengths), 4, 64).to(torch.float16)
    args = attention_args(state, query, cfg, sink=True)
    counters = torch.zeros(len(lengths) * 2, dtype=torch.int32)
    for _ in range(2):
        check_attention(attention.paged_attention(*args, num_splits=4, counters=counters), args)
        assert not counters.any()
    shared = attention.merge_counters(query.device, 6)
    check_attention(attention.paged_attention(*args, num_splits=5), args)
    assert shared.numel() >= 6 and not shared.any()
    with pytest.raises(ValueError, match="counters must be int32"):
        attention.paged_attention(*args, num_splits=4, counters=counters[:5])


def test_paged_attention_every_tail_length():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = ragged_lengths(64, 64, seed=2, max_tiles=1)
    assert sorted({n % 64 for n in lengths}) == list(range(64))
    state = build_cache(cfg, lengths, 1, torch.float16, seed=4)
    query = torch.randn(len(lengths), 2, 64).to(torch.float16)
    args = attention_args(state, query, cfg, sink=True)
    check_attention(attention.paged_attention(*args), args)


@pytest.mark.parametrize(
    "splits,fuse,merge,pair",
    [(1, None, True, None), (2, None, True, True), (2, False, False, None), (1, None, False, True)],
)
def test_paged_attention_multi_query(splits, fuse, merge, pair):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [190, 70, 64, 5, 130]
    n_q = [20, 0, 64, 5, 3]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=6)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    out = attention.paged_attention(
        *args, num_splits=splits, fuse_query=fuse, fuse_merge=merge, pair_tiles=pair, empty=poisoned_empty
    )
    check_attention(out, args)
    if splits == 2 and pair:
        out = attention.paged_attention(*args, num_splits=splits, pair_tiles=pair, fold_offsets=True)
        check_attention(out, args)


OWN_TILE_CASES = [
    # preset, hq, hkv (block of 16 // next_pow2(hq // hkv) queries), splits, knobs
    ("kvarn_k4v2_g64", 4, 2, 1, {}),
    ("kvarn_k4v2_g64", 2, 2, 3, {"pair_tiles": True, "fold_offsets": True}),
    ("kvarn_k2v2_g128", 8, 1, 2, {"fuse_query": False, "fuse_merge": False}),
]


@pytest.mark.parametrize("preset,hq,hkv,splits,knobs", OWN_TILE_CASES)
def test_paged_attention_multi_query_own_tile(preset, hq, hkv, splits, knobs):
    """Chunks under the own-tile rule, the step's K/V given: chunks starting mid-tile and at a tile's
    start, spanning two and three tiles (query blocks across a tile boundary), a query alone in a
    full tile, a first token; with the sink and split-K."""
    cfg = KVarNConfig.from_preset(preset, head_dim=64)
    g = cfg.group_size
    lengths = [g + 26, 2 * g + 22, g + 6, 3 * g, 1, 2 * g + 5]
    n_q = [40, g + 40, 6, 1, 1, 0]
    state = build_cache(cfg, lengths, hkv, torch.float16, seed=12)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), hq, 64, generator=torch.Generator().manual_seed(hq)).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    out = attention.paged_attention(*args, num_splits=splits, empty=poisoned_empty, **knobs)
    check_attention(out, args)


def test_paged_attention_multi_query_without_key():
    """Without the step's K/V a chunk within one tile reads its own tokens from the tail slot (as the
    reference); a chunk across a tile boundary is refused, as by the reference."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [90, 70, 64, 130, 128]
    n_q = [10, 6, 64, 2, 1]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=13)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(13)).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True, step_kv=False)
    assert args[-1] is None
    check_attention(attention.paged_attention(*args, num_splits=2, empty=poisoned_empty), args)
    one = torch.tensor([0, 3], dtype=torch.int32)  # positions 127 .. 129
    spans = attention_args(build_cache(cfg, [130], 2, torch.float16, seed=14), query[:3], cfg, qsl=one, step_kv=False)
    for fn in (R.paged_attention, attention.paged_attention):
        with pytest.raises(ValueError, match="span tiles"):
            fn(*spans)
    with pytest.raises(ValueError, match="key and value"):
        attention.paged_attention(*args[:-2], args[0][:, :2], None)
    with pytest.raises(ValueError, match="key and value must both be"):
        attention.paged_attention(*args[:-2], args[0], args[0])


def test_paged_attention_decode_reads_the_step_from_the_slot():
    """A decode launch reads the step's token from the tail slot: ``key, value`` change nothing (they
    are the slot's token once ``write_tail`` put them there, as the lifecycle does before attention)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [64, 65, 128, 3 * 64 + 17]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=15)
    query = torch.randn(len(lengths), 4, 64, generator=torch.Generator().manual_seed(15)).to(torch.float16)
    k, v = make_kv(1, len(lengths), 2, 64, torch.float16, seed=15)
    mapping = torch.tensor(
        [int(slot) * 64 + (n - 1) % 64 for slot, n in zip(state["tail_slots"], lengths, strict=True)]
    )
    R.write_tail(k[0], v[0], state["tail_k"], state["tail_v"], mapping, cfg)
    args = attention_args(state, query, cfg, sink=True)
    want = attention.paged_attention(*args, num_splits=2)
    check_attention(want, args)
    with_kv = (*args[:-2], k[0], v[0])
    assert torch.equal(attention.paged_attention(*with_kv, num_splits=2), want)
    check_attention(want, with_kv)  # the reference, reading key/value, agrees


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` again, as a view with every stride doubled (the kernels read index lists at base + i)."""
    return torch.stack([t, torch.full_like(t, 10**6)], dim=-1)[..., 0]  # the 10**6 must never be read


def test_index_lists_given_as_strided_views():
    """seq_lens, query_start_loc, tail and sink slots and the tail mapping given as strided views: the
    same output and pool bytes as with plain tensors (a block table must have unit last stride)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [190, 70, 5, 130]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=8)
    qsl = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    views = list(args)
    for i in (3, 6, 8, 9):  # seq_lens, tail_slots, query_start_loc, sink_slots
        views[i] = _strided(args[i])
        assert torch.equal(views[i], args[i]) and not views[i].is_contiguous()
    want = attention.paged_attention(*args, num_splits=2)
    assert torch.equal(attention.paged_attention(*views, num_splits=2), want)
    views[2] = _strided(args[2])
    with pytest.raises(ValueError, match=r"block_table must be .* unit last stride"):
        attention.paged_attention(*views, num_splits=2)
    k, v = make_kv(1, 70, 2, 64, torch.float16, seed=9)
    mapping = torch.cat([torch.arange(64) + 64, torch.tensor([-1, 128, 129, -5, 0, 3])])
    pools = [torch.full((3, 64, 2, 64), float("nan"), dtype=torch.float16) for _ in range(4)]
    store.write_tail(k[0], v[0], pools[0], pools[1], mapping, cfg)
    store.write_tail(k[0], v[0], pools[2], pools[3], _strided(mapping), cfg)
    for a, b in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "epilogue"])
def test_paged_attention_into_out_and_tail_from_views_of_qkv(merge):
    """``out=`` (a strided view of a larger buffer, as vLLM's output) gets the call's result bit for bit and
    nothing around it changes; ``write_tail`` of K and V given as views of one fused qkv tensor (shared,
    non-contiguous strides: read in place) writes the pool bytes of contiguous copies."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    lengths = [190, 70, 5]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=11)
    query = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(11)).to(torch.float16)
    args = attention_args(state, query, cfg, sink=True)
    want = attention.paged_attention(*args, num_splits=2, fuse_merge=merge)
    buf = torch.full((5, 4, 72), float("nan"), dtype=torch.float16)
    out = buf[1:4, :, :64]
    got = attention.paged_attention(*args, num_splits=2, fuse_merge=merge, out=out)
    assert got is out and torch.equal(out, want)
    assert buf[[0, 4]].isnan().all() and buf[1:4, :, 64:].isnan().all(), "wrote outside out"
    with pytest.raises(ValueError, match="out must be"):
        attention.paged_attention(*args, out=torch.empty(3, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must not share memory with query"):
        attention.paged_attention(*args, out=args[0])
    qkv = torch.randn(70, 8 * 64, generator=torch.Generator().manual_seed(12)).to(torch.float16)
    k, v = qkv[:, 4 * 64 : 6 * 64].view(70, 2, 64), qkv[:, 6 * 64 :].view(70, 2, 64)
    assert not k.is_contiguous() and k.stride() == v.stride()
    mapping = torch.cat([torch.arange(64) + 64, torch.tensor([-1, 128, 129, -5, 0, 3])])
    pools = [torch.full((3, 64, 2, 64), float("nan"), dtype=torch.float16) for _ in range(4)]
    store.write_tail(k, v, pools[0], pools[1], mapping, cfg)
    store.write_tail(k.contiguous(), v.contiguous(), pools[2], pools[3], mapping, cfg)
    for a, b in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_kernels_reject_bad_input():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k = torch.zeros(1, 64, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        store.encode_records(k, k, cfg)
    with pytest.raises(ValueError, match="records must be uint8"):
        dequant.decode_records(torch.zeros(1, 7, dtype=torch.uint8), cfg)
    with pytest.raises(ValueError, match="cache must be uint8"):
        store.store_tiles(k[None].half(), k[None].half(), torch.zeros(1), torch.zeros(1, 1, 3, dtype=torch.uint8), cfg)
    state = build_cache(cfg, [70], 1, torch.float16, seed=0)
    args = attention_args(state, torch.zeros(1, 2, 64, dtype=torch.float16), cfg)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            attention.paged_attention(*args, num_splits=bad)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_record_layout_is_the_configs(preset, d, smooth):
    cfg = KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=smooth)
    layout = _common.record_layout(cfg)
    assert (layout.D, layout.G, layout.K_BITS, layout.V_BITS) == (d, cfg.group_size, cfg.k_bits, cfg.v_bits)
    assert (layout.K_PER_BYTE, layout.V_PER_BYTE) == (8 // cfg.k_bits, 8 // cfg.v_bits)
    offsets = {name.lower(): getattr(layout, name) for name in layout._fields[6:]}
    assert offsets.pop("seq_smooth") is False
    assert offsets.pop("k_smooth") == cfg.offsets.get("k_smooth", -1)
    assert offsets == {k: v for k, v in cfg.offsets.items() if k != "k_smooth"}


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


# Key smoothing (``KVarNConfig(smooth_keys=True)``): the kernels against the reference's smoothed records.


def _smooth_cfg(preset: str, d: int) -> KVarNConfig:
    return KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=True)


@pytest.mark.parametrize(
    "preset,d", [("kvarn_k4v2_g64", 64), ("kvarn_k2v2_g128", 64), ("kvarn_k4v4_g64", 128), ("kvarn_k4v2_g64", 256)]
)
def test_decode_records_smooth_is_exact(preset, d):
    cfg = _smooth_cfg(preset, d)
    k, v = make_kv(2, cfg.group_size, 1, d, torch.bfloat16, seed=17)
    rec = R.encode_records(R.prepare(k[:, :, 0]), R.prepare(v[:, :, 0]), cfg)
    s = R.unpack_record(rec, cfg)[0].smooth.float()
    assert float(s.min()) < 0.5, "the test tiles should smooth some channel"
    gk, gv = dequant.decode_records(rec, cfg, empty=poisoned_empty)
    wk, wv = R.decode_records(rec, cfg)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


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
    cfg = _smooth_cfg(preset, d)
    k, v = make_kv(2, cfg.group_size, 1, d, dtype, seed=d + cfg.k_bits)
    kr, vr = R.prepare(k[:, :, 0], dtype), R.prepare(v[:, :, 0], dtype)
    got = store.encode_records(kr, vr, cfg, empty=poisoned_empty)
    want = R.encode_records(kr, vr, cfg)
    assert float(R.unpack_record(want, cfg)[0].smooth.float().min()) < 0.5, "the test tiles should smooth some channel"
    stats = check_records(got, want, kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0


@pytest.mark.parametrize("kind", ["zero", "constant", "huge", "tiny"])
def test_encode_records_smooth_hard_tiles(kind):
    cfg = _smooth_cfg("kvarn_k4v2_g64", 64)
    k, v = make_kv(1, 64, 1, 64, torch.bfloat16, seed=7, kind=kind)
    kr, vr = R.prepare(k[:, :, 0], torch.bfloat16), R.prepare(v[:, :, 0], torch.bfloat16)
    check_records(store.encode_records(kr, vr, cfg), R.encode_records(kr, vr, cfg), kr, vr, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_store_tiles_and_commit_smooth(dtype):
    """store_tiles and write_tail + commit_tiles of a smoothed format: the reference's records, one path's bytes."""
    cfg = _smooth_cfg("kvarn_k4v2_g64", 64)
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


def test_fp8_helpers_match_torch():
    """fp8 e4m3 rounding, bits and decoding in integer arithmetic equal torch's ``float8_e4m3fn`` casts."""
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_roundtrip(x_ptr, r_ptr, b_ptr, d_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        r = _common.fp8e4m3_round(tl.load(x_ptr + i))
        tl.store(r_ptr + i, r)
        tl.store(b_ptr + i, _common.fp8e4m3_bits(r))
        tl.store(d_ptr + i, _common.fp8e4m3_to_f32(tl.load(b_ptr + 256 + i)))

    gen = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(256).uniform_(-6, 0, generator=gen))  # the smoothing factors' range
    grid = torch.arange(1, 9) / 8 * 2.0**-6  # exact values and midpoints (ties to even) at the low end
    x[:16] = torch.cat([2.0**-6 + grid / 16, 1 - grid / 16])
    x[-1] = 1.0
    r = torch.empty_like(x)
    b = torch.zeros(512, dtype=torch.uint8)
    b[256:] = torch.arange(256, dtype=torch.uint8)
    b[256 + 0x7F] = b[256 + 0xFF] = 0  # NaN bytes: not decoded
    out = torch.empty(256)
    _fp8_roundtrip[(1,)](x, r, b, out, N=256)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(r, want.float())
    assert torch.equal(b[:256], want.view(torch.uint8))
    assert torch.equal(out, b[256:].view(torch.float8_e4m3fn).float())


SMOOTH_ATTN_CASES = [
    ("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, None, None),
    ("kvarn_k2v2_g128", 64, torch.bfloat16, 4, 2, False, 2, None),
    ("kvarn_k4v2_g64", 128, torch.float16, 2, 1, True, 3, True),
    ("kvarn_k2v2_g128", 128, torch.float16, 2, 2, True, 1, None),
    ("kvarn_k4v2_g64", 256, torch.bfloat16, 2, 1, True, 2, None),
]


@pytest.mark.parametrize("preset,d,dtype,hq,hkv,sink,splits,pair", SMOOTH_ATTN_CASES)
def test_paged_attention_decode_smooth(preset, d, dtype, hq, hkv, sink, splits, pair):
    cfg = _smooth_cfg(preset, d)
    lengths = ragged_lengths(cfg.group_size, 6, seed=d + hq)
    state = build_cache(cfg, lengths, hkv, dtype, seed=1)
    gen = torch.Generator().manual_seed(d)
    query = torch.randn(len(lengths), hq, d, generator=gen)
    query[..., 3] *= 20  # a large query channel where the keys' channel 3 is smoothed (make_kv's outlier)
    args = attention_args(state, query.to(dtype), cfg, sink=sink)
    out = attention.paged_attention(*args, num_splits=splits, pair_tiles=pair, empty=poisoned_empty)
    check_attention(out, args)


def test_paged_attention_decode_smooth_paired_tiles_of_two_scales():
    """Two tiles a step whose smoothed queries differ in their power of two: each tile's scores take their own
    ``rf`` in the softmax (``_quantized_tiles``'s ``rf2``)."""
    cfg = _smooth_cfg("kvarn_k4v2_g64", 64)
    lengths = [4 * 64 + 5, 3 * 64]
    state = build_cache(cfg, lengths, 1, torch.float16, seed=3)
    for b, n in enumerate(n // 64 for n in lengths):  # stored again: even tiles Gaussian, odd ones one large channel
        k, v = make_kv(n, 64, 1, 64, torch.float16, seed=b, kind="plain")
        k[1::2, ..., 7] *= 64  # smoothing scales their other channels by ~1/8
        R.store_tiles(k, v, state["block_table"][b, :n], state["cache"], cfg)
    query = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(5))
    args = attention_args(state, query.to(torch.float16), cfg)
    check_attention(attention.paged_attention(*args, num_splits=1, pair_tiles=True, empty=poisoned_empty), args)


def test_paged_attention_multi_query_smooth():
    cfg = _smooth_cfg("kvarn_k4v2_g64", 64)
    lengths = [190, 70, 5, 130]
    n_q = [20, 0, 5, 3]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=6)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    check_attention(attention.paged_attention(*args, num_splits=2, empty=poisoned_empty), args)


def test_paged_attention_smooth_refuses_unimplemented_variants():
    cfg = _smooth_cfg("kvarn_k4v2_g64", 64)
    state = build_cache(cfg, [70], 1, torch.float16, seed=0)
    args = attention_args(state, torch.zeros(1, 2, 64, dtype=torch.float16), cfg)
    for knobs in ({"fuse_query": False}, {"tokens_m": True}):
        with pytest.raises(ValueError, match="smooth_keys"):
            attention.paged_attention(*args, **knobs)


# One smoothing vector per sequence (``smooth_scope="sequence"``).


def _seq_cfg(preset: str, d: int) -> KVarNConfig:
    return KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=True, smooth_scope="sequence")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_store_and_commit_sequence_smooth(dtype):
    """The first tile publishes its vector, later tiles (same call or later) take it: the reference's bytes."""
    cfg = _seq_cfg("kvarn_k4v2_g64", 64)
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

    cfg = _seq_cfg("kvarn_k4v2_g64", 64)
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
    cfg = _seq_cfg("kvarn_k2v2_g128", 64)
    k, v = make_kv(2, 128, 1, 64, torch.float16, seed=29)
    kr, vr = R.prepare(k[:, :, 0], torch.float16), R.prepare(v[:, :, 0], torch.float16)
    stats = check_records(store.encode_records(kr, vr, cfg), R.encode_records(kr, vr, cfg), kr, vr, cfg)
    assert stats["k_smooth_equal"] == 1.0


SEQ_SMOOTH_ATTN_CASES = [
    # preset, d, dtype, hq, hkv, sink, splits, knobs
    ("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, None, {}),
    ("kvarn_k2v2_g128", 64, torch.bfloat16, 4, 2, False, 2, {"fuse_query": False}),
    ("kvarn_k4v2_g128", 128, torch.float16, 4, 1, True, 2, {"tokens_m": True}),
    (
        "kvarn_k4v2_g128",
        128,
        torch.bfloat16,
        2,
        2,
        True,
        1,
        {"fuse_query": False, "tokens_m": True, "fold_offsets": True},
    ),
    ("kvarn_k4v2_g64", 128, torch.float16, 2, 1, True, 3, {"pair_tiles": True}),
    ("kvarn_k4v2_g64", 256, torch.bfloat16, 2, 1, False, 2, {}),
]


@pytest.mark.parametrize("preset,d,dtype,hq,hkv,sink,splits,knobs", SEQ_SMOOTH_ATTN_CASES)
def test_paged_attention_decode_sequence_smooth(preset, d, dtype, hq, hkv, sink, splits, knobs):
    cfg = _seq_cfg(preset, d)
    lengths = ragged_lengths(cfg.group_size, 6, seed=d + hq + 1)
    state = build_cache(cfg, lengths, hkv, dtype, seed=2)
    gen = torch.Generator().manual_seed(d + 1)
    query = torch.randn(len(lengths), hq, d, generator=gen)
    query[..., 3] *= 20  # a large query channel where the keys' channel 3 is smoothed (make_kv's outlier)
    args = attention_args(state, query.to(dtype), cfg, sink=sink)
    out = attention.paged_attention(*args, num_splits=splits, empty=poisoned_empty, **knobs)
    check_attention(out, args, conditioned=True)


@pytest.mark.parametrize(
    "preset,knobs", [("kvarn_k4v2_g64", {}), ("kvarn_k4v2_g128", {"fuse_query": False})], ids=["g64", "g128_prologue"]
)
def test_paged_attention_multi_query_sequence_smooth(preset, knobs):
    cfg = _seq_cfg(preset, 64)
    g = cfg.group_size
    lengths = [3 * g - 2, g + 6, 5, 2 * g + 2]
    n_q = [20, 0, 5, 3]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=6)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(g)).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    out = attention.paged_attention(*args, num_splits=2, empty=poisoned_empty, **knobs)
    check_attention(out, args, conditioned=True)


@pytest.mark.parametrize(
    "min_tiles,merge,tokens_m,multi_q,splits",
    [
        (2, True, False, False, 4),
        (3, False, False, False, 4),
        (2, True, True, False, 4),
        (3, True, False, True, 4),
        (1, True, False, False, 67),
    ],
)
def test_paged_attention_min_split_tiles(min_tiles, merge, tokens_m, multi_q, splits):
    """``min_split_tiles``: short sequences use fewer, fuller splits of a launch sized for long ones.

    Lengths from one token to several tiles, so some sequences fill every split, some only the
    first ``n_act`` (the others exit, and the merge reads only those), some one split; with the
    splits merged in the kernel and in the epilogue (which reads the empty partials too). 67
    splits over a 66-unit sequence: the merge's scan of the running maxima takes two loads.
    """
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128" if tokens_m else "kvarn_k4v2_g64", head_dim=64)
    g = cfg.group_size
    lengths = [1, g - 3, g + 1, 2 * g + 5, 5 * g + 17, 9 * g, 3 * g + 64]
    if splits > 64:
        lengths = [65 * g + 10, 3 * g + 1]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=21)
    qsl = None
    n = len(lengths)
    if multi_q:
        n_q = [1, 20, 1, 3, 40, 1, 2][: len(lengths)]
        qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
        n = int(qsl[-1])
    query = torch.randn(n, 4, 64, generator=torch.Generator().manual_seed(min_tiles)).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    knobs = {"tokens_m": True} if tokens_m else {}
    counters = torch.zeros(64, dtype=torch.int32)
    out = attention.paged_attention(
        *args,
        num_splits=splits,
        min_split_tiles=min_tiles,
        fuse_merge=merge,
        counters=counters if merge else None,
        empty=poisoned_empty,
        **knobs,
    )
    check_attention(out, args)
    assert not counters.any()
