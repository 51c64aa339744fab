"""kvarn.paged.slots: plans over slots the caller names per request, and tails kept in the cache's blocks."""

import numpy as np
import pytest
import torch

G = 8


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


@pytest.mark.parametrize("sink,decode_in_blocks", [(False, False), (True, False), (False, True)])
def test_tails_in_blocks_attend_and_store_as_the_pool_bit_for_bit(sink, decode_in_blocks):
    """Tails kept in the blocks after each partial tile (``docs/internals/vllm_backend.md``): gathered into a step
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
