"""The kvarn plugin for stock vLLM: ``--kv-cache-dtype kvarn_k4v2_g128`` and every other preset.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every process it starts.
Importing this module imports nothing from vLLM; :func:`register` does, and installs what
:mod:`kvarn.integration.vllm.plugin` describes. See ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
import os

DISABLE_ENV = "KVARN_DISABLE_VLLM"

logger = logging.getLogger("vllm.kvarn")

_state: dict[str, object] = {"registered": False, "enabled": False, "mode": None, "error": None}


def register() -> None:
    """Install kvarn into vLLM. Idempotent, cheap, and never raises.

    On any failure it logs one warning that says why, leaves vLLM as it found it as far as it
    got, and disables kvarn: vLLM keeps working, only the ``kvarn_*`` cache dtypes are missing.
    Set ``KVARN_DISABLE_VLLM=1`` to skip the plugin.
    """
    if _state["registered"]:
        return
    _state["registered"] = True
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        logger.info("kvarn vLLM plugin disabled by %s", DISABLE_ENV)
        return
    try:
        from kvarn.integration.vllm.plugin import install

        _state["mode"] = install()
        _state["enabled"] = True
    except Exception as exc:
        _state["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "kvarn: the vLLM plugin could not be installed (%s); the kvarn_* --kv-cache-dtype values are "
            "unavailable in this process, vLLM itself is unaffected",
            _state["error"],
        )


def is_enabled() -> bool:
    """Whether :func:`register` installed kvarn in this process."""
    return bool(_state["enabled"])


def status() -> dict[str, object]:
    """What :func:`register` did: ``registered``, ``enabled``, ``mode`` ("registry" or "literal"), ``error``."""
    return dict(_state)
