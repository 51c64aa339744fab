"""The attention launcher's argument checks: shapes, dtypes and knob combinations, before any launch.

Each raises a ``ValueError`` that says what to change; :mod:`kvarn.kernels.attention` calls them.
"""

from __future__ import annotations

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels._common import check_cache, check_dtype


def check_args(query, cache, block_table, seq_lens, tail_k, tail_v, cfg, query_start_loc, kv=(None, None)) -> None:
    """Raise unless :func:`~kvarn.kernels.attention.paged_attention`'s tensors fit the config and each other."""
    check_dtype("query", query)
    check_cache(cache, cfg)
    check_dtype("tail_k", tail_k)
    _, hq, d = query.shape
    hkv = cache.shape[1]
    if d != cfg.head_dim:
        raise ValueError(f"query head_dim {d} does not match the config's {cfg.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if (
        tail_k.dim() != 4
        or tail_k.shape[2:] != (hkv, d)
        or not 0 < tail_k.shape[1] <= cfg.group_size
        or tail_v.shape != tail_k.shape
        or tail_v.stride() != tail_k.stride()
        or tail_k.stride(-1) != 1
    ):
        raise ValueError(
            f"tail_k, tail_v must both be [num_slots, {cfg.group_size}, {hkv}, {d}] (or [num_blocks, rows, {hkv}, "
            f"{d}] with [B, N] tail_slots) with equal strides, got {tuple(tail_k.shape)}"
        )
    batch = seq_lens.shape[0]
    if query_start_loc is None and query.shape[0] != batch:
        raise ValueError(
            f"without query_start_loc there is one query per sequence: {query.shape[0]} queries for {batch} sequences"
        )
    if query_start_loc is not None and query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < batch or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be [B, max_blocks] with unit last stride, got {tuple(block_table.shape)}")
    _check_kv(*kv, query, cache)


def tail_block_rows(tail_slots, tail_k, cfg: KVarNConfig, batch: int, query_start_loc, sink_slots) -> int:
    """0 for ``tail_slots: [B]`` slots of a pool ``[num_slots, G, Hkv, D]``; for ``[B, N]`` tables of own tiles
    kept as rows of blocks (``tail_k: [num_blocks, R, Hkv, D]``, ``N * R >= G``), ``R`` (decode, no sink)."""
    g, rows = cfg.group_size, tail_k.shape[1]
    if tail_slots.dim() == 1 and tail_slots.shape[0] >= batch and rows == g:
        return 0
    if tail_slots.dim() != 2:
        raise ValueError(
            f"tail_slots must be [B] slots of a [num_slots, {g}, Hkv, D] pool or [B, N] blocks of rows, "
            f"got {tuple(tail_slots.shape)} with a pool of {rows} rows a slot"
        )
    if tail_slots.shape[0] < batch or tail_slots.shape[1] * rows < g:
        raise ValueError(f"tail_slots [B, N] must cover {batch} sequences and N * {rows} >= {g} rows, "
                         f"got {tuple(tail_slots.shape)}")  # fmt: skip
    if query_start_loc is not None or sink_slots is not None:
        raise ValueError("own tiles kept as block rows ([B, N] tail_slots) are read by decode launches without a sink")
    return rows


def _check_kv(key, value, query, cache) -> None:
    """``key, value``: both ``None``, or both ``[Nq, Hkv, D]`` in fp16/bf16."""
    if key is None and value is None:
        return
    if key is None or value is None:
        raise ValueError("key and value come together")
    check_dtype("key", key)
    want = (query.shape[0], cache.shape[1], query.shape[2])
    if key.shape != want or value.shape != want or value.dtype != key.dtype:
        raise ValueError(f"key and value must both be {list(want)} of one dtype, got {tuple(key.shape)}")


def check_one_tile(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, g: int) -> None:
    """Raise where a sequence's queries span tiles (they need the step's ``key, value``); not while capturing."""
    if seq_lens.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    n = (query_start_loc[1:] - query_start_loc[:-1]).to(seq_lens.device)
    first, last = (seq_lens - n) // g, (seq_lens - 1) // g
    span = (n > 0) & (first != last)
    if bool(span.any()):
        b = int(span.nonzero()[0, 0])
        raise ValueError(
            f"sequence {b}'s queries span tiles {int(first[b])}..{int(last[b])}: pass the step's key and value"
        )


def check_counts(**counts) -> None:
    """Each keyword's value is ``None`` or a positive int (the knobs of :func:`~kvarn.kernels.attention.paged_attention`
    that count)."""
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def per_tile_smooth_knobs(cfg: KVarNConfig, fuse_query, tokens_m) -> tuple:
    """``(fuse_query, tokens_m)`` as launched: per-tile smoothed records take ``(True, False)`` and refuse others."""
    if not cfg.smooth_keys or cfg.seq_smooth:
        return fuse_query, tokens_m
    if fuse_query is False or tokens_m:
        raise ValueError(
            "smooth_keys records need the queries rotated per tile in the attention kernel: "
            f"fuse_query=False and tokens_m=True are not implemented for them (got {fuse_query=}, {tokens_m=})"
        )
    return True, False


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """``out`` of :func:`~kvarn.kernels.attention.paged_attention`, checked: the query's shape, dtype and device, unit
    last stride."""
    if out is None:
        return None
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} on {query.device} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    if out.untyped_storage().data_ptr() == query.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with query (programs read queries while others write out)")
    return out


def check_window(window) -> None:
    """Raise unless ``window`` is ``None`` or a positive int (the keys a query sees, itself included)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or a positive int (keys a query sees, itself included), got {window!r}")


def check_sink_logits(sink_logits: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """``sink_logits`` as the kernels read it (entry ``h`` at ``base + h``): ``None``, or an fp32/fp16/bf16 ``[Hq]``
    tensor on the query's device; a strided one is copied. Raises otherwise."""
    if sink_logits is None:
        return None
    hq = query.shape[1]
    if (
        not isinstance(sink_logits, torch.Tensor)
        or sink_logits.shape != (hq,)
        or sink_logits.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or sink_logits.device != query.device
    ):
        got = (
            f"{tuple(sink_logits.shape)} {sink_logits.dtype} on {sink_logits.device}"
            if isinstance(sink_logits, torch.Tensor)
            else type(sink_logits).__name__
        )
        raise ValueError(
            f"sink_logits must be one fp32, fp16 or bf16 logit per query head, [{hq}] on {query.device}, got {got}"
        )
    return sink_logits if sink_logits.stride(0) == 1 else sink_logits.contiguous()
