"""The entry point vLLM calls (``vllm.general_plugins``): :func:`register`, in every process it starts.

vLLM does not catch what a plugin raises, and it calls every installed plugin before config
validation: a raise here would break vLLM for every user who has kvarn installed, KVarN or not. So
:func:`register` is idempotent, cheap (nothing of vLLM is imported until it runs) and never raises.
:func:`install` does the work: the backend name in vLLM's registry, then the hooks of
:mod:`kvarn.integration.vllm.hooks`, each given the backend it hands out.
"""

from __future__ import annotations

import logging
import os

from kvarn.integration.vllm.state import serving

DISABLE_ENV = "KVARN_DISABLE_VLLM"

logger = logging.getLogger("vllm.kvarn")


def register() -> None:
    """Install kvarn into vLLM. Idempotent, cheap, and never raises.

    On any failure it logs one warning that says why, leaves vLLM as it found it as far as it
    got, and disables kvarn: vLLM keeps working, only the ``kvarn_*`` cache dtypes are missing.
    Set ``KVARN_DISABLE_VLLM=1`` to skip the plugin.
    """
    status = serving.registration
    if status["registered"]:
        return
    status["registered"] = True
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        logger.info("kvarn vLLM plugin disabled by %s", DISABLE_ENV)
        return
    try:
        status["mode"] = install()
        status["enabled"] = True
    except Exception as exc:
        status["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "kvarn: the vLLM plugin could not be installed (%s); the kvarn_* --kv-cache-dtype values are "
            "unavailable in this process, vLLM itself is unaffected",
            status["error"],
        )


def is_enabled() -> bool:
    """Whether :func:`register` installed kvarn in this process."""
    return bool(serving.registration["enabled"])


def status() -> dict[str, object]:
    """What :func:`register` did: ``registered``, ``enabled``, ``mode`` ("registry" or "literal"), ``error``."""
    return dict(serving.registration)


def install_backend_name() -> str:
    """Register the KVarN backend in vLLM's attention-backend registry (once per process); returns its name.

    ``KVARN`` where the registry takes new names (0.32 and later); ``CUSTOM`` where its enum is
    closed (0.26), the slot vLLM keeps for one out-of-tree backend. The backend classes'
    ``get_name()`` answers the name used, since vLLM looks each layer's backend up by it.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvarn.config import DEFAULT_PRESET
    from kvarn.integration.vllm.backend import BACKEND_NAME, KVarNBackend
    from kvarn.integration.vllm.registry import backend_path

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


def install() -> str:
    """Install the backend name and the hooks, then the dtype names; returns how the names were added.

    The names come last: until they exist no layer can ask for a KVarN cache, so a failure part way
    leaves vLLM as it was (the platform hooks are taken out again).
    """
    from vllm.platforms import current_platform

    from kvarn.integration.vllm import hooks
    from kvarn.integration.vllm.backend import KVarNBackend
    from kvarn.integration.vllm.registry import backend_path

    install_backend_name()
    hooks.install_spec_hook(KVarNBackend)
    hooks.install_hybrid_page_hook(KVarNBackend, current_platform)
    hooks.install_block_pool_hook()
    hooks.install_registry_hook(current_platform)
    if current_platform.is_cuda_alike():
        hooks.install_runner_hook()
        hooks.install_block_table_hook()
    hooked = configured = False
    try:
        hooked = hooks.install_selection_hook(current_platform, backend_path)
        configured = hooks.install_config_hook(current_platform)
        return hooks.install_dtypes()
    except Exception:
        if hooked:
            hooks.uninstall_selection_hook(current_platform)
        if configured:
            hooks.uninstall_config_hook(current_platform)
        raise
