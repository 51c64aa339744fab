"""The one dispatch point between the reference and the Triton kernels.

Every function takes ``impl="auto" | "reference" | "triton"``. ``"auto"`` picks Triton for CUDA
tensors in fp16 or bf16 (the dtypes the kernels are built for) when the kernels import, and the
reference otherwise (CPU, fp32, or no Triton). Integrations call
these functions only, never a kernel or a reference module directly.

Key smoothing (``KVarNConfig(smooth_keys=True)``): the kernels of :data:`SMOOTH_KERNEL_OPS` implement
it (tested against the reference under the interpreter and on an H200), and ``"auto"`` picks them as
for any format; the other ops run the reference for a smoothed format and refuse ``impl="triton"``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from kvarn import reference

IMPLS = ("auto", "reference", "triton")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.uint8)
"""Dtypes of the deciding tensor for which ``auto`` uses Triton (uint8: the records themselves)."""
REFERENCE_ONLY = frozenset({"prepare", "from_pool", "sequence_smoothing_vector"})
"""Ops with no kernel of their own (cheap elementwise or small-matrix work): every ``impl`` runs the reference."""
FP32_KERNEL_OPS = frozenset({"rotate"})
"""Ops whose kernel ``auto`` also picks for fp32 CUDA tensors (the vectors the cache's readers rotate back)."""
SMOOTH_KERNEL_OPS = frozenset(
    {"encode_records", "store_tiles", "commit_tiles", "decode_records", "paged_attention", "write_record_pages"}
)
"""Ops whose kernels implement ``smooth_keys`` records; for a smoothed format every other op runs the reference."""


@functools.lru_cache(maxsize=1)
def _triton_ops():
    """The Triton implementations keyed by op name, or ``None`` when they cannot be imported."""
    try:
        from kvarn.kernels import OPS
    except ImportError:
        return None
    return OPS


def triton_available() -> bool:
    """Whether the Triton kernels import on this machine."""
    return _triton_ops() is not None


def _interpreting() -> bool:
    """Whether Triton interprets kernels on the CPU (``TRITON_INTERPRET``, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _smoothed(cfg) -> bool:
    """Whether ``cfg`` is a ``smooth_keys`` format (see :data:`SMOOTH_KERNEL_OPS`)."""
    return getattr(cfg, "smooth_keys", False)


def _smoothed_half(half) -> bool:
    """Whether tile half ``half`` is a K half carrying a smoothing vector."""
    return len(half) > 4 and half[4] is not None


def _pick(name: str, impl: str, like: torch.Tensor, smoothed: bool = False) -> Callable:
    """The implementation of op ``name`` for ``impl``, deciding ``auto`` by ``like``'s device and dtype.

    ``smoothed=True`` (a ``smooth_keys`` format): an op outside :data:`SMOOTH_KERNEL_OPS` runs the
    reference under ``auto`` and raises under ``triton``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if name in REFERENCE_ONLY:
        return getattr(reference, name)
    if smoothed and name not in SMOOTH_KERNEL_OPS:
        if impl != "triton":
            return getattr(reference, name)
        raise ValueError(f"impl='triton' asked for {name}, but its kernel does not implement smooth_keys")
    if impl == "triton":
        if like.device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"impl='triton' runs the Triton kernels on CUDA tensors, got {like.device.type} tensors for {name}: "
                "move them to a CUDA device, or pass impl='auto' (the reference off CUDA) or impl='reference' "
                "(TRITON_INTERPRET=1, set before triton is imported, interprets the kernels on the CPU)"
            )
        ops = _triton_ops()
        if ops is None or name not in ops:
            raise RuntimeError(f"impl='triton' asked for {name}, but no Triton kernel for it imports")
        return ops[name]
    fp32_ok = name in FP32_KERNEL_OPS and like.dtype == torch.float32
    if impl == "auto" and like.device.type == "cuda" and (like.dtype in KERNEL_DTYPES or fp32_ok):
        # Triton is not even imported for CPU tensors
        ops = _triton_ops()
        if ops is not None and name in ops:
            return ops[name]
    return getattr(reference, name)


def prepare(x, dtype=None, rotate: bool = True, *, impl: str = "auto") -> torch.Tensor:
    """Sanitize, rotate and round ``x: [..., D]``: the quantizer's input. See :func:`kvarn.reference.prepare`."""
    return _pick("prepare", impl, x)(x, dtype, rotate)


def from_pool(x, *, impl: str = "auto") -> torch.Tensor:
    """``prepare``d (pool-form) ``x: [..., D]`` as fp32 rotated values. See :func:`kvarn.reference.from_pool`."""
    return _pick("from_pool", impl, x)(x)


