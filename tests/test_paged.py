"""The tile planner of the vLLM backend: where each token of a step goes, and how tail slots live.

The planner imports torch only; these tests run without vLLM.
"""

import numpy as np
import pytest
import torch

from kvarn.paged import SinkLostError, TailLostError, TilePlanner

G = 8


def plan(planner, chunks, tables, pad=0):
    """``chunks``: list of (new tokens, length after the step); ``tables``: block ids per request."""
    qsl = [0]
    for n, _ in chunks:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor([length for _, length in chunks])
    return planner.plan(torch.tensor(qsl), lens, table, qsl[-1] + pad)


def test_whole_tiles_are_stored_and_the_rest_goes_to_the_tail():
    p = TilePlanner(4, G)
    out = plan(p, [(20, 20)], [[7, 3, 9]], pad=2)
    assert out.store_blocks.tolist() == [7, 3]
    assert out.store_token_idx.tolist() == [list(range(8)), list(range(8, 16))]
    slot = p.live_slots[9]
    assert out.tail_slot_mapping.tolist() == [-1] * 16 + [slot * G + i for i in range(4)] + [-1, -1]
    assert out.tail_slots.tolist() == [slot]
    assert out.head_slots.tolist() == [0], "the step starts a tile it stores whole: no slot to read"
    assert out.commit_blocks.numel() == 0


def test_a_tile_completed_by_decode_is_committed_from_its_slot_and_the_slot_released():
    p = TilePlanner(4, G)
    plan(p, [(7, 7)], [[5]])
    slot = p.live_slots[5]
    out = plan(p, [(1, 8)], [[5]])
    assert out.commit_slots.tolist() == [slot] and out.commit_blocks.tolist() == [5]
    assert out.tail_slot_mapping.tolist() == [slot * G + 7]
    assert out.tail_slots.tolist() == [0]
    assert out.head_slots.tolist() == [slot], "attention reads the completed tile from its slot"
    assert p.live_slots == {}


def test_a_chunk_that_starts_and_ends_inside_tiles():
    p = TilePlanner(4, G)
    plan(p, [(3, 3)], [[4, 6, 2]])
    s4 = p.live_slots[4]
    out = plan(p, [(15, 18)], [[4, 6, 2]])
    s2 = p.live_slots[2]
    assert out.commit_blocks.tolist() == [4] and out.commit_slots.tolist() == [s4]
    assert out.store_blocks.tolist() == [6]
    assert out.store_token_idx.tolist() == [list(range(5, 13))]
    mapping = out.tail_slot_mapping.tolist()
    assert mapping[:5] == [s4 * G + i for i in range(3, 8)] and mapping[13:] == [-1, -1]
    assert s2 == s4 and 4 not in p.live_slots, "the committed tile's slot passes to the request's next tile"
    late = out.late_tail_slot_mapping.tolist()
    assert late[:13] == [-1] * 13 and late[13:] == [s4 * G + i for i in range(2)], "written after attention"
    assert out.head_slots.tolist() == [s4], "the tile the step started in, read by attention"


def test_an_unscheduled_request_keeps_its_tail_and_prefix_hits_start_on_tile_boundaries():
    p = TilePlanner(4, G)
    plan(p, [(5, 5), (3, 3)], [[1], [2]])
    s1 = p.live_slots[1]
    for length in range(4, 8):
        plan(p, [(1, length)], [[2]])
    out = plan(p, [(2, 7)], [[1]])
    assert out.tail_slot_mapping.tolist() == [s1 * G + 5, s1 * G + 6]
    hit = plan(p, [(3, 19)], [[1, 8, 11]])
    assert hit.tail_slot_mapping.tolist() == [p.live_slots[11] * G + i for i in range(3)]


def test_a_recycled_block_frees_the_stale_tail_of_its_previous_owner():
    p = TilePlanner(4, G)
    plan(p, [(5, 5)], [[3]])
    assert 3 in p.live_slots
    plan(p, [(16, 16)], [[9, 3]])
    assert 3 not in p.live_slots


