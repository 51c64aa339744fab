"""kvarn.paged.plan: where each token of a step goes (TilePlanner), and how tail and sink slots live.

The planner imports torch only; these tests run without vLLM.
"""

import pytest
import torch

from kvarn.paged import SinkLostError, TailLostError, TilePlanner

G = 8


def plan(planner, chunks, tables, pad=0, drafts=None):
    """``chunks``: list of (new tokens, length after the step); ``tables``: block ids per request; ``drafts``:
    how many of each request's new tokens are speculative drafts."""
    qsl = [0]
    for n, _ in chunks:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor([length for _, length in chunks])
    return planner.plan(torch.tensor(qsl), lens, table, qsl[-1] + pad, num_drafts=drafts)


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


def test_a_tile_filled_with_a_draft_is_committed_and_keeps_its_slot_for_a_rewind():
    """A verification step of 1 + 3 tokens from position 6 (6 verified, 7-9 drafts): tile 0 is quantized for the
    step's draft queries past it, keeps its slot, and tile 1 takes a slot of its own (not tile 0's after
    attention). Draft 7 rejected: the next step starts at 7 inside tile 0, overwrites its row and quantizes it
    again. Once a step starts past it, the slot is freed before that step claims any."""
    p = TilePlanner(4, G)
    plan(p, [(6, 6)], [[5, 9, 2]])
    s5 = p.live_slots[5]
    out = plan(p, [(4, 10)], [[5, 9, 2]], drafts=[3])
    s9 = p.live_slots[9]
    assert out.commit_blocks.tolist() == [5] and out.commit_slots.tolist() == [s5]
    assert 5 in p.live_slots and s9 != s5 and out.late_tail_slot_mapping is None
    assert out.tail_slot_mapping.tolist() == [s5 * G + 6, s5 * G + 7, s9 * G, s9 * G + 1]
    assert out.head_slots.tolist() == [s5] and out.tail_slots.tolist() == [s9]
    out = plan(p, [(4, 11)], [[5, 9, 2]], drafts=[3])  # the rewind: 7 verified now, 8-10 drafts
    assert out.tail_slot_mapping.tolist() == [s5 * G + 7, s9 * G, s9 * G + 1, s9 * G + 2]
    assert out.commit_blocks.tolist() == [5] and out.head_slots.tolist() == [s5]
    assert 5 not in p.live_slots, "filled with a verified token: released after the commit"
    plan(p, [(4, 14)], [[5, 9, 2]], drafts=[3])  # 10 verified, 11-13 drafts: nothing filled
    out = plan(p, [(2, 14)], [[5, 9, 2]], drafts=[1])  # 12 and 13 rejected: 12 verified now, 13 a draft
    assert out.tail_slot_mapping.tolist() == [s9 * G + 4, s9 * G + 5]
    out = plan(p, [(4, 18)], [[5, 9, 2]], drafts=[3])  # 14 verified, 15-17 drafts fill tile 1 and start tile 2
    assert out.commit_blocks.tolist() == [9] and {9, 2} <= set(p.live_slots)
    assert p.stats["verified_tails"] == 0
    plan(p, [(1, 1)], [[1]])  # another request: the kept slot stays while its request skips steps
    assert 9 in p.live_slots
    plan(p, [(2, 20)], [[5, 9, 2]], drafts=[1])  # all accepted: starts at 18, past tile 1
    assert 9 not in p.live_slots and p.stats["verified_tails"] == 1
    assert p.release_blocks([5, 9, 2]) == 1 and p.live_slots == {1: p.live_slots[1]}


def test_a_whole_tile_with_a_draft_goes_through_the_tail():
    p = TilePlanner(4, G)
    out = plan(p, [(G, G)], [[5, 6]], drafts=[2])
    slot = p.live_slots[5]
    assert out.store_blocks.numel() == 0, "never quantized straight from the step's K/V with a draft in it"
    assert out.tail_slot_mapping.tolist() == [slot * G + i for i in range(G)]
    assert out.commit_blocks.tolist() == [5] and 5 in p.live_slots
    out = plan(p, [(G, 2 * G)], [[5, 6]], drafts=[0])  # without drafts a whole tile is stored
    assert out.store_blocks.tolist() == [6] and 5 not in p.live_slots


