"""One backend class per KVarN cache dtype, each with its own builder and impl classes, and the import
path vLLM's backend registry and the selection hook hand vLLM (:func:`backend_path`).

Each class takes its format from its own preset (``KVarNBackend_k4v2_g128`` serves
``kvarn_k4v2_g128``), never from the run's ``cache_dtype``. They are attributes of this module, so
vLLM imports them by path in every process.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvarn.config import CACHE_DTYPES, has_sink
from kvarn.integration.vllm.backend import KVarNBackend
from kvarn.integration.vllm.builder import KVarNMetadataBuilder
from kvarn.integration.vllm.impl import KVarNAttentionImpl


def _backend_for(preset: str) -> type[KVarNBackend]:
    """The backend, builder and impl classes of one ``--kv-cache-dtype`` name (:data:`kvarn.config.CACHE_DTYPES`)."""
    short = preset.removeprefix("kvarn_")
    names = {
        "backend": f"KVarNBackend_{short}",
        "builder": f"KVarNMetadataBuilder_{short}",
        "impl": f"KVarNAttentionImpl_{short}",
    }
    attrs = {"preset": preset, "sink": has_sink(preset), "__module__": __name__}
    backend = type(names["backend"], (KVarNBackend,), attrs)
    builder = type(names["builder"], (KVarNMetadataBuilder,), {"backend": backend, "__module__": __name__})
    impl = type(names["impl"], (KVarNAttentionImpl,), {"backend": backend, "__module__": __name__})
    backend.builder_cls, backend.impl_cls = builder, impl
    for cls in (backend, builder, impl):
        cls.__qualname__ = cls.__name__
    return backend


BACKENDS: Mapping[str, type[KVarNBackend]] = MappingProxyType({name: _backend_for(name) for name in CACHE_DTYPES})
"""The backend class of every KVarN cache dtype (read-only)."""
globals().update({c.__name__: c for b in BACKENDS.values() for c in (b, b.builder_cls, b.impl_cls)})


def backend_path(preset: str) -> str:
    """The importable path of the backend class of ``preset``."""
    cls = BACKENDS[preset]
    return f"{cls.__module__}.{cls.__qualname__}"
