"""Compile the kernels that serving steps launch before the first request, by rehearsing such steps.

Triton compiles a kernel variant the first time a launch needs it. vLLM's own warm-up (0.26's V2
runner: graph captures of decode batches, a prefill of 2-token prompts and one decode step) launches
only some of KVarN's variants: no prompt chunk of 64+ tokens (so none of the page kernels of
:meth:`kvarn.paged.PagedKV.read_pages`, no tile stored whole), no mixed step of decodes and prompt
chunks. Without this module those variants compile inside the first serving steps that need them,
a second or two each while every running request waits.

:func:`rehearse` runs, once per builder and before the first step it builds over a bound cache, a
fixed list of steps (:func:`rehearsal_steps`) through the builder's own :meth:`build` and the
layer's own ``forward``, on a scratch cache (a few zeroed blocks of the real cache's block shape,
under a block table of vLLM's width) and random K/V: a prompt step, a mixed step of a decode and a
chunk that starts inside a tile, a step of short multi-token queries, then decode, mixed and
short-query steps at batch sizes ``1, 2, 4, ...`` up to ``max_num_seqs`` (the launch rules choose
variants by program count). The real cache, the request state and the counters tests read are
untouched; only the shared step pool (refilled by every step) is written, and the scratch memory
goes back to the device after. With the counts that change from step to step unspecialized
(:data:`kvarn.kernels._common.STEP_COUNTS`) and a step's index tensors 16-byte aligned
(:func:`kvarn.paged.to_device_aligned`), what is left to compile is a variant per outcome of the
launch rules, which these steps reach.

Runs with tails in vLLM's blocks only (the GPU engine's default; the builder keeps no request state
then). ``KVARN_WARMUP``: unset, on for CUDA devices; ``1`` on anywhere (the CPU engine's tests run the
same steps through the reference kernels); ``0`` off; any other value is refused as a builder is made,
on every engine. A failure is logged as a warning and serving goes on (the kernels then compile on first
use).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import SimpleNamespace

import torch

from kvarn.integration.vllm.state import serving
from kvarn.paged import PREFILL_MIN_QUERIES

logger = logging.getLogger("vllm.kvarn")

WARMUP_ENV = "KVARN_WARMUP"

REHEARSAL_TILES = 3
"""The rehearsed sequences reach into their third tile at most (:func:`rehearsal_steps`)."""


def warmup_wanted(device: torch.device | str) -> bool:
    """Whether builders on ``device`` rehearse serving steps (``$KVARN_WARMUP``, see the module docstring)."""
    env = os.environ.get(WARMUP_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{WARMUP_ENV} must be 0 or 1 (or unset), got {env!r}")
    return env == "1" or (env == "" and torch.device(device).type == "cuda")


def _sizes(max_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_seqs]


def rehearsal_steps(g: int, max_len: int, max_seqs: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The rehearsed steps as ``(query lengths, sequence lengths)`` per request, for tiles of ``g`` tokens,
    sequences of at most ``max_len`` tokens (the block table's reach), ``max_seqs`` requests and
    ``max_tokens`` tokens a step. Every sequence ends within its first ``REHEARSAL_TILES`` tiles. Empty
    where those do not fit in ``max_len``."""
    if max_len < REHEARSAL_TILES * g:
        return []
    p = PREFILL_MIN_QUERIES
    steps = [
        ([2 * g + 7, g + 1], [2 * g + 7, g + 1]),  # prompts: tiles stored whole, partial tiles to the tails
        ([1, g], [2 * g + 8, 2 * g + 1]),  # a decode row and a chunk from inside a tile, across its end
        ([2, 3], [g + 2, 2 * g + 3]),  # short queries: no prompt pages, the multi-query kernel
    ]
    steps = [(q, lens) for q, lens in steps if sum(q) <= max_tokens and len(q) <= max_seqs]
    for b in _sizes(max_seqs):
        lens = [g + 1 + (7 * i) % g for i in range(b)]
        lens[-1] = 2 * g  # its token completes a tile: the commit
        steps.append(([1] * b, lens))  # decode
        if b + p <= max_tokens:
            steps.append(([1] * (b - 1) + [p], [*lens[:-1], g + p]))  # decodes beside a prompt chunk
        if 2 * b <= max_tokens:
            steps.append(([2] * b, [n + 1 for n in lens]))  # short queries
    return steps