def test_the_pool_evicts_the_least_recently_used_idle_slot_and_refuses_a_lost_tail():
    p = TilePlanner(2, G)
    plan(p, [(1, 1)], [[1]])
    plan(p, [(1, 1)], [[2]])
    plan(p, [(1, 2)], [[2]])
    plan(p, [(1, 1)], [[3]])
    assert set(p.live_slots) == {2, 3}
    with pytest.raises(TailLostError, match="block 1"):
        plan(p, [(1, 2)], [[1]])
    with pytest.raises(TailLostError, match="incomplete tiles in one step"):
        plan(TilePlanner(1, G), [(1, 1), (1, 1)], [[1], [2]])


def test_request_slots_plan_without_block_ids_on_the_host():
    """Slots named by the caller; a chunk that completes its tile and starts another writes it after the commit."""
    from kvarn.paged import plan_request_slots

    table = torch.tensor([[7, 3, 9, 4], [5, 6, 0, 0]])
    # request 0: 5 -> 30 (completes tile 0, stores 1 and 2, starts 3); request 1: 7 -> 8 (decode completes tile 0)
    out = plan_request_slots(torch.tensor([0, 25, 26]), torch.tensor([30, 8]), table, 28, [2, 1], G)
    assert out.commit_slots.tolist() == [2, 1] and out.commit_blocks.tolist() == [7, 5]
    assert out.store_blocks.tolist() == [3, 9]
    assert out.store_token_idx[:, 0].tolist() == [3, 11]
    assert out.tail_slot_mapping.tolist() == [2 * G + 5, 2 * G + 6, 2 * G + 7] + [-1] * 22 + [1 * G + 7, -1, -1]
    assert out.late_tail_slot_mapping.tolist() == [-1] * 19 + [2 * G + i for i in range(6)] + [-1] * 3
    assert out.tail_slots.tolist() == [2, 1]
    quiet = plan_request_slots(torch.tensor([0, 1]), torch.tensor([3]), table[:1], 1, [0], G)
    assert quiet.late_tail_slot_mapping is None and quiet.commit_slots.numel() == 0
    with pytest.raises(ValueError, match="new tokens"):
        plan_request_slots(torch.tensor([0, 4]), torch.tensor([3]), table[:1], 4, [0], G)


def test_plan_and_page_index_tensors_start_on_16_byte_boundaries():
    """Triton compiles a variant per pointer alignment: the index tensors of a step, staged in one copy, must
    not start at offsets that follow the step's sizes (odd token, commit and row counts here)."""
    from kvarn.paged import PageLayout, plan_request_slots, to_device_aligned

    table = torch.tensor([[7, 3, 9, 4], [5, 6, 0, 0], [1, 2, 8, 0]])
    plan = plan_request_slots(torch.tensor([0, 25, 26, 29]), torch.tensor([30, 8, 19]), table, 29, [2, 1, 0], G)
    tensors = {k: v for k, v in vars(plan).items() if isinstance(v, torch.Tensor)}
    layout = PageLayout.of([(0, 0, 25, 30), (2, 26, 29, 19)], G)
    tensors |= {f"page {k}": v for k, v in layout.on("cpu").items()}
    assert len(tensors) > 15
    assert all(t.data_ptr() % 16 == 0 for t in tensors.values()), {k: t.data_ptr() % 16 for k, t in tensors.items()}
    parts = to_device_aligned([np.arange(3), np.arange(0), np.arange(5).reshape(5, 1)], "cpu")
    assert [p.tolist() for p in parts] == [[0, 1, 2], [], [0, 1, 2, 3, 4]]


