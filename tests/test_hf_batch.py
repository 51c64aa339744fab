"""The rows of a transformers batch (kvarn.integration.hf.batch): their tile lifecycle, padding and beams."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_models import prompt_ids, tiny_llama

transformers = pytest.importorskip("transformers")
from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.integration.hf import DenseBatch, KVarNCache, register_kvarn_attention  # noqa: E402

pytestmark = pytest.mark.hf

PRESET = "kvarn_k4v2_g64"
G = 64
SMALL_G = 8
"""The tile of the DenseBatch unit tests: a few tokens make several tiles."""


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random Llama (GQA 4:2, head_dim 64) in fp32; no download."""
    return tiny_llama()


def test_dense_batch_rows_start_their_tiles_at_their_first_real_token():
    rows = DenseBatch(sink=True)
    step = rows.begin(0, 20, 2, SMALL_G, "cpu", lambda before: [20, 13])  # row 1: 7 positions of left padding
    assert step.after == [20, 13] and step.seq_lens.tolist() == [20, 13]
    assert step.token_idx.tolist() == list(range(20)) + list(range(27, 40))
    assert step.block_table.tolist() == [[0, 2, 4], [1, 3, 5]]  # tile i of row b is block i * B + b
    assert sorted(step.plan.store_blocks.tolist()) == [0, 1, 2]  # row 0: tiles 0, 1; row 1: tile 0
    assert step.plan.sink_slots.tolist() == [0, 1]  # sink slots first in the pool
    assert rows.begin(0, 20, 2, SMALL_G, "cpu", lambda before: 1 / 0) is step  # the other layers reuse the plan
    nxt = rows.begin(20, 1, 2, SMALL_G, "cpu", lambda before: [1, 1])
    assert nxt.before == [20, 13] and nxt.after == [21, 14]


def test_dense_batch_replays_older_steps_with_the_same_decisions():
    rows = DenseBatch()
    lead = [rows.begin(t, 1, 3, SMALL_G, "cpu", lambda before: [1, 1, 1]) for t in range(2 * SMALL_G + 3)]
    again = [rows.begin(t, 1, 3, SMALL_G, "cpu", lambda before: 1 / 0) for t in range(2 * SMALL_G + 3)]
    for a, b in zip(lead, again, strict=True):
        assert a.plan.tail_slot_mapping.tolist() == b.plan.tail_slot_mapping.tolist()
        assert a.plan.commit_slots.tolist() == b.plan.commit_slots.tolist()
        assert a.plan.commit_blocks.tolist() == b.plan.commit_blocks.tolist()
    with pytest.raises(ValueError, match="rewound"):
        rows.begin(5, 2, 3, SMALL_G, "cpu", lambda before: [2, 2, 2])
    with pytest.raises(ValueError, match="real tokens"):
        rows.begin(2 * SMALL_G + 3, 1, 3, SMALL_G, "cpu", lambda before: [2, 1, 1])


def test_dense_batch_reorder_moves_tails_and_sinks():
    rows = DenseBatch(sink=True)
    rows.begin(0, SMALL_G + 3, 2, SMALL_G, "cpu", lambda before: [SMALL_G + 3, SMALL_G + 3])
    slots, sinks = rows.lead.planner.live_slots, rows.lead.planner.live_sinks
    moves = rows.reorder([1, 1])
    assert moves == [(slots[2], slots[3]), (sinks[0], sinks[1]), (slots[3], slots[3]), (sinks[1], sinks[1])]


def _padded(k, v, pad):
    """Row 1 of a 2-row batch gets ``pad`` garbage positions on the left; position ids as generate makes them."""
    n = k.shape[2]
    kp, vp = k.clone(), v.clone()
    kp[1, :, :pad], vp[1, :, :pad] = 1e4, -1e4
    pos = torch.arange(n).repeat(2, 1)
    pos[1] = (torch.arange(n) - pad).clamp(min=0)
    return kp, vp, pos


