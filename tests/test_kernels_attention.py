"""Attention kernels (``kvarn.kernels.attention`` and the kernels it launches) against the reference,
under the Triton interpreter on tiny shapes (``interpreted.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreted import INTERPRETER_MARKS, attention, launch_rules, seq_cfg, smooth_cfg, store
from kernel_oracle import (
    attention_args,
    build_cache,
    check_attention,
    make_kv,
    poisoned_empty,
    ragged_lengths,
    with_block_tails,
)

from kvarn import reference as R
from kvarn.config import KVarNConfig

pytestmark = INTERPRETER_MARKS


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


SMOOTH_ATTN_CASES = [
    ("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, None, None),
    ("kvarn_k2v2_g128", 64, torch.bfloat16, 4, 2, False, 2, None),
    ("kvarn_k4v2_g64", 128, torch.float16, 2, 1, True, 3, True),
    ("kvarn_k2v2_g128", 128, torch.float16, 2, 2, True, 1, None),
    ("kvarn_k4v2_g64", 256, torch.bfloat16, 2, 1, True, 2, None),
]


@pytest.mark.parametrize("preset,d,dtype,hq,hkv,sink,splits,pair", SMOOTH_ATTN_CASES)
def test_paged_attention_decode_smooth(preset, d, dtype, hq, hkv, sink, splits, pair):
    cfg = smooth_cfg(preset, d)
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
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
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
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
    lengths = [190, 70, 5, 130]
    n_q = [20, 0, 5, 3]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=6)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64).to(torch.float16)
    args = attention_args(state, query, cfg, qsl=qsl, sink=True)
    check_attention(attention.paged_attention(*args, num_splits=2, empty=poisoned_empty), args)


def test_paged_attention_smooth_refuses_unimplemented_variants():
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
    state = build_cache(cfg, [70], 1, torch.float16, seed=0)
    args = attention_args(state, torch.zeros(1, 2, 64, dtype=torch.float16), cfg)
    for knobs in ({"fuse_query": False}, {"tokens_m": True}):
        with pytest.raises(ValueError, match="smooth_keys"):
            attention.paged_attention(*args, **knobs)


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
    cfg = seq_cfg(preset, d)
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
    cfg = seq_cfg(preset, 64)
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
