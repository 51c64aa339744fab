"""What the backend learns from vLLM's scheduler and asks of its block pool, through the hooks.

- :func:`note_schedule`: each real step's scheduler output on the GPU model runner (V2), for the sink
  (:class:`~kvarn.integration.vllm.state.SinkBook`: each request's first blocks, fresh blocks' sinks dropped).
- :func:`commit_replayed_steps` and :func:`graph_unsafe_step`: a step of the GPU runner's CUDA-graph
  decode, committed after its replay and kept out of the full graph where a prefix hit could read a tile
  the step fills.
- :func:`release_request_tails`: finished and preempted requests of the CPU runner free their tail slots.
- :func:`note_drafts`, :func:`step_drafts` and :func:`draft_pass_drafts`: each row's speculative draft count,
  from the scheduler output to the step's planner and a draft model's (V1 runner).
- :func:`block_held` and :func:`forget_cached_block`: the sink's questions to vLLM's ``BlockPool``.

The hooks that call these are :mod:`kvarn.integration.vllm.hooks`'; the state they update is
:data:`kvarn.integration.vllm.state.serving`. Imports nothing from vLLM.
"""

from __future__ import annotations

import numpy as np

from kvarn.integration.vllm.state import serving
from kvarn.paged import TilePlanner


def note_schedule(scheduler_output, runner=None) -> None:
    """Update the sink book from one real step's ``SchedulerOutput`` (the GPU runner's ``execute_model``
    hook calls it first thing; dummy runs do not come here).

    Departed requests (finished, preempted) forget their first blocks; admitted ones (new,
    resumed, re-added) record theirs and drop the sinks of their fresh blocks (those past the
    prefix hit, ``num_computed_tokens`` rounded up to a block); running requests drop the sinks of
    the blocks appended to them. ``runner`` (the model runner) gives each group's block size and
    layers; without it one group of ``G``-token blocks is assumed.
    """
    book = serving.sink_book
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


def note_drafts(scheduler_output, req_ids) -> None:
    """Record each row's speculative draft count for the step about to be built (V1 runner's
    ``_update_states`` hook, after vLLM ordered the batch's rows and trimmed any drafts).

    ``req_ids``: the request id of each batch row, in the order the step's metadata lists them. A
    request with ``k`` drafts is scheduled ``1 + k`` tokens, its last ``k`` unverified
    (``scheduler_output.scheduled_spec_decode_tokens``). Kept with each row's scheduled token count,
    so a build can tell whether its rows are this step's (:func:`step_drafts`); a step without drafts
    keeps zeros, which a draft model's first pass over the step reads (:func:`draft_pass_drafts`).
    """
    if req_ids is None:
        serving.step_drafts = None
        return
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    ids = list(req_ids)
    serving.step_drafts = (
        np.array([len(spec.get(rid, ())) for rid in ids], dtype=np.int64),
        np.array([int(counts.get(rid, 0)) for rid in ids], dtype=np.int64),
    )


def step_drafts(query_start_loc: np.ndarray, batch: int) -> np.ndarray | None:
    """Each row's draft count for a step of ``batch`` rows whose ``query_start_loc: [batch + 1]`` the builder
    plans, or ``None`` (no drafts noted).

    The rows must be the noted step's (same scheduled token count per row); a build whose rows differ
    is not that step (a dummy run: vLLM's profiling or warm-up) and has no drafts.
    """
    noted = serving.step_drafts
    if noted is None:
        return None
    drafts, counts = noted
    query_lens = np.diff(np.asarray(query_start_loc[: batch + 1], dtype=np.int64))
    if counts.shape[0] < batch or not np.array_equal(counts[:batch], query_lens):
        return None
    return drafts[:batch]


def draft_pass_drafts(query_start_loc: np.ndarray, batch: int) -> np.ndarray:
    """Each row's unverified tokens in a draft model's first pass over the step (EAGLE, MTP, a draft model).

    That pass runs over the rows of the noted step, in its order, with as many tokens as the target
    (EAGLE: the same positions), or more (a draft model adds its next token, and pads rejected rows at
    the end), or fewer (vLLM's unpadded drafter batch: the accepted ones). A row's first ``counts -
    drafts`` tokens are the target's verified ones; the rest are planned as drafts. Without a noted step
    for these rows (a dummy run before any step) every token is a draft.
    """
    query_lens = np.diff(np.asarray(query_start_loc[: batch + 1], dtype=np.int64))
    noted = serving.step_drafts
    if noted is None or noted[1].shape[0] < batch:
        return query_lens
    drafts, counts = noted
    return np.clip(query_lens - (counts[:batch] - drafts[:batch]), 0, query_lens)


def commit_replayed_steps() -> int:
    """Run every builder's pending commits of replayed decode steps now
    (:meth:`~kvarn.integration.vllm.builder.KVarNMetadataBuilder.commit_replayed`).

    The GPU runner's ``execute_model`` hook calls it first thing: before vLLM applies the step's
    copy-on-write block copies (a prefix hit that ends inside a block copies that block before the step's
    metadata is built, so a tile a replayed step filled must be committed by then). Returns the number of
    layer commits."""
    return sum(b.commit_replayed() for b in list(serving.graph_builders))


def graph_unsafe_step(scheduler_output) -> bool:
    """Whether a real step must run outside vLLM's full decode graph: a batch of single-token requests that
    admits one through a prefix hit (new, or resumed after preemption, with ``num_computed_tokens > 0``).

    vLLM caches a block in the step that computes it, so such a request can hit a tile that another row
    of the same step fills (with a one-token prompt chunk, or, with async scheduling off, with a decode
    token; vLLM 0.26's V2 runner lists resumed requests among the new ones). Replayed from the graph,
    that step commits the tile only at the next step, after its own attention read the block as a
    record; a forward that runs in Python commits before it attends. The hook has vLLM dispatch such a
    step as one of mixed query lengths (piecewise graphs or eager). Only where a builder runs CUDA-graph
    decode steps."""
    if not serving.graph_builders:
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


def release_request_tails(block_ids, attn_groups=None, num_computed: int | None = None) -> int:
    """Free the tail slots of a request that left: ``block_ids`` is its cache blocks per KV-cache group.

    A planner of a sliding-window group (:attr:`~kvarn.paged.TilePlanner.window`) gets only the blocks from
    the request's last window on (``num_computed``: its computed tokens as of its last step): vLLM freed the
    ones before, and their stale ids may be another request's now. Without ``num_computed`` it gets none (a
    slot left behind is recycled with its block, or evicted).

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
                    blocks = block_ids[gid]
                    if planner.window is not None:
                        size = getattr(getattr(group, "kv_cache_spec", None), "block_size", None)
                        skipped = max(0, (num_computed or 0) - planner.window + 1)
                        blocks = blocks[skipped // size :] if num_computed is not None and size else []
                    found.append((planner, kernel_blocks(group, blocks)))
    if found:
        return sum(planner.release_blocks(blocks) for planner, blocks in found)
    blocks = [int(b) for group in block_ids for b in group]
    return sum(planner.release_blocks(blocks) for planner in list(serving.planners) if planner.window is None)


def _pools_with(block: int) -> list:
    return [pool for pool in list(serving.block_pools) if block < len(getattr(pool, "blocks", ()))]


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