@pytest.mark.parametrize("sink", [False, True])
def test_left_padding_leaves_a_rows_records_and_history_unchanged(sink):
    """A row's records and history do not depend on its padding: padding never shares a tile with real tokens."""
    gen = torch.Generator().manual_seed(3)
    pad, n, steps = 40, 150, 30
    k, v = torch.randn(2, 2, 2, n, 64, generator=gen).unbind(0)
    kp, vp, pos = _padded(k, v, pad)
    batch, single = KVarNCache(PRESET, sink=sink), KVarNCache(PRESET, sink=sink)
    batch.update(kp, vp, 0, kwargs={"position_ids": pos})
    single.update(k[1:, :, pad:], v[1:, :, pad:], 0, kwargs={"position_ids": pos[1:, pad:]})
    for t in range(steps):
        k1, v1 = torch.randn(2, 2, 2, 1, 64, generator=gen).unbind(0)
        p = pos[:, -1:] + 1 + t
        batch.update(k1, v1, 0, kwargs={"position_ids": p})
        single.update(k1[1:], v1[1:], 0, kwargs={"position_ids": p[1:]})
    a, b = batch.layers[0], single.layers[0]
    real = n - pad + steps
    assert batch._sequences.rows.real == [n + steps, real] and b.length == real and a.length == n + steps
    tiles = real // G
    assert torch.equal(a.records[1, :tiles], b.records[0, :tiles])
    hk, hv = a.history()
    sk, sv = b.history()
    assert torch.equal(hk[1, :, pad:], sk[0]) and torch.equal(hv[1, :, pad:], sv[0])
    assert not hk[1, :, :pad].any()  # padding positions read back as zeros (the mask hides them)
    mem = batch.memory_report()
    assert mem["tail_used"] == 2 * ((n + steps) % G + real % G) * 2 * 64 * 4


def test_right_padding_is_refused():
    k = torch.randn(2, 2, 10, 64)
    pos = torch.tensor([list(range(10)), [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]])
    cache = KVarNCache(PRESET)
    cache.update(k, k, 0, kwargs={"position_ids": pos})  # read as 9 pads + 1 real token: legal so far
    with pytest.raises(ValueError, match="left"):
        cache.update(k[:, :, :2], k[:, :, :2], 0, kwargs={"position_ids": torch.tensor([[10, 11], [1, 7]])})


@pytest.mark.parametrize("paged", [False, True])
def test_padded_generate_matches_each_rows_own_run(tiny, paged):
    """A left-padded batch generates, row by row, what each prompt generates alone."""
    prompts = [prompt_ids(150, seed=4)[0], prompt_ids(37, seed=5)[0]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    if paged:
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
    try:
        with torch.no_grad():
            out = tiny.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=30,
                do_sample=False,
                past_key_values=KVarNCache(PRESET, paged=paged, attention_mask=None if paged else mask),
            )
            alone = [
                tiny.generate(
                    p[None], max_new_tokens=30, do_sample=False, past_key_values=KVarNCache(PRESET, paged=paged)
                )
                for p in prompts
            ]
    finally:
        tiny.set_attn_implementation("sdpa")
    for row, single in zip(out, alone, strict=True):
        assert torch.equal(row[width:], single[0, -30:])


def test_beam_search_reorders_records_and_pools(tiny):
    """Beam search moves rows: the dequantizing and the paged paths must still agree token for token."""
    ids = prompt_ids(100)
    with torch.no_grad():
        plain = tiny.generate(
            ids, max_new_tokens=40, num_beams=3, do_sample=False, past_key_values=KVarNCache(PRESET, sink=True)
        )
    register_kvarn_attention()
    tiny.set_attn_implementation("kvarn")
    try:
        with torch.no_grad():
            cache = KVarNCache(PRESET, sink=True, paged=True)
            paged = tiny.generate(ids, max_new_tokens=40, num_beams=3, do_sample=False, past_key_values=cache)
    finally:
        tiny.set_attn_implementation("sdpa")
    assert torch.equal(plain, paged)