def test_drafts_that_fill_a_tile_after_a_verified_one_take_their_own_slot():
    """A tile completed by a verified token hands its slot to the next tile after attention, unless that tile
    is filled in the same step (it is then committed before attention, from a slot of its own)."""
    p = TilePlanner(4, G)
    plan(p, [(7, 7)], [[5, 6, 7]])
    s5 = p.live_slots[5]
    out = plan(p, [(G + 2, 2 * G + 1)], [[5, 6, 7]], drafts=[G + 1])
    s6, s7 = p.live_slots[6], p.live_slots[7]
    assert out.late_tail_slot_mapping is None and len({s5, s6, s7}) == 3
    assert out.commit_blocks.tolist() == [5, 6] and out.commit_slots.tolist() == [s5, s6]
    assert out.tail_slot_mapping.tolist() == [s5 * G + 7] + [s6 * G + i for i in range(G)] + [s7 * G]
    with pytest.raises(ValueError, match="said to be drafts"):
        plan(p, [(2, 2 * G + 3)], [[5, 6, 7]], drafts=[3])
    with pytest.raises(ValueError, match="one count per request"):
        plan(p, [(1, 2 * G + 2)], [[5, 6, 7]], drafts=[0, 0])


def test_a_step_of_drafts_only_keeps_the_tails_its_request_may_rewind_into():
    """A draft model's steps write drafts only (every token of the step, the first included): a tile they fill is
    kept, and a later step of drafts only that starts past it frees it neither as verified nor as a recycled block
    of its own row. A step whose first token is verified does (the next engine step's first pass)."""
    p = TilePlanner(4, G)
    plan(p, [(G - 2, G - 2)], [[5, 6]])
    plan(p, [(2, G)], [[5, 6]], drafts=[2])  # drafts fill tile 0: committed, its slot kept
    assert p.live_slots.keys() == {5}
    out = plan(p, [(1, G + 1)], [[5, 6]], drafts=[1])  # a draft past it, in tile 1
    assert out.head_slots.tolist() == [p.live_slots[6]] and p.live_slots.keys() == {5, 6}, "tile 0 still kept"
    plan(p, [(1, G + 2)], [[5, 6]], drafts=[1])
    assert p.live_slots.keys() == {5, 6}
    out = plan(p, [(3, G + 1)], [[5, 6]], drafts=[2])  # the next engine step rewinds into tile 0
    assert p.stats["reopened_tails"] == 1 and out.commit_blocks.tolist() == [5] and p.live_slots.keys() == {5, 6}
    plan(p, [(2, G + 2)], [[5, 6]], drafts=[1])  # starts past tile 0 with a verified token: it was verified
    assert p.live_slots.keys() == {6} and p.stats["verified_tails"] == 1


def test_a_window_planner_ignores_the_stale_and_null_ids_before_a_row_s_window():
    """vLLM frees the blocks a request's window left and hands them to others while the request's row keeps their
    ids (or the null block 0): a stale id is no recycled block of the row, so the new owner's tail stays."""
    p = TilePlanner(4, G, window=10)
    plan(p, [(20, 20)], [[5, 6, 7]])  # request A: tiles 0, 1 full, its tail in block 7
    assert p.live_slots.keys() == {7}
    plan(p, [(3, 3)], [[5]])  # vLLM freed A's block 5 (its window starts at 10 from position 19) and gave it to B
    # A decodes on: its row still says 5 and 6 in front; B waits with its tail in block 5
    plan(p, [(1, 21)], [[5, 6, 7]])
    assert p.live_slots.keys() == {5, 7}, "B's tail is not A's recycled block"
    plan(p, [(2, 5)], [[5]])  # B continues its tile
    plan(p, [(1, 22)], [[0, 0, 7]])  # a resumed row shows the null block before the window
    assert p.live_slots.keys() == {5, 7}
    assert p.first_live(21) == 1 and TilePlanner(4, G).first_live(21) == 0
    with pytest.raises(ValueError, match="without sink slots"):
        TilePlanner(4, G, num_sink_slots=2, window=10)