def _layer_cache(builder):
    """The first layer of the builder's group and its bound KV cache tensor, or ``(None, None)``."""
    ctx = getattr(getattr(builder.vllm_config, "compilation_config", None), "static_forward_context", None)
    layer = (ctx or {}).get(builder.layer_names[0]) if builder.layer_names else None
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):  # one tensor per virtual engine on some vLLM versions
        kv = kv[0] if kv else None
    if not isinstance(kv, torch.Tensor) or not kv.numel() or getattr(layer, "impl", None) is None:
        return None, None
    return layer, kv


def rehearse(builder, cam, paused: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> bool:
    """Rehearse the serving steps for ``builder``'s group before it builds ``cam`` (see the module docstring).

    ``paused``: a context the steps run in, under which the builder's bookkeeping (step counters, the
    decode probe) ignores them. Returns ``False`` to be asked again at a later build (no cache bound
    yet, or a CUDA graph being captured), ``True`` once done, skipped or failed.
    """
    if not builder.tail_rows:
        return True
    layer, kv = _layer_cache(builder)
    if layer is None:
        return False
    if kv.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    g, width = builder.cfg.group_size, int(cam.block_table_tensor.shape[1])
    sched = builder.vllm_config.scheduler_config
    max_seqs = min(int(sched.max_num_seqs), builder.num_slots)
    max_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 2 * max_seqs + PREFILL_MIN_QUERIES)
    steps = rehearsal_steps(g, (width - builder.tail_blocks) * g, max_seqs, max_tokens)
    if not steps:
        return True
    stats = serving.warmup_stats
    t0 = time.perf_counter()
    try:
        with paused():
            _run(builder, layer.impl, kv, width, steps)
        if kv.is_cuda:
            torch.cuda.empty_cache()  # the scratch cache and the steps' workspaces back to the device
        stats["steps"] = int(stats["steps"]) + len(steps)
        stats["runs"] = int(stats["runs"]) + 1
        stats["error"] = None
        logger.info(
            "KVarN: rehearsed %d serving steps (batch up to %d) to compile their kernels in %.1f s",
            len(steps),
            max_seqs,
            time.perf_counter() - t0,
        )
    except Exception as exc:  # never break the engine: the kernels then compile on first use
        stats["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("KVarN: rehearsing serving steps failed (%s); kernels compile on first use", exc, exc_info=True)
    finally:
        stats["seconds"] = float(stats["seconds"]) + time.perf_counter() - t0
    return True


def _run(builder, impl, kv: torch.Tensor, width: int, steps) -> None:
    dev = kv.device
    dtype = builder.vllm_config.model_config.dtype
    # the steps' sequences reach column REHEARSAL_TILES - 1 + tail_blocks at most; the table keeps vLLM's
    # width (the launch rules read it), its later columns all name the last scratch block
    blocks = min(width, REHEARSAL_TILES + builder.tail_blocks)
    cache = torch.zeros((blocks, *kv.shape[1:]), dtype=kv.dtype, device=dev)
    rows = max(len(q) for q, _ in steps)
    cols = torch.arange(width, dtype=torch.int32, device=dev).clamp(max=blocks - 1)
    table = cols.repeat(rows, 1)  # every row: the same scratch blocks
    gen = torch.Generator(device=dev).manual_seed(0)
    stub = SimpleNamespace(layer_name=None)  # the tail pool is shared by the layers; nothing is kept on this
    hq, hkv, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    for queries, lens in steps:
        b, n = len(queries), sum(queries)
        qsl = torch.tensor([0, *itertools.accumulate(queries)], dtype=torch.int32)
        cam = SimpleNamespace(
            num_reqs=b,
            num_actual_tokens=n,
            max_query_len=max(queries),
            query_start_loc_cpu=qsl,
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32),
            block_table_tensor=table[:b],
        )
        meta = builder.build(0, cam)
        q = torch.randn(n, hq, d, generator=gen, device=dev).to(dtype)
        k = torch.randn(n, hkv, d, generator=gen, device=dev).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen, device=dev).to(dtype)
        impl.forward(stub, q, k, v, cache, meta, output=torch.empty_like(q))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