def test_a_prefix_hit_reads_the_sink_of_the_first_tile_it_shares():
    p = TilePlanner(4, G, num_sink_slots=2, sink_pinned=lambda block: False)
    a = plan(p, [(20, 20)], [[5, 6, 7]])
    sink = p.live_sinks[5]
    assert a.sink_slots.tolist() == [sink]
    assert a.sink_slot_mapping.tolist() == [sink * G + i for i in range(G)] + [-1] * 12
    assert sorted(a.store_blocks.tolist()) == [5, 6], "the first tile's record is written all the same"
    hit = plan(p, [(3, 19)], [[5, 6, 9]])  # tiles 0 and 1 from the prefix cache
    assert hit.sink_slots.tolist() == [sink]
    assert hit.sink_slot_mapping.tolist() == [-1] * 3, "a hit reads the sink and never writes it"
    assert p.stats["new_sinks"] == 1


@pytest.mark.parametrize("hit_first", [False, True])
def test_a_hit_on_a_first_tile_written_in_the_same_step_reads_its_sink_in_either_row_order(hit_first):
    """vLLM caches a block as it schedules it, so ``n > 1`` children (or equal prompts) admitted in one
    step can hit the first tile another row of that step writes, and the runner may put that row first."""
    p = TilePlanner(4, G, num_sink_slots=2, sink_pinned=lambda block: True)
    writer, hit = ((2 * G + 3, 2 * G + 3), [5, 6, 7]), ((3, 2 * G + 3), [5, 6, 9])
    rows = [hit, writer] if hit_first else [writer, hit]
    out = plan(p, [c for c, _ in rows], [t for _, t in rows])
    sink = p.live_sinks[5]
    assert out.sink_slots.tolist() == [sink, sink]
    written = out.sink_slot_mapping.tolist()
    assert sorted(x for x in written if x >= 0) == [sink * G + i for i in range(G)], "the writer fills the sink once"
    assert p.stats["new_sinks"] == 1


def test_a_first_block_written_as_another_tile_loses_its_sink_and_cannot_be_read_as_a_first_tile():
    p = TilePlanner(4, G, num_sink_slots=2, sink_pinned=lambda block: False)
    plan(p, [(G, G)], [[5]])
    plan(p, [(G + 2, G + 2)], [[3, 5]])  # block 5 recycled as tile 1
    assert 5 not in p.live_sinks and p.stats["recycled_sinks"] == 1
    with pytest.raises(SinkLostError, match="block 5"):
        plan(p, [(1, G + 1)], [[5, 4]])
    fresh = plan(p, [(3, 3)], [[5]])  # a new first tile in block 5 starts from offset 0: a new sink
    assert fresh.sink_slots.tolist() == [p.live_sinks[5]]


def test_sink_eviction_takes_only_unheld_blocks_and_reports_them():
    held = {1, 2}
    evicted = []
    p = TilePlanner(4, G, num_sink_slots=2, sink_pinned=held.__contains__, on_sink_evicted=evicted.append)
    plan(p, [(G, G), (3, 3)], [[1], [2]])
    with pytest.raises(SinkLostError, match="KVARN_SINK_SLOTS"):
        plan(p, [(2, 2)], [[3]])  # both sinks belong to blocks that requests hold
    held.discard(1)
    plan(p, [(2, 2)], [[3]])
    assert evicted == [1] and set(p.live_sinks) == {2, 3} and p.stats["evicted_sinks"] == 1
    with pytest.raises(SinkLostError, match="block 1"):
        plan(p, [(1, G + 1)], [[1, 8]])  # a hit on the evicted first tile is refused, not read


def test_a_first_tile_continued_without_its_sink_is_refused():
    p = TilePlanner(4, G, num_sink_slots=1)
    plan(p, [(3, 3)], [[1]])
    with pytest.raises(SinkLostError):
        plan(p, [(2, 2)], [[2]])  # no predicate: nothing is evictable
    p = TilePlanner(4, G, num_sink_slots=1, sink_pinned=lambda block: False)
    with pytest.raises(SinkLostError, match="slots"):
        plan(p, [(3, 3), (2, 2)], [[1], [2]])  # a sink this step writes is never evicted in that step
    with pytest.raises(SinkLostError, match="block 7"):
        plan(p, [(2, 5)], [[7]])