def pool_exponent(dtype: torch.dtype, head_dim: int) -> int:
    """A pool of ``dtype`` holds rotated values times ``2^-this``. See :func:`kvarn.reference.pool_exponent`."""
    return reference.pool_exponent(dtype, head_dim)


@functools.cache
def _hadamard_on(d: int, device: torch.device) -> torch.Tensor:
    return reference.hadamard_matrix(d, device)


def hadamard_matrix(d: int, device="cpu") -> torch.Tensor:
    """The normalized Hadamard matrix ``H: [d, d]`` fp32, cached per device (no copy per call): do not modify it.

    See :func:`kvarn.reference.hadamard_matrix`."""
    return _hadamard_on(d, torch.device(device))


def rotate(x, *, impl: str = "auto") -> torch.Tensor:
    """``x @ H`` along the last axis (the Hadamard is its own inverse). See :func:`kvarn.reference.rotate`."""
    return _pick("rotate", impl, x)(x)


def write_tail(k, v, tail_k, tail_v, tail_slot_mapping, cfg, *, impl: str = "auto") -> None:
    """Rotate new tokens into the full-precision tile pool. See :func:`kvarn.reference.write_tail`."""
    _pick("write_tail", impl, k)(k, v, tail_k, tail_v, tail_slot_mapping, cfg)


def gather_tail_tiles(rows_k, rows_v, tables, tail_k, tail_v, slots, *, impl: str = "auto") -> None:
    """Copy whole tiles kept as block rows into pool slots. See :func:`kvarn.reference.gather_tail_tiles`."""
    _pick("gather_tail_tiles", impl, tail_k)(rows_k, rows_v, tables, tail_k, tail_v, slots)


def commit_tiles(tail_k, tail_v, tail_slots, block_ids, cache, cfg, smooth_src=None, *, impl: str = "auto") -> None:
    """Quantize full pool tiles into cache records. See :func:`kvarn.reference.commit_tiles`."""
    fn = _pick("commit_tiles", impl, tail_k, _smoothed(cfg))
    fn(tail_k, tail_v, tail_slots, block_ids, cache, cfg, smooth_src)


def store_tiles(k, v, block_ids, cache, cfg, smooth_src=None, *, impl: str = "auto") -> None:
    """Quantize whole model-frame tiles into cache records. See :func:`kvarn.reference.store_tiles`."""
    _pick("store_tiles", impl, k, _smoothed(cfg))(k, v, block_ids, cache, cfg, smooth_src)


def encode_records(k, v, cfg, smooth_vec=None, *, impl: str = "auto") -> torch.Tensor:
    """Prepared tiles to records. See :func:`kvarn.reference.encode_records`.

    A given ``smooth_vec`` runs the reference (the kernel takes each tile's vector from the tile).
    """
    if smooth_vec is not None:
        if impl == "triton":
            raise ValueError("impl='triton' asked for encode_records with smooth_vec, which its kernel does not take")
        return reference.encode_records(k, v, cfg, smooth_vec)
    return _pick("encode_records", impl, k, _smoothed(cfg))(k, v, cfg)


def sequence_smoothing_vector(first_tiles, *, impl: str = "auto") -> torch.Tensor:
    """A sequence's smoothing vector from its first tile. See :func:`kvarn.reference.sequence_smoothing_vector`."""
    return _pick("sequence_smoothing_vector", impl, first_tiles)(first_tiles)


