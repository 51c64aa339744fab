"""The kernel oracle's attention check itself: it accepts the reference and rejects a wrong output.

Runs on the CPU with the reference only (no Triton).
"""

import pytest
import torch
from kernel_oracle import attention_args, build_cache, check_attention, query_sensitivity

from kvarn import reference as R
from kvarn.config import KVarNConfig


def _sharp_case():
    """A smoothed k4v2 cache and fp16 queries with a 10x channel on the keys' outlier channel."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64, smooth_keys=True)
    state = build_cache(cfg, [300, 129, 520], 2, torch.float16, seed=3)
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(3, 4, 64, generator=gen) * 2
    query[..., 3] *= 10
    return attention_args(state, query.half(), cfg, sink=True)


def test_the_conditioned_check_accepts_the_reference_rounded_to_the_query_dtype():
    args = _sharp_case()
    out = R.paged_attention(args[0].float(), *args[1:]).to(args[0].dtype)
    assert check_attention(out, args, conditioned=True) < 1e-3
    assert 0 < query_sensitivity(args) < 0.05


def test_the_conditioned_check_rejects_a_missing_tile():
    args = _sharp_case()
    table = args[2].clone()
    table[0, 1] = table[0, 0]  # sequence 0 reads its first tile twice, its second never
    wrong = R.paged_attention(args[0].float(), args[1], table, *args[3:]).to(args[0].dtype)
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_attention(wrong, args, conditioned=True)