def test_dense_batch_rows_start_their_tiles_at_their_first_real_token():
    from kvarn.integration.hf import DenseBatch

    rows = DenseBatch(sink=True)
    step = rows.begin(0, 20, 2, G, "cpu", lambda before: [20, 13])  # row 1: 7 positions of left padding
    assert step.after == [20, 13] and step.seq_lens.tolist() == [20, 13]
    assert step.token_idx.tolist() == list(range(20)) + list(range(27, 40))
    assert step.block_table.tolist() == [[0, 2, 4], [1, 3, 5]]  # tile i of row b is block i * B + b
    assert sorted(step.plan.store_blocks.tolist()) == [0, 1, 2]  # row 0: tiles 0, 1; row 1: tile 0
    assert step.plan.sink_slots.tolist() == [0, 1]  # sink slots first in the pool
    assert rows.begin(0, 20, 2, G, "cpu", lambda before: 1 / 0) is step  # the other layers reuse the plan
    nxt = rows.begin(20, 1, 2, G, "cpu", lambda before: [1, 1])
    assert nxt.before == [20, 13] and nxt.after == [21, 14]


def test_dense_batch_replays_older_steps_with_the_same_decisions():
    from kvarn.integration.hf import DenseBatch

    rows = DenseBatch()
    lead = [rows.begin(t, 1, 3, G, "cpu", lambda before: [1, 1, 1]) for t in range(2 * G + 3)]
    again = [rows.begin(t, 1, 3, G, "cpu", lambda before: 1 / 0) for t in range(2 * G + 3)]
    for a, b in zip(lead, again, strict=True):
        assert a.plan.tail_slot_mapping.tolist() == b.plan.tail_slot_mapping.tolist()
        assert a.plan.commit_slots.tolist() == b.plan.commit_slots.tolist()
        assert a.plan.commit_blocks.tolist() == b.plan.commit_blocks.tolist()
    with pytest.raises(ValueError, match="rewound"):
        rows.begin(5, 2, 3, G, "cpu", lambda before: [2, 2, 2])
    with pytest.raises(ValueError, match="real tokens"):
        rows.begin(2 * G + 3, 1, 3, G, "cpu", lambda before: [2, 1, 1])


def test_dense_batch_reorder_moves_tails_and_sinks():
    from kvarn.integration.hf import DenseBatch

    rows = DenseBatch(sink=True)
    rows.begin(0, G + 3, 2, G, "cpu", lambda before: [G + 3, G + 3])
    slots, sinks = rows.lead.planner.live_slots, rows.lead.planner.live_sinks
    moves = rows.reorder([1, 1])
    assert moves == [(slots[2], slots[3]), (sinks[0], sinks[1]), (slots[3], slots[3]), (sinks[1], sinks[1])]