def _left_padded(prompts):
    """``prompts`` (1-D token ids) left-padded into one batch: ``ids, mask: [B, width]``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


def test_a_mask_of_one_row_per_prompt_is_repeated_for_each_beam():
    """generate repeats each prompt's row once per beam (``repeat_interleave``): a ``[B, T]`` mask serves ``B * k``
    rows; a batch it does not divide is refused."""
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :30] = 0
    k = torch.randn(4, 2, 100, 64)
    cache = KVarNCache(PRESET, attention_mask=mask)
    cache.update(k, k, 0)
    assert cache._sequences.rows.real == [100, 100, 70, 70]
    with pytest.raises(ValueError, match="one row per prompt"):
        KVarNCache(PRESET, attention_mask=mask).update(k[:3], k[:3], 0)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_padded_batch_generates_each_prompts_own_output(tiny, num_beams):
    """Greedy and beam search over a left-padded batch with KVarNCache(attention_mask=mask), the mask generate is
    given: each row generates what its prompt generates alone, and the mask repeated per beam gives the same."""
    prompts = [prompt_ids(150, seed=4)[0], prompt_ids(37, seed=5)[0]]
    ids, mask = _left_padded(prompts)
    args = {"max_new_tokens": 30, "min_new_tokens": 30, "num_beams": num_beams, "do_sample": False}
    with torch.no_grad():
        out = tiny.generate(ids, attention_mask=mask, past_key_values=KVarNCache(PRESET, attention_mask=mask), **args)
        repeated = KVarNCache(PRESET, attention_mask=mask.repeat_interleave(num_beams, dim=0))
        per_beam = tiny.generate(ids, attention_mask=mask, past_key_values=repeated, **args)
        alone = [tiny.generate(p[None], past_key_values=KVarNCache(PRESET), **args) for p in prompts]
    assert torch.equal(out, per_beam)
    for row, single in zip(out, alone, strict=True):
        assert torch.equal(row[ids.shape[1] :], single[0, -30:])


def _padding_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "cannot see this batch's padding" in str(w.message)]


def test_no_padding_warning_where_no_padding_can_hide(tiny):
    """Beams of one prompt (rows that are copies of one row), a batch whose position ids the cache sees (one row of
    positions for every row, as a model may pass them), an unpadded batch with its mask, and the kvarn attention's
    padding mask: nothing is hidden, nothing is said."""
    two = torch.cat([prompt_ids(40, seed=6), prompt_ids(40, seed=7)])
    k = torch.randn(2, 2, 10, 64)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        tiny.generate(
            prompt_ids(40), num_beams=3, max_new_tokens=4, do_sample=False, past_key_values=KVarNCache(PRESET)
        )
        KVarNCache(PRESET).update(k, k, 0, kwargs={"position_ids": torch.arange(10)[None]})
        ones = torch.ones_like(two)
        cache = KVarNCache(PRESET, attention_mask=ones)
        tiny.generate(two, attention_mask=ones, num_beams=2, max_new_tokens=4, do_sample=False, past_key_values=cache)
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
        try:
            cache = KVarNCache(PRESET, paged=True)
            tiny.generate(two, attention_mask=ones, max_new_tokens=4, do_sample=False, past_key_values=cache)
        finally:
            tiny.set_attn_implementation("sdpa")
    assert not _padding_warnings(caught)


def test_the_padding_warning_fires_where_padding_may_hide(tiny):
    """Rows of different prompts and no position ids, mask or kvarn attention: the cache cannot tell padding from
    tokens, and says so once."""
    prompts = [prompt_ids(40, seed=6)[0], prompt_ids(25, seed=7)[0]]
    ids, mask = _left_padded(prompts)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        tiny.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=KVarNCache(PRESET))
    assert len(_padding_warnings(caught)) == 1


def test_rows_are_compared_only_at_a_batchs_first_step(monkeypatch):
    """Comparing a batch's rows (may padding hide there?) waits for the GPU: one row, and every later step, skip it."""
    from kvarn.integration.hf import batch as batch_module

    calls, compare = [], batch_module._copies_of_one_row
    monkeypatch.setattr(batch_module, "_copies_of_one_row", lambda x: calls.append(x.shape[0]) or compare(x))
    one, two = KVarNCache(PRESET), KVarNCache(PRESET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (5, 1, 1):
            k = torch.randn(1, 2, n, 64)
            one.update(k, k, 0)
            two.update(k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), 0)
    assert calls == [2]


