"""Sliding windows and learned sink logits in the attention kernels, against the reference, under the Triton
interpreter on tiny shapes (``interpreted.py``), in every launch variant the launch rules can pick.

Every case poisons what the window leaves unread (:func:`kernel_oracle.poison_before_window`: block-table entries
before each sequence's window point at a block of NaN scales, a sink slot the window has left at a NaN slot), so a
kernel that reads one fails, and fills the outputs and workspaces with NaN (``poisoned_empty``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreted import INTERPRETER_MARKS, attention, launch_rules, seq_cfg, smooth_cfg
from kernel_oracle import (
    DECODE_VARIANTS,
    MULTI_QUERY_VARIANTS,
    attention_args,
    build_cache,
    check_attention,
    poison_before_window,
    poisoned_empty,
    with_block_tails,
)

from kvarn import reference as R
from kvarn.config import KVarNConfig

pytestmark = INTERPRETER_MARKS

G64_LENGTHS = [1, 5, 64, 65, 100, 129, 200, 257]
"""Decode lengths over 64-token tiles: a first token, inside tile 0, at and past tile boundaries, four tiles."""


def _logits(hq: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Sink logits of mixed size: some below every score, some above."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=gen) * 3).to(dtype)


def _decode_args(preset, d, dtype, hq, hkv, sink, window, lengths=G64_LENGTHS, seed=1, cfg=None):
    cfg = cfg or KVarNConfig.from_preset(preset, head_dim=d)
    state = build_cache(cfg, lengths, hkv, dtype, seed=seed)
    query = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(seed + d)).to(dtype)
    return poison_before_window(attention_args(state, query, cfg, sink=sink), window)


def _run(args, window, logits, conditioned=False, **knobs):
    out = attention.paged_attention(*args, window=window, sink_logits=logits, empty=poisoned_empty, **knobs)
    return check_attention(out, args, conditioned, window=window, sink_logits=logits)


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("window", [7, 64, 90], ids=lambda w: f"W{w}")
def test_decode_window_and_sink_logits(variant, window):
    """Windows whose edge falls inside a tile (7, 90) and on one (64), with the sink slot and sink logits."""
    args = _decode_args("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, window)
    _run(args, window, _logits(4), **DECODE_VARIANTS[variant])


@pytest.mark.parametrize(
    "preset,d,dtype,hq,hkv,window,knobs",
    [
        ("kvarn_k2v2_g128", 64, torch.float16, 6, 2, 1, {"tokens_m": True}),  # four K fields, a window of one key
        ("kvarn_k4v4_g64", 128, torch.bfloat16, 2, 2, 130, {"num_splits": 2}),
        ("kvarn_k4v2_g128", 64, torch.bfloat16, 8, 1, 300, {"num_splits": 3, "fuse_merge": False}),  # past the sequence
        ("kvarn_k4v2_g64", 256, torch.float16, 2, 1, 100, {"num_splits": 2}),
        ("kvarn_k4v2_g128", 128, torch.float16, 4, 1, 128, {"tokens_m": True, "stack_tiles": True}),
    ],
)
def test_decode_window_shapes(preset, d, dtype, hq, hkv, window, knobs):
    """Other tiles, head dims, bit widths and dtypes (bf16 logits with bf16 queries)."""
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    lengths = [1, 3, cfg.group_size, cfg.group_size + 9, 2 * cfg.group_size + 40, 3 * cfg.group_size + 1]
    args = _decode_args(preset, d, dtype, hq, hkv, True, window, lengths=lengths, seed=2)
    _run(args, window, _logits(hq, dtype, seed=d), **knobs)


@pytest.mark.parametrize("window", [None, 50], ids=["no_window", "W50"])
@pytest.mark.parametrize("logits", [False, True], ids=["no_logits", "logits"])
@pytest.mark.parametrize("knobs", [{"tokens_m": True}, {"tokens_m": False, "num_splits": 2}], ids=["tok_m", "rows"])
def test_decode_own_tiles_in_block_rows(window, logits, knobs):
    """Own tiles kept as rows of the cache's blocks (``TAIL_ROWS``, decode without a sink slot)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    pooled = build_cache(cfg, G64_LENGTHS, 2, torch.float16, seed=3)
    query = torch.randn(len(G64_LENGTHS), 4, 64, generator=torch.Generator().manual_seed(3)).half()
    args = poison_before_window(attention_args(with_block_tails(pooled, cfg, seed=4), query, cfg), window)
    _run(args, window, _logits(4) if logits else None, **knobs)


