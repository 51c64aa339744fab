"""KVarN's page of a sliding-window layer where vLLM asks no backend for its page size (vLLM 0.26).

vLLM 0.32 and later size a layer's page from the fields :meth:`~kvarn.integration.vllm.backend.KVarNBackend.
customize_spec` sets (``state_content_bytes``), on any spec class. vLLM 0.26 sizes a full-attention page by
``TQFullAttentionSpec.tq_slot_size`` and has no such field for window layers: :class:`KVarNWindowPageSpec` is
its ``SlidingWindowSpec`` with the bytes of a record per token slot, so vLLM's window manager (found through
the spec registry's walk of the class's bases) frees its blocks as the window moves, and the layer's pages
take what its records need.
"""

from __future__ import annotations

import dataclasses
import functools

_NAME = "KVarNWindowPageSpec"


@functools.cache
def window_page_spec_class() -> type:
    """``KVarNWindowPageSpec``: vLLM's ``SlidingWindowSpec`` whose page holds ``record_slot_bytes`` bytes per
    (KV head, token slot); defined on first use (vLLM is imported only when it is served)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class KVarNWindowPageSpec(SlidingWindowSpec):
        record_slot_bytes: int = 0

        @property
        def real_page_size_bytes(self) -> int:
            if self.record_slot_bytes <= 0:
                return super().real_page_size_bytes
            return self.block_size * self.num_kv_heads * self.record_slot_bytes

    KVarNWindowPageSpec.__module__ = __name__
    KVarNWindowPageSpec.__qualname__ = _NAME
    return KVarNWindowPageSpec


def __getattr__(name: str):
    """The class on first use by name (a process that unpickles a spec it never built: vLLM's engine core)."""
    if name == _NAME:
        return window_page_spec_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