@pytest.mark.parametrize(
    "preset,sink",
    [("kvarn_k4v2_g64", False), ("kvarn_k4v2_g64", True), ("kvarn_k4v2_g64_ks", True), ("norotate", False)],
)
def test_keep_decoded_attends_over_what_history_reads(preset, sink):
    """``keep_decoded`` settles only what each step changed; every step still attends over ``history()`` exactly,
    and ``history()`` reads what it reads without the option: left padding (a row's tile ``i`` committed
    after another row's), chunks crossing tiles, the sink, an unrotated format, rows reordered as beams are."""
    if preset == "norotate":
        preset = KVarNConfig.from_preset(PRESET, rotate=False)
    gen = torch.Generator().manual_seed(5)
    pad, n = 40, 150
    k, v = torch.randn(2, 3, 2, n, 64, generator=gen).unbind(0)
    k[1, :, :pad], v[1, :, :pad] = 1e4, -1e4  # row 1: left padding, as generate positions it
    pos = torch.arange(n).repeat(3, 1)
    pos[1] = (torch.arange(n) - pad).clamp(min=0)
    caches = [KVarNCache(preset, sink=sink, keep_decoded=keep) for keep in (False, True)]

    def step(kk, vv, p):
        (ka, va), (kb, vb) = (c.update(kk, vv, 0, kwargs={"position_ids": p}) for c in caches)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        (ka, va), (kb, vb) = (c.layers[0].history() for c in caches)
        assert torch.equal(ka, kb) and torch.equal(va, vb)

    step(k, v, pos)
    last = pos[:, -1:]
    for i, size in enumerate([1, 5, 1, 70, 3, 1, 64, 2, 1, 1]):
        if i == 6:  # beams: rows 0 and 2 (equal lengths) exchanged
            for c in caches:
                c.reorder_cache(torch.tensor([2, 1, 0]))
        kk, vv = torch.randn(2, 3, 2, size, 64, generator=gen).unbind(0)
        p = last + 1 + torch.arange(size)
        step(kk, vv, p)
        last = p[:, -1:]
    kept = caches[1].layers[0]
    copies = [kept.kept.k, kept.kept.v, *(kept.decoded or ())]  # the kept history and history()'s tiles
    assert caches[1].nbytes()["decoded"] == sum(t.numel() * 4 for t in copies) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep_decoded", [False, True])
def test_a_cuda_step_queues_its_work_without_waiting_for_the_device(keep_decoded):
    """An fp16 model's steps through ``KVarNCache`` (planned once a step, stored, attended over) never wait for the
    device: a host sync in a step leaves the GPU idle while the host prepares the next one. A prompt chunk that
    ends inside a tile, then tokens one at a time across a tile boundary (commits)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run(mode: str) -> None:
        cache = KVarNCache(PRESET, keep_decoded=keep_decoded)
        for n in [G * 2 + 3] + [1] * G:
            k, v = torch.randn(2, 1, 2, n, G, device="cuda", dtype=torch.float16, generator=gen).unbind(0)
            torch.cuda.set_sync_debug_mode(mode)
            try:
                for layer in range(2):
                    cache.update(k, v, layer)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    run("default")  # Triton compiles and torch allocates first
    run("error")