def _run_chunks(chunks, k, v, q, sink=False, split=False, impl="reference"):
    """One sequence fed in ``chunks`` (token counts) through TilePlanner + PagedKV: each position's attention output."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, split_prefill

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv = cfg.group_size, k.shape[1]
    planner = TilePlanner(2, g, num_sink_slots=1 if sink else 0)
    kv = PagedKV.allocate(cfg, 8, hkv, 2, k.dtype, "cpu", num_sink_slots=1 if sink else 0, impl=impl)
    table = torch.arange(1, 9)[None]  # block 0 unused
    outs, done = [], 0
    for n in chunks:
        qsl, lens = torch.tensor([0, n]), torch.tensor([done + n])
        step = planner.plan(qsl, lens, table, n)
        kn, vn = k[done : done + n], v[done : done + n]
        kv.store(step, kn, vn)
        parts = split_prefill(qsl.numpy(), lens.numpy(), "cpu", min_queries=2) if split else None
        if parts is not None:
            outs.append(kv.attend_split(step, q[done : done + n], table, lens, parts, key=kn, value=vn))
        else:
            outs.append(kv.attend(step, q[done : done + n], table, lens, qsl, key=kn, value=vn))
        kv.write_late_tail(step, kn, vn)
        done += n
    return torch.cat(outs), kv.cache


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
    want, records = _run_chunks([length], k, v, q, sink)
    # tiles completed by a decode step and by a chunk that started inside them (no slot after the
    # step: attention reads the completed tile from the slot the step started in)
    for chunks in ([37, 100, 63, 100], [64, 64, 1, 1, 100, 70], [5] * 60, [130, 1, 1, 1, 167], [30, 34, 63, 1, 172]):
        got, got_records = _run_chunks(chunks, k, v, q, sink)
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


@pytest.mark.parametrize("sink", [False, True])
def test_prefill_split_attends_as_the_paged_path_chunk_by_chunk(sink):
    """attend_split (pages + varlen) gives the paged path's outputs for every chunking."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(300, 2, 64, generator=gen) for _ in range(2))
    q = torch.randn(300, 4, 64, generator=gen)
    for chunks in ([300], [37, 100, 63, 100], [130, 1, 1, 1, 167]):
        want, _ = _run_chunks(chunks, k, v, q, sink)
        got, _ = _run_chunks(chunks, k, v, q, sink, split=True)
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


def test_sink_slots_serve_a_prefix_hit_scheduled_before_its_claim():
    """vLLM's GPU runner orders rows decode -> short -> long, so a prefix hit on a first tile (start >= G)
    can come before the row that writes that tile from 0 in the same step: both get one slot."""
    from kvarn.paged import SinkLostError, SinkSlots

    sinks = SinkSlots(2, G)
    slots = sinks.assign([(0, 7, G), (1, 7, 0), (2, 9, 0)], 4)
    assert slots[0] == slots[1] >= 0 and slots[2] not in (-1, slots[0]) and slots[3] == -1
    assert sinks.live == {7: slots[0], 9: slots[2]}
    assert sinks.drop(9) and not sinks.drop(9) and sinks.stats["recycled_sinks"] == 1
    with pytest.raises(SinkLostError, match="not held"):
        sinks.assign([(0, 9, 5)], 1)
    sinks.assign([(0, 11, 0)], 1)
    with pytest.raises(SinkLostError, match="live requests"):  # no pinned(): nothing may be evicted
        sinks.assign([(0, 12, 0)], 1)
    evicted = []
    held = SinkSlots(1, G, pinned=lambda block: block == 3, on_evicted=evicted.append)
    held.assign([(0, 4, 0)], 1)
    assert held.assign([(0, 5, 0)], 1) == [0] and evicted == [4] and held.live == {5: 0}


