"""What kvarn's vLLM integration keeps for the life of a process: one :class:`ServingState`, :data:`serving`.

vLLM builds configs, backends, metadata builders and runners more than once per process (a second
engine, profiling and capture runs), and its hooks (:mod:`kvarn.integration.vllm.hooks`) hand the
backend what vLLM does not pass it. What outlives one call lives here and nowhere else; everything
else belongs to the builder, the impl or the layer it was built for. Imports nothing from vLLM.
"""

from __future__ import annotations

import collections
import contextlib
import os
import weakref
from dataclasses import dataclass, field

import numpy as np

from kvarn.integration.vllm.probe import PROBE_ENV, DecodeProbe


class SinkBook:
    """The sink's view of vLLM's scheduler on the GPU model runner (V2), which keeps no block table on the host.

    Per live request the block of its first tile in each KV-cache group (``first``, from the
    scheduler output that admitted it: a request's blocks are written from 0 only on admission and
    only appended afterwards), the ids of the requests of the latest real step (``scheduled``),
    and every sink pool of this process (``pools``, one :class:`~kvarn.paged.SinkSlots` per
    ``_sink`` builder). :func:`~kvarn.integration.vllm.scheduler.note_schedule` drops the sink of
    every block the scheduler hands out fresh before the step that writes it is planned, so a sink
    always holds its block's own first tile; vLLM's engine runs that call, the builders and the
    scheduler on one thread (the ``uni`` executor, which the checks require), so the block pool a
    sink eviction consults is the one the scheduler just left.
    """

    def __init__(self):
        self.first: dict[str, tuple[int, ...]] = {}
        self.scheduled: set[str] = set()
        self.group_of: dict[str, int] = {}
        self.groups_seen = None  # the kv_cache_groups list group_of was read from
        self.version = 0  # bumped whenever ``first`` changes (the builders cache their rows' first blocks)
        self.pools: weakref.WeakSet = weakref.WeakSet()

    def drop(self, blocks) -> None:
        for pool in list(self.pools):
            for block in blocks:
                pool.drop(int(block))


@dataclass
class ServingState:
    """The process-wide state of kvarn's vLLM integration (one instance: :data:`serving`)."""

    registration: dict = field(
        default_factory=lambda: {"registered": False, "enabled": False, "mode": None, "error": None}
    )
    """What :func:`kvarn.integration.vllm.plugin.register` did (:func:`~kvarn.integration.vllm.plugin.status`)."""
    config: object = None
    """The vLLM config of the last KVarN layer built in this process (vLLM 0.32 asks for its spec later,
    outside its config context)."""
    rows_hooked: bool = False
    """The plugin hooked the GPU model runner (V2): :meth:`set_step_rows` is called every step."""
    scheduler_hooked: bool = False
    """The plugin wrapped the GPU runner's ``execute_model``: :func:`~kvarn.integration.vllm.scheduler.note_schedule`
    sees every real step."""
    block_tables_widened: bool = False
    """The plugin widened the V2 GPU runner's block tables by the tail blocks
    (:func:`~kvarn.integration.vllm.hooks.install_block_table_hook`)."""
    hybrid_pages_sized: bool = False
    """This vLLM sizes a hybrid model's attention pages as KVarN's (``customize_spec``, or the plugin's
    :func:`~kvarn.integration.vllm.hooks.install_hybrid_page_hook`); else hybrid models are refused."""
    window_blocks_freed: bool = True
    """This vLLM asks the backend's ``customize_spec`` for every layer's page, keeping a sliding-window layer's
    window spec, whose blocks it frees as the window moves (vLLM 0.32 and later); ``False`` where the plugin's
    spec hook sizes pages instead (vLLM 0.26, :func:`~kvarn.integration.vllm.hooks.install_spec_hook`): it keeps
    the window spec where the run allows, and gives full-attention pages otherwise."""
    step_rows: np.ndarray | None = None
    """The stable request index of each row of the step being built (:meth:`set_step_rows`)."""
    step_qsl: np.ndarray | None = None
    """The host array that step's ``query_start_loc_cpu`` is a view of: how a build knows the rows are its batch's."""
    step_req_ids: list | None = None
    """Each row's request id (the sink looks up the request's first block by it)."""
    step_drafts: tuple[np.ndarray, np.ndarray] | None = None
    """The latest real step's speculative draft count and scheduled token count per batch row
    (:func:`~kvarn.integration.vllm.scheduler.note_drafts`), ``None`` for a step without drafts."""
    sink_book: SinkBook = field(default_factory=SinkBook)
    planners: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """Every block-keyed :class:`~kvarn.paged.TilePlanner` of this process (one per KV-cache group), which the
    runner's departures release."""
    graph_builders: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """Metadata builders of CUDA-graph decode steps, whose replayed steps' tiles are committed before the next step."""
    block_pools: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """vLLM's ``BlockPool`` objects created in this process (the sink asks them which blocks are held)."""
    shared_pools: dict = field(default_factory=dict)
    """Step pools of runs with tails in blocks, one per (device, dtype, KV heads, head size) for all layers."""
    flash: list = field(default_factory=list)
    """Empty until looked up, then ``[vLLM's flash attention for prompt chunks, or None]``."""
    logged_capacity: set = field(default_factory=set)
    """Capacity lines already logged (one per cache configuration)."""
    warned: set = field(default_factory=set)
    """Warnings already logged (:func:`~kvarn.integration.vllm.checks.warn_once`)."""
    tail_block_steps: collections.Counter = field(default_factory=collections.Counter)
    """Steps built with tails in blocks, by route (``decode`` through the blocks, ``commits`` of them that commit
    a tile, ``gathered`` through the step pool), decode steps committed after their replay (``replay_commits``)
    and steps kept out of the full decode graph (``mixed_dispatch``): what a run took, for tests and logs."""
    warmup_stats: dict = field(default_factory=lambda: {"runs": 0, "steps": 0, "seconds": 0.0, "error": None})
    """What the rehearsals of serving steps did (:mod:`kvarn.integration.vllm.warmup`): for logs and tests."""
    probe: DecodeProbe = field(default_factory=lambda: DecodeProbe(os.environ.get(PROBE_ENV) or None))
    """The ``KVARN_PROBE_LAYER`` layer's last decode step through the blocks."""

    def set_step_rows(self, idx_mapping: np.ndarray, query_start_loc: np.ndarray, req_ids=None) -> None:
        """Record the stable request index of each row of the step being built (the runner hook calls it).

        ``idx_mapping: [num_reqs]`` (request index per batch row), ``query_start_loc``: the host array
        the step's ``CommonAttentionMetadata.query_start_loc_cpu`` is a view of, ``req_ids``: each row's
        request id.
        """
        self.step_rows = np.asarray(idx_mapping)
        self.step_qsl = query_start_loc
        self.step_req_ids = None if req_ids is None else list(req_ids)

    @contextlib.contextmanager
    def bookkeeping_paused(self):
        """Steps built and run inside leave :attr:`tail_block_steps` and the decode probe as they were (the
        serving steps :func:`kvarn.integration.vllm.warmup.rehearse` runs before the first real one)."""
        counters, layer = dict(self.tail_block_steps), self.probe.layer
        self.probe.layer = None
        try:
            yield
        finally:
            self.probe.layer = layer
            self.tail_block_steps.clear()
            self.tail_block_steps.update(counters)


serving = ServingState()
"""This process's :class:`ServingState`."""