def decode_records(records, cfg, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Records to rotated fp32 K/V tiles. See :func:`kvarn.reference.decode_records`."""
    return _pick("decode_records", impl, records, _smoothed(cfg))(records, cfg)


def _page_dtypes(impl: str, *tensors_or_dtypes) -> str:
    """``impl``, or ``"reference"`` for ``auto`` when a page op's pages or pool are not fp16/bf16 (fp32 pages)."""
    dtypes = [getattr(t, "dtype", t) for t in tensors_or_dtypes if t is not None]
    if impl == "auto" and any(d not in (torch.float16, torch.bfloat16) for d in dtypes):
        return "reference"
    return impl


def write_record_pages(
    cache,
    block_table,
    rows,
    tiles,
    k_pages,
    v_pages,
    cfg,
    tail_k=None,
    tail_v=None,
    sink_slots=None,
    *,
    impl: str = "auto",
) -> None:
    """Record tiles (sinks from their pool slots) into model-frame pages.

    See :func:`kvarn.reference.write_record_pages`.

    ``auto`` runs the kernel for records on CUDA with fp16/bf16 pages (and pool, with sinks).
    """
    impl = _page_dtypes(impl, k_pages, None if sink_slots is None else tail_k)
    fn = _pick("write_record_pages", impl, cache, _smoothed(cfg))
    fn(cache, block_table, rows, tiles, k_pages, v_pages, cfg, tail_k, tail_v, sink_slots)


def write_row_pages(
    k, v, rows, dst, k_pages, v_pages, cfg, from_model, slots=None, pool_dtype=None, *, impl: str = "auto"
) -> None:
    """Model-frame K/V rows (through the pool form) or pool rows into pages.

    See :func:`kvarn.reference.write_row_pages`.

    ``auto`` runs the kernel for CUDA fp16/bf16 sources with fp16/bf16 pages (and ``pool_dtype``).
    """
    impl = _page_dtypes(impl, k_pages, pool_dtype if from_model else None)
    fn = _pick("write_row_pages", impl, k)
    fn(k, v, rows, dst, k_pages, v_pages, cfg, from_model, slots, pool_dtype)


def paged_attention(
    query,
    cache,
    block_table,
    seq_lens,
    tail_k,
    tail_v,
    tail_slots,
    cfg,
    query_start_loc=None,
    sink_slots=None,
    scale=None,
    key=None,
    value=None,
    *,
    out=None,
    window: int | None = None,
    sink_logits: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention over the paged cache under the own-tile rule. See :func:`kvarn.reference.paged_attention`.

    ``key, value``: the step's own K/V, needed where a sequence's queries span tiles. ``out``
    (``[Nq, Hq, D]``, ``query``'s dtype) receives the result and is returned: the kernel writes it
    directly (no copy launch, e.g. into vLLM's output buffer); the reference's result is copied in.
    ``window`` (a query at ``p`` sees keys ``p - window + 1 .. p``; the block-table entries before a
    sequence's first query's window are never read) and ``sink_logits: [Hq]`` (raw logits in the softmax
    denominator only) as in the reference.
    """
    fn = _pick("paged_attention", impl, query, _smoothed(cfg))
    args = (query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, cfg, query_start_loc, sink_slots, scale)
    kv = {} if key is None and value is None else {"key": key, "value": value}
    if window is not None:
        kv["window"] = window
    if sink_logits is not None:
        kv["sink_logits"] = sink_logits
    if out is None:
        return fn(*args, **kv)
    if fn is not reference.paged_attention:
        return fn(*args, **kv, out=out)
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out.copy_(fn(*args, **kv))


def encode_half(tiles, role, cfg, smooth_vec=None, *, impl: str = "auto"):
    """Prepared tiles ``[..., G, D]`` to the K or V half of a record. See :func:`kvarn.reference.encode_half`."""
    if smooth_vec is not None:
        return _pick("encode_half", impl, tiles, True)(tiles, role, cfg, smooth_vec)
    return _pick("encode_half", impl, tiles, _smoothed(cfg))(tiles, role, cfg)


def decode_half(half, role, *, impl: str = "auto") -> torch.Tensor:
    """A tile half back to rotated fp32 tiles ``[..., G, D]``. See :func:`kvarn.reference.decode_half`."""
    return _pick("decode_half", impl, half[0], _smoothed_half(half))(half, role)


def pack_codes(codes, bits, *, impl: str = "auto") -> torch.Tensor:
    """Planar bit packing of codes ``[..., R, C]``. See :func:`kvarn.reference.pack_codes`."""
    return _pick("pack_codes", impl, codes)(codes, bits)


def unpack_codes(packed, bits, *, impl: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack_codes`. See :func:`kvarn.reference.unpack_codes`."""
    return _pick("unpack_codes", impl, packed)(packed, bits)


def input_exponent(x, dtype=None, rotate: bool = True, *, impl: str = "auto") -> torch.Tensor:
    """Per tile ``[..., G, D]``, the power of two that keeps it storable. See :func:`kvarn.reference.input_exponent`."""
    return _pick("input_exponent", impl, x)(x, dtype, rotate)


def scale_half(half, exp, *, impl: str = "auto"):
    """A tile half reconstructing ``2^exp`` times larger. See :func:`kvarn.reference.scale_half`."""
    return _pick("scale_half", impl, half[0], _smoothed_half(half))(half, exp)


def scale_records(records, k_exp, v_exp, cfg, *, impl: str = "auto") -> torch.Tensor:
    """Records reconstructing ``2^k_exp``, ``2^v_exp`` times larger. See :func:`kvarn.reference.scale_records`."""
    return _pick("scale_records", impl, records, _smoothed(cfg))(records, k_exp, v_exp, cfg)
