"""The KVarN backend class: pages of one record per KV head, the block sizes it takes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvarn.config import PRESETS, KVarNConfig
from kvarn.integration.vllm.registry import BACKENDS

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("preset", list(PRESETS))
def test_customize_spec_pages_hold_one_record_per_kv_head(preset):
    for d in (64, 128, 256):
        cfg = KVarNConfig.from_preset(preset, head_dim=d)
        spec = FullAttentionSpec(block_size=1, num_kv_heads=3, head_size=d, dtype=torch.bfloat16)
        per_token = BACKENDS[preset].customize_spec(spec)
        assert per_token.dtype == torch.uint8
        assert per_token.page_size_bytes * cfg.group_size == 3 * cfg.record_bytes
        block = BACKENDS[preset].customize_spec(spec.copy_with_new_block_size(cfg.group_size))
        assert block.page_size_bytes == 3 * cfg.record_bytes
        assert BACKENDS[preset].get_preferred_block_size(16) == cfg.group_size
        assert BACKENDS[preset].get_supported_kernel_block_sizes(block) == [cfg.group_size]
        assert BACKENDS[preset].supports_block_size(cfg.group_size)
        assert BACKENDS[preset].supports_block_size(4 * cfg.group_size)
        assert not BACKENDS[preset].supports_block_size(cfg.group_size // 2)
