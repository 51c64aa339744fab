"""The launch rules (``kvarn.kernels.launch_rules``): what a launch takes by default for a shape, on a
simulated GPU of 132 SMs (no kernel runs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvarn.config import KVarNConfig
from kvarn.kernels import _common, launch_rules


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
    assert launch_rules.tokens_m_default(d256, False, 8, cuda)  # batch 1 at 4K, timed
    assert not launch_rules.tokens_m_default(k4v2, True, 10 * wave2, cuda)
    assert launch_rules.tokens_m_default(g64, False, 10 * wave2, cuda)
    assert launch_rules.tokens_m_default(g64, False, 8, cuda)
    g64_d64 = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    assert not launch_rules.tokens_m_default(g64_d64, False, 10 * wave2, cuda)
    assert launch_rules.pair_tiles_default(g64) and not launch_rules.pair_tiles_default(g64, tokens_m=True)
    assert not launch_rules.pair_tiles_default(g64_d64) and not launch_rules.pair_tiles_default(k4v2)
    assert not launch_rules.tokens_m_default(k4v2, False, 10 * wave2, cpu)


def test_fuse_query_rotation_one_warp_waves(monkeypatch):
    """One-warp launches at D = 128 keep the prologue where the in-kernel rotation's shared memory would cost the
    programs that get units a wave: none at 8 fused programs an SM; the rule checked with 7 fused programs an SM
    with 2-bit V and 6 with 4-bit V."""
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


def test_split_rule_on_an_h200(monkeypatch):
    """The decode launch the defaults pick on 132 SMs (8 KV heads, 128-token tiles): (splits, merge in
    the kernel, rotation in the kernel), the launches timed in the tuning table of
    ``docs/internals/kernels.md``."""
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
    assert launch_rules.default_splits(g64, 128, 513, False, cuda) == 8  # 16 x 32K, timed
    # one-tile splits up to 2 programs per SM, 4 at D = 64 (half a tile's work; 4 / 1K timed)
    d64 = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64)
    assert launch(4, 1024)[0] == 4 and launch_rules.default_splits(d64, 32, 9, False, cuda) == 9
    assert launch_rules.default_splits(d64, 64, 9, False, cuda) == 4  # 8 / 1K: 576 programs, over 4 per SM


def test_decode_shape_default_rule(monkeypatch):
    """Warps and stacked tiles by default (``decode_shape_default``, the tuning table's timings): 1 warp
    at ``D = 128`` for up to 8 query heads a KV head with a block table of 2048+ tokens, or 64-token tiles over
    792 programs; else 2 warps for ``D = 64`` splits of 8+ tiles and ``D = 128`` splits of 16+ 128-token
    tiles; at 64-token tiles 2 warps for 2-bit values (4 warps for 4-bit) in splits of 16+ tiles, else 2
    warps from 396 programs; 4 warps elsewhere; no stacking by default."""
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


def test_fold_offsets_default_rule():
    """``fold_offsets`` by default only with ``tokens_m`` at ``D = 128`` (measured faster only there)."""
    for preset in ("kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g128"):
        assert launch_rules.fold_offsets_default(KVarNConfig.from_preset(preset, head_dim=128), True)
        assert not launch_rules.fold_offsets_default(KVarNConfig.from_preset(preset, head_dim=128), False)
    for d in (64, 256):
        assert not launch_rules.fold_offsets_default(KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=d), True)
