"""kvarn.paged.storage: PagedKV carries out a plan, and attention follows the own-tile rule."""

import pytest
import torch
from paged_steps import run_chunks

from kvarn.paged import TilePlanner


@pytest.mark.parametrize("sink", [False, True])
def test_attention_depends_on_positions_not_on_chunks(sink):
    """The own-tile rule: every position attends the same, bit for bit, however the prompt was cut.

    Chunks that start inside a tile, complete it and start the next (the slot is handed over and
    its new tokens written after attention), whole tiles, and decode; the records are the same too.
    """
    gen = torch.Generator().manual_seed(3)
    length = 300
    k, v = (torch.randn(length, 2, 64, generator=gen).half() for _ in range(2))
    q = torch.randn(length, 4, 64, generator=gen).half()
    want, records = run_chunks([length], k, v, q, sink)
    # tiles completed by a decode step and by a chunk that started inside them (no slot after the
    # step: attention reads the completed tile from the slot the step started in)
    for chunks in ([37, 100, 63, 100], [64, 64, 1, 1, 100, 70], [5] * 60, [130, 1, 1, 1, 167], [30, 34, 63, 1, 172]):
        got, got_records = run_chunks(chunks, k, v, q, sink)
        assert torch.equal(got, want), chunks
        assert torch.equal(got_records, records), chunks


def test_a_step_whose_late_tail_was_not_written_is_refused():
    """store() leaves a handed-over slot's new tokens for write_late_tail(); forgetting it is an error, not garbage."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    kv = PagedKV.allocate(cfg, 8, 2, 2, torch.float16, "cpu", impl="reference")
    planner, table = TilePlanner(2, 64), torch.arange(1, 9)[None]
    k = torch.randn(200, 2, 64).half()
    first = planner.plan(torch.tensor([0, 30]), torch.tensor([30]), table, 30)
    kv.store(first, k[:30], k[:30])
    late = planner.plan(torch.tensor([0, 70]), torch.tensor([100]), table, 70)  # completes tile 0, starts 1
    assert late.late_tail_slot_mapping is not None
    kv.store(late, k[30:100], k[30:100])
    nxt = planner.plan(torch.tensor([0, 1]), torch.tensor([101]), table, 1)
    with pytest.raises(RuntimeError, match="write_late_tail"):
        kv.store(nxt, k[100:101], k[100:101])
    kv.write_late_tail(late, k[30:100], k[30:100])
    kv.store(nxt, k[100:101], k[100:101])
