"""kvarn.paged.prefill: prompt chunks attended through pages and one varlen call, as the paged path does."""

import pytest
import torch
from paged_steps import run_chunks

from kvarn.paged import TilePlanner


@pytest.mark.parametrize("sink", [False, True])
def test_prefill_split_attends_as_the_paged_path_chunk_by_chunk(sink):
    """attend_split (pages + varlen) gives the paged path's outputs for every chunking."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(300, 2, 64, generator=gen) for _ in range(2))
    q = torch.randn(300, 4, 64, generator=gen)
    for chunks in ([300], [37, 100, 63, 100], [130, 1, 1, 1, 167]):
        want, _ = run_chunks(chunks, k, v, q, sink)
        got, _ = run_chunks(chunks, k, v, q, sink, split=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_split_attends_as_the_paged_path(sink, dtype):
    """A prompt chunk attended through pages + varlen (attend_split) as the paged path does, beside a decode row."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, split_prefill

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, hq = cfg.group_size, 2, 4
    planner = TilePlanner(4, g, num_sink_slots=2 if sink else 0)
    kv = PagedKV.allocate(cfg, 8, hkv, 4, dtype, "cpu", num_sink_slots=2 if sink else 0, impl="reference")
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    gen = torch.Generator().manual_seed(0)
    steps = [([150, 70], [150, 70]), ([80, 1], [230, 71])]  # (new tokens, lengths after) per request
    for news, lens in steps:
        qsl = torch.tensor([0, news[0], news[0] + news[1]])
        step_plan = planner.plan(qsl, torch.tensor(lens), table, int(qsl[-1]))
        k, v = (torch.randn(int(qsl[-1]), hkv, 64, generator=gen).to(dtype) for _ in range(2))
        kv.store(step_plan, k, v)
        if news[1] == 70:
            kv.write_late_tail(step_plan, k, v)
    q = torch.randn(81, hq, 64, generator=gen).to(dtype)
    lens = torch.tensor([230, 71])
    want = kv.attend(step_plan, q, table, lens, qsl, key=k, value=v)
    split = split_prefill(qsl.numpy(), lens.numpy(), "cpu")
    assert [r[:3] for r in split.rows] == [(0, 0, 80)] and split.rest_rows.tolist() == [1]
    got = kv.attend_split(step_plan, q, table, lens, split, key=k, value=v)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert split_prefill(qsl.numpy(), lens.numpy(), "cpu", min_queries=81) is None
    with pytest.raises(ValueError, match="key and value"):
        kv.attend_split(step_plan, q, table, lens, split)


def test_prefill_split_packs_chunks_around_a_decode_row():
    """Two prompt chunks with a decode row between them: one varlen call, one sequence per query tile."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, sdpa_varlen, split_prefill

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, hq = cfg.group_size, 2, 4
    planner = TilePlanner(6, g)
    kv = PagedKV.allocate(cfg, 12, hkv, 6, torch.float32, "cpu", impl="reference")
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    gen = torch.Generator().manual_seed(1)
    steps = [([100, 70, 64], [100, 70, 64]), ([90, 1, 130], [190, 71, 194])]
    for news, lens in steps:
        qsl = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
        step_plan = planner.plan(qsl, torch.tensor(lens), table, int(qsl[-1]))
        k, v = (torch.randn(int(qsl[-1]), hkv, 64, generator=gen) for _ in range(2))
        kv.store(step_plan, k, v)
        if news[0] == 100:
            kv.write_late_tail(step_plan, k, v)
    q = torch.randn(int(qsl[-1]), hq, 64, generator=gen)
    lens = torch.tensor(steps[-1][1])
    want = kv.attend(step_plan, q, table, lens, qsl, key=k, value=v)
    split = split_prefill(qsl.numpy(), lens.numpy(), "cpu")
    assert [r[:3] for r in split.rows] == [(0, 0, 90), (2, 91, 221)]
    calls = []

    def spy(q, chunks, scale):
        calls.append((q.shape[0], chunks.k.shape[0], chunks.cu_q, chunks.seqused_k, chunks.block_table.tolist()))
        return sdpa_varlen(q, chunks, scale)

    got = kv.attend_split(step_plan, q, table, lens, split, varlen=spy, key=k, value=v)
    # record pages first (request 0: tiles 0-1, request 2: tiles 0-2), then one exact page per query
    # tile (request 0: queries 100..189 in tiles 1-2, request 2: 64..193 in tiles 1-3)
    table_rows = [[0, 5, 0, 0], [0, 1, 6, 0], [2, 7, 0, 0], [2, 3, 8, 0], [2, 3, 4, 9]]
    assert calls == [(220, 10, [0, 28, 90, 154, 218, 220], [128, 190, 128, 192, 194], table_rows)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    calls.clear()
    import kvarn.paged.prefill

    old, kvarn.paged.prefill.PREFILL_READ_TOKENS = kvarn.paged.prefill.PREFILL_READ_TOKENS, 200  # one request per read
    try:
        got = kv.attend_split(step_plan, q, table, lens, split, varlen=spy, key=k, value=v)
    finally:
        kvarn.paged.prefill.PREFILL_READ_TOKENS = old
    assert [c[:2] for c in calls] == [(90, 4), (130, 6)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