@pytest.mark.parametrize("sink,decode_in_blocks", [(False, False), (True, False), (False, True)])
def test_tails_in_blocks_attend_and_store_as_the_pool_bit_for_bit(sink, decode_in_blocks):
    """Tails kept in the blocks after each partial tile (``docs/tail_blocks.md``, step 1): gathered into a step
    pool before the step, scattered back after it, a random schedule of three requests (prompt chunks inside
    tiles, chunks that complete a tile and start the next, decode, whole tiles) attends as with a pool slot per
    request, bit for bit, and writes the same records (so no tail row lands in a record). With
    ``decode_in_blocks`` the decode steps go through the blocks directly instead (``block_tails``: the token
    into its block row, a filled tile committed through its step-pool slot, attention reading the blocks)."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, block_tails, plan_request_slots, tail_geometry, tail_rows

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, hq = cfg.group_size, 2, 4
    rows, n_tail = tail_geometry(cfg)
    gen = torch.Generator().manual_seed(11)
    lengths = [300, 129, 70]
    k, v, q = ([torch.randn(n, hkv if i < 2 else hq, 64, generator=gen).half() for n in lengths] for i in range(3))
    width = max(-(-n // g) + n_tail for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    table[:] = torch.arange(1, 1 + table.numel()).view(table.shape)  # every request its own blocks; 0 unused
    sinks = len(lengths) if sink else 0
    pooled = PagedKV.allocate(cfg, table.numel() + 1, hkv, len(lengths), torch.float16, "cpu", num_sink_slots=sinks,
                              impl="reference")  # fmt: skip
    paged = PagedKV.allocate(cfg, table.numel() + 1, hkv, len(lengths), torch.float16, "cpu", num_sink_slots=sinks,
                             impl="reference")  # fmt: skip
    done = [0] * len(lengths)
    seen = {"late": 0, "commit": 0, "whole": 0}
    if decode_in_blocks:
        seen.update(block_steps=0, block_commits=0)
    rng = np.random.default_rng(6 if decode_in_blocks else 5)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        live = [r for r in range(len(lengths)) if done[r] < lengths[r]]
        batch = list(rng.permutation(live)[: rng.integers(1, len(live) + 1)])
        sizes = [min(lengths[r] - done[r], int(rng.choice([1, 1, 7, 64, 90]))) for r in batch]
        if decode_in_blocks and rng.random() < 0.8:
            sizes = [1] * len(batch)
        qsl = torch.tensor([0, *np.cumsum(sizes)])
        lens = torch.tensor([done[r] + n for r, n in zip(batch, sizes, strict=True)])
        step_k = torch.cat([k[r][done[r] : done[r] + n] for r, n in zip(batch, sizes, strict=True)])
        step_v = torch.cat([v[r][done[r] : done[r] + n] for r, n in zip(batch, sizes, strict=True)])
        step_q = torch.cat([q[r][done[r] : done[r] + n] for r, n in zip(batch, sizes, strict=True)])
        bt, total = table[batch], int(qsl[-1])
        sink_slots = list(batch) if sink else None
        outs = []
        for kv, slots in ((pooled, [sinks + r for r in batch]), (paged, [sinks + i for i in range(len(batch))])):
            plan = plan_request_slots(qsl, lens, bt, total, slots, g, sink_slots)
            seen["late"] += plan.late_tail_slot_mapping is not None
            seen["commit"] += plan.commit_blocks.numel()
            seen["whole"] += plan.store_blocks.numel()
            if kv is paged and decode_in_blocks and max(sizes) == 1 and plan.late_tail_slot_mapping is None:
                tails = block_tails(bt, lens, g, rows, n_tail)  # as the vLLM builder's decode steps
                kv.write_block_tails(tails, step_k, step_v)
                kv.commit_block_tails(plan, tails)
                outs.append(kv.attend(plan, step_q, bt, lens, None, tails=tails))
                seen["block_steps"] += 1
                seen["block_commits"] += plan.commit_blocks.numel()
                kv.tail_k[sinks:], kv.tail_v[sinks:] = float("nan"), float("nan")
                continue
            if kv is paged:
                kv.gather_tails(tail_rows(bt, lens - torch.tensor(sizes), torch.tensor(slots), g, rows))
            kv.store(plan, step_k, step_v)
            outs.append(kv.attend(plan, step_q, bt, lens, qsl, key=step_k, value=step_v))
            kv.write_late_tail(plan, step_k, step_v)
            if kv is paged:
                since = lens - torch.tensor(sizes)  # the step's new tokens only, as the vLLM builder scatters
                kv.scatter_tails(tail_rows(bt, lens, torch.tensor(slots), g, rows, since=since))
                kv.tail_k[sinks:], kv.tail_v[sinks:] = float("nan"), float("nan")  # the blocks carry the tails
        assert torch.equal(outs[0], outs[1]), (batch, sizes, done)
        for r, n in zip(batch, sizes, strict=True):
            done[r] += n
    for r, n in enumerate(lengths):
        full = table[r, : n // g]
        assert torch.equal(paged.cache[full], pooled.cache[full]), r
    assert min(seen.values()) > 0, seen  # the schedule took every path: late tails, commits, whole tiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_scatter_tails_writes_only_the_tail_rows_of_the_blocks_after_each_partial_tile(dtype):
    """``scatter_tails`` then ``gather_tails`` gives each partial tile back, and the scatter changes no byte but
    rows ``0 .. n - 1`` of the blocks after each sequence's partial tile (no record, no other sequence's block,
    no byte of a block past its tail rows); a sequence without a partial tile touches nothing; a block table
    too narrow for a tail is refused before anything is written."""
    from kvarn.config import KVarNConfig
    from kvarn.paged import PagedKV, tail_geometry, tail_rows

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv = cfg.group_size, 2
    rows, n_tail = tail_geometry(cfg, dtype.itemsize)
    lens = torch.tensor([g - 1, 3 * g, 2 * g + 17, 1])
    width = 3 + n_tail
    table = torch.randperm(len(lens) * width)[: len(lens) * width].view(len(lens), width) + 1
    kv = PagedKV.allocate(cfg, table.numel() + 1, hkv, len(lens), dtype, "cpu", impl="reference")
    kv.cache.random_(0, 256)
    before = kv.cache.clone()
    kv.tail_k.normal_()
    kv.tail_v.normal_()
    want_k, want_v = kv.tail_k.clone(), kv.tail_v.clone()
    slots = torch.tensor([2, 0, 3, 1])
    kv.scatter_tails(tail_rows(table, lens, slots, g, rows))
    changed = (kv.cache != before).any(dim=1)  # [blocks, record bytes]
    allowed = torch.zeros_like(changed)
    for b, n in enumerate(lens.tolist()):
        c, m = divmod(n, g)
        for j in range(m):
            blk = int(table[b, c + 1 + j // rows])
            r = j % rows
            allowed[blk, r * 2 * 64 * dtype.itemsize : (r + 1) * 2 * 64 * dtype.itemsize] = True
    assert changed.any() and not (changed & ~allowed).any()
    kv.tail_k.zero_()
    kv.tail_v.zero_()
    kv.gather_tails(tail_rows(table, lens, slots, g, rows))
    for b, n in enumerate(lens.tolist()):
        m = n % g
        assert torch.equal(kv.tail_k[slots[b], :m], want_k[slots[b], :m]), b
        assert torch.equal(kv.tail_v[slots[b], :m], want_v[slots[b], :m]), b
    with pytest.raises(ValueError, match="tail in blocks up to column"):
        tail_rows(table[:, :4], lens, slots, g, rows)


def test_tail_rows_since_keeps_only_the_new_tokens():
    """``tail_rows(..., since=)``: the entries of positions ``>= since`` only, each where the full list has it."""
    from kvarn.paged import tail_rows

    g, rows = 64, 13
    lens = torch.tensor([70, 64 + 30, 5, 128, 70])
    # one new token; none (since past the end); all; none (no tail); a chunk from 60 that crossed into tile 1: all 6
    since = torch.tensor([69, 64 + 31, 0, 100, 60])
    table = torch.arange(5 * 8).view(5, 8) + 100
    slots = torch.tensor([4, 3, 2, 1, 0])
    full = tail_rows(table, lens, slots, g, rows)
    new = tail_rows(table, lens, slots, g, rows, since=since)
    got = set(zip(new.slot.tolist(), new.offset.tolist(), new.block.tolist(), new.row.tolist(), strict=True))
    want = {
        e
        for e, b in zip(
            zip(full.slot.tolist(), full.offset.tolist(), full.block.tolist(), full.row.tolist(), strict=True),
            [4 - s for s in full.slot.tolist()],
            strict=True,
        )
        if lens[b] // g * g + e[1] >= since[b]
    }
    assert got == want and len(got) == 1 + 0 + 5 + 0 + 6
