"""The kvarn plugin for stock vLLM: ``--kv-cache-dtype kvarn_k4v2_g128`` and every other preset.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) in every process it starts.
Importing this package imports nothing from vLLM; :func:`register` does, and installs what
:mod:`kvarn.integration.vllm.hooks` describes. See ``docs/internals/vllm_backend.md``.

The package, one responsibility a module: ``plugin`` (the entry point), ``hooks`` (every patch of
vLLM), ``checks`` (start-up validation), ``state`` (what a process keeps), ``scheduler`` (what the
hooks learn from vLLM's scheduler), ``backend`` (the backend class and a run's pools), ``builder``
(the metadata builder), ``impl`` (the attention impl), ``registry`` (the classes per cache dtype),
``tail_blocks`` (tails in vLLM's blocks), ``warmup`` (kernels compiled before serving) and ``probe``
(a check of the GPU engine's last decode step).
"""

from __future__ import annotations

from kvarn.integration.vllm.plugin import DISABLE_ENV, is_enabled, logger, register, status

__all__ = ["DISABLE_ENV", "is_enabled", "logger", "register", "status"]
