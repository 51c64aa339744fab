"""Fused Triton kernels for KVarN, one per reference op, with the reference signatures.

Importing this package imports Triton; an ``ImportError`` means "no kernels here" and
:mod:`kvarn.ops` falls back to the reference. ``OPS`` maps each op name to its Triton
implementation; an op missing from it runs the reference.

- :func:`store.write_tail`, :func:`store.commit_tiles`, :func:`store.store_tiles`,
  :func:`store.encode_records`: the store path (Sinkhorn + RTN + packing in one launch);
  :func:`store.gather_tail_tiles`: tiles kept as rows of a cache's blocks copied into pool slots.
- :func:`dequant.decode_records`: records back to rotated fp32 tiles.
- :func:`pages.write_record_pages`, :func:`pages.write_row_pages`: records and K/V rows read back
  as model-frame pages in the attention dtype (a prompt chunk's varlen attention).
- :func:`attention.paged_attention`: decode and multi-query attention over the paged cache.
- :func:`hadamard.rotate`: the Hadamard rotation of vectors read back from the cache.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here means: no kernels on this machine)

from kvarn.kernels.attention import paged_attention
from kvarn.kernels.dequant import decode_records
from kvarn.kernels.hadamard import rotate
from kvarn.kernels.pages import write_record_pages, write_row_pages
from kvarn.kernels.store import commit_tiles, encode_records, gather_tail_tiles, store_tiles, write_tail

OPS = {
    "write_tail": write_tail,
    "gather_tail_tiles": gather_tail_tiles,
    "commit_tiles": commit_tiles,
    "store_tiles": store_tiles,
    "encode_records": encode_records,
    "decode_records": decode_records,
    "paged_attention": paged_attention,
    "write_record_pages": write_record_pages,
    "write_row_pages": write_row_pages,
    "rotate": rotate,
}

__all__ = [
    "OPS",
    "commit_tiles",
    "decode_records",
    "encode_records",
    "gather_tail_tiles",
    "paged_attention",
    "rotate",
    "store_tiles",
    "write_record_pages",
    "write_row_pages",
    "write_tail",
]
