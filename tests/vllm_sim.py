"""A scheduler simulation that drives the real KVarN metadata builder and impl without an engine.

:class:`Sim` runs many steps: ragged chunks that end inside tiles, decode and prefill in the same batch,
permuted and recycled block ids, requests that skip steps, prefix-cache hits on shared tiles, preemption
and requests that finish with an incomplete tile, and speculative verification steps whose rejected
drafts are rolled back (:meth:`Sim.reject`), and with ``window`` a sliding-window group whose blocks go back to
the pool as the window leaves them (vLLM's window manager: a running request's row keeps their stale ids, or
the null block 0), with ``sink_logits`` learned sinks. After every step the records of every full tile must
equal, byte for byte, the reference's ``store_tiles`` of that tile's tokens, and the attention output
must equal ``kvarn.reference.paged_attention`` over a cache the reference built from the token history.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvarn import reference
from kvarn.config import cache_dtype_config, has_sink
from kvarn.integration.vllm import impl as impl_mod
from kvarn.integration.vllm.backend import page_slot_bytes
from kvarn.integration.vllm.builder import _DecodeBuffers
from kvarn.integration.vllm.impl import KVarNAttentionImpl
from kvarn.integration.vllm.registry import BACKENDS
from kvarn.integration.vllm.scheduler import (
    block_held,
    forget_cached_block,
    note_drafts,
    note_schedule,
    release_request_tails,
)
from kvarn.integration.vllm.state import serving
from kvarn.paged import SinkSlots, TilePlanner

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

    def __init__(
        self,
        preset,
        dtype,
        num_blocks=96,
        seed=0,
        max_num_seqs=8,
        tail_slots=None,
        request_slots=False,
        speculative=False,
        window=None,
        sink_logits=None,
    ):
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
        self.window, self.sink_logits = window, sink_logits
        shape = {"block_size": self.g, "num_kv_heads": HKV, "head_size": D, "dtype": torch.uint8}
        if window is None:
            spec = self.backend.customize_spec(FullAttentionSpec(**shape))
        else:  # vLLM 0.32 hands the backend the window spec; its class must stay, so vLLM frees the blocks
            spec = self.backend.customize_spec(SlidingWindowSpec(**shape, sliding_window=window))
            # a _ks format keeps one tile more: its stores read the smoothing vector from the tile before the step's
            assert type(spec) is SlidingWindowSpec and spec.sliding_window == window + self.g * self.cfg.seq_smooth
            assert self.backend.customize_spec(spec) == spec, "asked twice, widened once"
        self.spec = spec
        assert spec.page_size_bytes == HKV * self.g * page_slot_bytes(self.cfg) >= HKV * self.cfg.record_bytes
        self.kv_cache = torch.zeros(num_blocks, HKV, self.g, spec.state_content_bytes, dtype=torch.uint8)
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=preset, num_gpu_blocks=None),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            model_config=SimpleNamespace(dtype=dtype),
            speculative_config=SimpleNamespace(method="ngram", num_speculative_tokens=3) if speculative else None,
        )
        self.builder = self.backend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device("cpu"))
        if tail_slots is not None:
            self.builder.num_slots = tail_slots
            sinks = self.builder.num_sink_slots
            self.builder.planner = TilePlanner(tail_slots, self.g, sinks, block_held, forget_cached_block)
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
        self.impl = KVarNAttentionImpl(
            HQ, D, 0.125, HKV, sliding_window=window, kv_cache_dtype=preset, sinks=sink_logits
        )
        self.window_freed = 0
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
            group = SimpleNamespace(kv_cache_group_id=0, metadata_builders=[self.builder], kv_cache_spec=self.spec)
            release_request_tails((req["blocks"],), [[group]], req.get("computed", 0))
        if self.window is not None:  # the blocks before the window went back to the pool already
            self.free.extend(req["blocks"][max(req.get("freed", 0), req.get("shared", 0)) :])
        elif keep_prefix:
            self.prefix[rid] = req
            full = len(req["k"]) // self.g
            self.free.extend(req["blocks"][full:])
        else:
            self.free.extend(req["blocks"][req.get("shared", 0) :])
        self.rng.shuffle(self.free)

    def reject(self, rid, count):
        """vLLM's rollback after a verification step: the last ``count`` tokens of request ``rid`` (drafts) were
        rejected. Its blocks stay; the next step starts at the shorter length and overwrites their rows. The
        records of the tiles the accepted tokens fill must equal the reference's of those tokens."""
        req = self.reqs[rid]
        if count:
            del req["k"][-count:], req["v"][-count:]
            req["len"] -= count
        full = req["len"] // self.g
        del req["rec"][full:]  # a tile that held a rejected draft is re-quantized when it fills again
        if full:
            cache = self.kv_cache.view(self.kv_cache.shape[0], HKV, -1)[..., : self.cfg.record_bytes]
            blocks = torch.tensor(req["blocks"][:full])
            assert torch.equal(cache[blocks], torch.stack(req["rec"][:full])), f"records of request {rid} differ"

    def step(self, chunks, drafts=None, draft_index=None):
        """Run one step; ``chunks`` maps request id -> number of new tokens, ``drafts`` request id -> how many
        of them (the last ones) are speculative drafts (what the runner hook notes from the scheduler output).

        ``draft_index``: the step is a draft model's (the builder is a draft layer's, built through
        ``build_for_drafting``): nothing is noted (the target's step was, by :meth:`note_target`), and the host's
        upper bound of the lengths is too high, as vLLM's drafter leaves it after a rejection."""
        order = list(chunks)
        if draft_index is None:  # a draft model's steps keep the target step's rows, in their order
            self.rng.shuffle(order)
        qsl, lens, ks, vs = [0], [], [], []
        had = {rid: len(self.reqs[rid]["blocks"]) for rid in order}
        computed = {rid: self.reqs[rid]["len"] for rid in order}
        if self.window is not None:
            self._slide(order, computed)
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
            seq_lens_cpu_upper_bound=lens_t if draft_index is None else lens_t + 3,
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
        spec = {str(r): [0] * k for r, k in (drafts or {}).items() if k}
        scheduled = SimpleNamespace(
            scheduled_spec_decode_tokens=spec, num_scheduled_tokens={str(r): chunks[r] for r in order}
        )
        if draft_index is None:
            note_drafts(scheduled, [str(r) for r in order])
            meta = self.builder.build(0, cam)
        else:
            meta = self.builder.build_for_drafting(cam, draft_index)
        self.last_meta = meta
        output = torch.full((num_tokens, HQ, D), float("nan"), dtype=self.dtype)
        replayed = self.replay and meta.decode
        with mock.patch.object(impl_mod, "_capturing", lambda q: True) if replayed else contextlib.nullcontext():
            self.impl.forward(self.layer, query, key, value, self.kv_cache, meta, output=output)
        if replayed:  # a replay runs what was captured; the forward's Python does not run
            meta.forward_ran = False
        self.step_kv = (key[: qsl[-1]], value[: qsl[-1]])
        self.check(order, query[: qsl[-1]], qsl_t, lens_t, table, output[: qsl[-1]], replayed)

    def note_target(self, chunks, drafts):
        """What the runner hook notes of a target step (its rows in ``chunks``' order, ``drafts`` as in :meth:`step`),
        for the draft model's steps that follow it."""
        spec = {str(r): [0] * k for r, k in drafts.items() if k}
        counts = {str(r): n for r, n in chunks.items()}
        note_drafts(SimpleNamespace(scheduled_spec_decode_tokens=spec, num_scheduled_tokens=counts), list(counts))

    def _slide(self, order, computed):
        """vLLM's window manager as it schedules a step: the blocks wholly before each scheduled request's window
        go back to the pool (handed out again in this very step); the request's row keeps their stale ids, or
        shows the null block 0 there (a resumed request's fresh row)."""
        for rid in order:
            req = self.reqs[rid]
            req["computed"] = computed[rid]
            skip = min(max(0, computed[rid] - self.spec.sliding_window + 1) // self.g, len(req["blocks"]))
            for col in range(req.get("freed", 0), skip):
                if col >= req.get("shared", 0) and req["blocks"][col]:
                    self.free.append(req["blocks"][col])
                    self.window_freed += 1
                if self.rng.random() < 0.3:
                    req["blocks"][col] = 0
            req["freed"] = max(req.get("freed", 0), skip)
        self.rng.shuffle(self.free)

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
            live = req.get("freed", 0)  # the blocks a window left belong to others now
            if full > live:
                blocks = torch.tensor(req["blocks"][live:full])
                expect[blocks] = torch.stack(req["rec"][live:full])
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
            query,
            expect,
            table,
            lens,
            tail_k,
            tail_v,
            slots,
            self.cfg,
            qsl,
            sinks,
            0.125,
            key,
            value,
            window=self.window,
            sink_logits=None if self.sink_logits is None else self.sink_logits.float(),
        )
        assert not output.isnan().any(), "the backend left output rows unwritten"
        if self.builder.prefill_split:  # prompt chunks attend by another order of arithmetic
            tol = 1e-5 if self.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(output.float(), want.float(), atol=tol, rtol=tol)
            return
        assert torch.equal(output, want), f"max diff {(output.float() - want.float()).abs().max()}"