@pytest.mark.parametrize("variant", list(MULTI_QUERY_VARIANTS))
@pytest.mark.parametrize("window", [1, 40, 64, 100], ids=lambda w: f"W{w}")
def test_multi_query_window_and_sink_logits(variant, window):
    """Chunks under the own-tile rule (mid-tile starts, spanning tiles, a first token, a query alone in a full
    tile), the step's K/V given; query blocks whose queries' windows start in different tiles."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g = cfg.group_size
    lengths = [g + 26, 3 * g + 22, g + 6, 3 * g, 1, 2 * g + 5]
    n_q = [40, 2 * g + 10, 6, 1, 1, 0]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=12)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    args = poison_before_window(attention_args(state, query, cfg, qsl=qsl, sink=True), window)
    _run(args, window, _logits(4, seed=window), **MULTI_QUERY_VARIANTS[variant])


def test_multi_query_window_without_key():
    """Chunks within one tile read their own tokens from the tail slot (no step K/V), within the window."""
    cfg = KVarNConfig.from_preset("kvarn_k2v2_g128", head_dim=64)
    lengths = [300, 140, 128, 260]
    n_q = [10, 6, 64, 2]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=13)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 8, 64, generator=torch.Generator().manual_seed(13)).to(torch.float16)
    args = poison_before_window(attention_args(state, query, cfg, qsl=qsl, sink=True, step_kv=False), 70)
    _run(args, 70, _logits(8, torch.bfloat16), num_splits=2)


@pytest.mark.parametrize(
    "preset,d,dtype,knobs",
    [
        ("kvarn_k4v2_g64", 64, torch.float16, {}),
        ("kvarn_k2v2_g128", 64, torch.bfloat16, {"fuse_query": False, "num_splits": 2}),  # the prologue smooths
        ("kvarn_k4v2_g128", 128, torch.float16, {"tokens_m": True, "num_splits": 2}),
        ("kvarn_k4v2_g64", 128, torch.float16, {"pair_tiles": True, "num_splits": 3}),
    ],
)
def test_decode_sequence_smooth_window(preset, d, dtype, knobs):
    """One smoothing vector a sequence, read from the first record in the window: block-table entry 0 is
    poisoned too where the window has left it."""
    cfg = seq_cfg(preset, d)
    g = cfg.group_size
    lengths = [3, g + 2, 2 * g + 40, 3 * g + 7, 4 * g]
    gen = torch.Generator().manual_seed(d + 1)
    query = torch.randn(len(lengths), 4, d, generator=gen)
    query[..., 3] *= 20  # a large query channel where the keys' channel 3 is smoothed (make_kv's outlier)
    state = build_cache(cfg, lengths, 2, dtype, seed=2)
    window = g + 10
    args = poison_before_window(attention_args(state, query.to(dtype), cfg, sink=True), window)
    _run(args, window, _logits(4, seed=1), conditioned=True, **knobs)


@pytest.mark.parametrize("cfg_of", [seq_cfg, smooth_cfg], ids=["sequence", "per_tile"])
def test_multi_query_smooth_window(cfg_of):
    cfg = cfg_of("kvarn_k4v2_g64", 64)
    lengths = [190, 70, 5, 260]
    n_q = [20, 0, 5, 70]
    state = build_cache(cfg, lengths, 2, torch.float16, seed=6)
    qsl = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    args = poison_before_window(attention_args(state, query, cfg, qsl=qsl, sink=True), 80)
    _run(args, 80, _logits(4, seed=2), conditioned=True, num_splits=2)


def test_decode_per_tile_smooth_window():
    cfg = smooth_cfg("kvarn_k4v2_g64", 64)
    args = _decode_args(None, 64, torch.float16, 4, 2, True, 90, cfg=cfg)
    _run(args, 90, _logits(4, seed=3), conditioned=True, num_splits=2)


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "epilogue"])
def test_empty_sequence_and_idle_splits_with_window(merge):
    """A padding row (length 0) gets zeros with sink logits too, and the counters end at zero, with splits that
    the window leaves idle (``min_split_tiles``)."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    g = cfg.group_size
    state = build_cache(cfg, [3 * g + 5, 70, 9 * g], 2, torch.float16, seed=22)
    query = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    args = list(attention_args(state, query[[0, 2, 3]], cfg))
    table, lens, slots = args[2], args[3], args[6]
    args[0] = query
    args[2] = torch.cat([table[:1], torch.zeros_like(table[:1]), table[1:]])
    args[3] = torch.cat([lens[:1], torch.zeros_like(lens[:1]), lens[1:]])
    args[6] = torch.cat([slots[:1], torch.zeros_like(slots[:1]), slots[1:]])
    args = poison_before_window(tuple(args), 200)
    counters = torch.zeros(16, dtype=torch.int32)
    z = _logits(4)
    out = attention.paged_attention(
        *args, window=200, sink_logits=z, num_splits=4, min_split_tiles=1, fuse_merge=merge,
        counters=counters if merge else None, empty=poisoned_empty,
    )  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not counters.any()
    keep = [0, 2, 3]
    ref = R.paged_attention(query[keep].float(), *args[1:2], args[2][keep], args[3][keep], *args[4:6],
                            args[6][keep], cfg, window=200, sink_logits=z)  # fmt: skip
    err = float((out[keep].float() - ref).abs().max()) / float(ref.abs().max())
    assert err < 1e-2


