"""The paged KVarN cache below the integrations: the tile lifecycle and one layer's storage.

Both integrations (the vLLM backend and the transformers cache) are adapters over this package;
it imports neither vLLM nor transformers. Per step, an integration hands over ragged chunks of new
tokens, each sequence's length after the step and its block table (one block is one tile of ``G``
tokens); a planner decides where each token goes, and each layer's :class:`PagedKV` carries that
out through :mod:`kvarn.ops`:

- :mod:`kvarn.paged.plan`: which tiles a step fills (:class:`TilePlanner`, :class:`TilePlan`),
  the tail and sink slots that hold incomplete and first tiles in full precision.
- :mod:`kvarn.paged.slots`: plans for callers that name each request's slot
  (:func:`plan_request_slots`), and tails kept in the cache's own blocks (:func:`tail_rows`,
  :func:`block_tails`).
- :mod:`kvarn.paged.storage`: :class:`PagedKV`, one layer's records and pool, and its attention.
- :mod:`kvarn.paged.prefill`: prompt chunks attended through one varlen call over pages.
- :mod:`kvarn.paged.transfer`: host index arrays to the device, aligned for Triton.
"""

from kvarn.paged.plan import SinkLostError, SinkSlots, TailLostError, TilePlan, TilePlanner
from kvarn.paged.prefill import (
    PREFILL_MIN_QUERIES,
    PREFILL_READ_TOKENS,
    PagedChunks,
    PageLayout,
    PrefillSplit,
    VarlenAttention,
    sdpa_varlen,
    split_prefill,
)
from kvarn.paged.slots import BlockTails, TailRows, block_tails, plan_request_slots, tail_geometry, tail_rows
from kvarn.paged.storage import PagedKV
from kvarn.paged.transfer import to_device_aligned

__all__ = [
    "PREFILL_MIN_QUERIES",
    "PREFILL_READ_TOKENS",
    "BlockTails",
    "PageLayout",
    "PagedChunks",
    "PagedKV",
    "PrefillSplit",
    "SinkLostError",
    "SinkSlots",
    "TailLostError",
    "TailRows",
    "TilePlan",
    "TilePlanner",
    "VarlenAttention",
    "block_tails",
    "plan_request_slots",
    "sdpa_varlen",
    "split_prefill",
    "tail_geometry",
    "tail_rows",
    "to_device_aligned",
]
