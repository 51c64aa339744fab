"""Readable pure-PyTorch KVarN: the specification and the oracle.

One module per stage, in pipeline order: :mod:`tiling`, :mod:`hadamard`, :mod:`normalize`,
:mod:`rtn`, :mod:`packing`, :mod:`dequant`; :mod:`quantize` composes them for one tile half,
:mod:`record` lays K and V out as cache records, :mod:`cache` stores into and gathers from the
paged cache, :mod:`attention` attends over it, :mod:`pages` reads records and rows back as
model-frame pages for a varlen attention call.
"""

from kvarn.reference.attention import attend, paged_attention
from kvarn.reference.cache import (
    commit_tiles,
    gather_tail_tiles,
    gather_tiles,
    store_tiles,
    tail_tiles,
    write_tail,
)
from kvarn.reference.dequant import dequantize_rows
from kvarn.reference.hadamard import hadamard_matrix, rotate
from kvarn.reference.normalize import imbalance, sinkhorn
from kvarn.reference.packing import pack_codes, unpack_codes
from kvarn.reference.pages import records_to_pages, rows_to_pages, write_record_pages, write_row_pages
from kvarn.reference.quantize import (
    TileHalf,
    dequantize_half,
    from_pool,
    input_exponent,
    pool_exponent,
    prepare,
    quantize_half,
    scale_half,
)
from kvarn.reference.record import (
    decode_half,
    decode_records,
    encode_half,
    encode_records,
    pack_record,
    scale_records,
    unpack_record,
)
from kvarn.reference.rtn import choose_qparams, clip_shrinks, quantize_rows
from kvarn.reference.smooth import sequence_smoothing_vector, smoothing_vector
from kvarn.reference.tiling import merge_tiles, split_tiles

__all__ = [
    "TileHalf",
    "attend",
    "choose_qparams",
    "clip_shrinks",
    "commit_tiles",
    "decode_half",
    "decode_records",
    "dequantize_half",
    "dequantize_rows",
    "encode_half",
    "encode_records",
    "from_pool",
    "gather_tail_tiles",
    "gather_tiles",
    "hadamard_matrix",
    "imbalance",
    "input_exponent",
    "merge_tiles",
    "pack_codes",
    "pack_record",
    "paged_attention",
    "pool_exponent",
    "prepare",
    "quantize_half",
    "quantize_rows",
    "records_to_pages",
    "rotate",
    "rows_to_pages",
    "scale_half",
    "scale_records",
    "sequence_smoothing_vector",
    "sinkhorn",
    "smoothing_vector",
    "split_tiles",
    "store_tiles",
    "tail_tiles",
    "unpack_codes",
    "unpack_record",
    "write_record_pages",
    "write_row_pages",
    "write_tail",
]