def test_no_window_and_minus_infinity_logits_change_no_bit():
    """A window past every sequence, and sink logits of ``-inf``, give the plain launch's output bit for bit."""
    args = _decode_args("kvarn_k4v2_g64", 64, torch.float16, 4, 2, True, None)
    for knobs in ({"tokens_m": True, "num_splits": 2}, {"num_splits": 3, "fuse_merge": False}):
        plain = attention.paged_attention(*args, **knobs)
        assert torch.equal(attention.paged_attention(*args, window=258, **knobs), plain)
        minus_inf = torch.full((4,), float("-inf"))
        assert torch.equal(attention.paged_attention(*args, sink_logits=minus_inf, **knobs), plain)


def test_window_splits_count_the_visible_tiles(monkeypatch):
    """The default split count, warps and query rotation are chosen from the tiles a window leaves, not from the
    block table's width (:func:`~kvarn.kernels.launch_rules.visible_units`)."""
    assert launch_rules.visible_units(40, 64, None) == 40
    assert launch_rules.visible_units(40, 64, 1) == 1
    assert launch_rules.visible_units(40, 64, 64) == 2
    assert launch_rules.visible_units(40, 64, 65) == 2
    assert launch_rules.visible_units(40, 64, 66) == 3
    assert launch_rules.visible_units(40, 64, 64, block_q=4) == 3
    assert launch_rules.visible_units(2, 64, 1000) == 2
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [30 * 64 + 5, 200], 2, torch.float16, seed=2)
    args = attention_args(state, torch.randn(2, 4, 64).half(), cfg)
    seen = []
    real = attention.default_splits
    monkeypatch.setattr(attention, "default_splits", lambda *a: seen.append(a[2]) or real(*a))
    monkeypatch.setattr(attention.PLANS, "enabled", False)
    attention.paged_attention(*args)
    attention.paged_attention(*args, window=100)
    assert seen == [32, 3]


def test_window_and_sink_logits_are_checked():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    state = build_cache(cfg, [70], 1, torch.float16, seed=1)
    args = attention_args(state, torch.randn(1, 2, 64).half(), cfg)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            attention.paged_attention(*args, window=bad)
    for bad in (torch.zeros(3), torch.zeros(2, 1), torch.zeros(2, dtype=torch.float64), torch.zeros(2).int()):
        with pytest.raises(ValueError, match=r"sink_logits must be one fp32, fp16 or bf16 logit per query head, \[2\]"):
            attention.paged_attention(*args, sink_logits=bad)
    strided = torch.tensor([[0.5, 9.0], [-1.0, 9.0]])[:, 0]
    out = attention.paged_attention(*args, sink_logits=strided)
    check_attention(out, args, sink_logits=strided)
