"""A transformers cache that stores KVarN records: ``model.generate(..., past_key_values=KVarNCache())``.

An adapter over :mod:`kvarn.paged`, like the vLLM backend: the batch's rows are a
:class:`~kvarn.integration.hf.batch.DenseBatch` (which plans each step once for all layers, tile
``i`` of row ``b`` in block ``i * B + b``), and each layer keeps a :class:`~kvarn.paged.PagedKV`
(records plus the full-precision tail and sink pool). This package finds the batch's padding, moves
tensors between the model and those objects, and holds no math: no rotation, no tile commits, no
sink handling of its own. Modules: :mod:`~kvarn.integration.hf.cache` (:class:`KVarNCache`),
:mod:`~kvarn.integration.hf.layers` (one layer each), :mod:`~kvarn.integration.hf.batch` (the
batch's rows and padding), :mod:`~kvarn.integration.hf.attention` (``attn_implementation="kvarn"``).

Two ways to attend:

- ``paged=False`` (default, any ``attn_implementation``): :meth:`KVarNLayer.update` returns the
  history read back from the cache (:meth:`~kvarn.paged.PagedKV.read_tiles`, in the model frame
  and dtype), followed by the chunk's own K/V exactly as the model computed them.
- ``paged=True`` with ``attn_implementation="kvarn"`` (see :func:`register_kvarn_attention`):
  attention reads the records directly (:meth:`~kvarn.paged.PagedKV.attend`: Triton on CUDA, the
  reference elsewhere) under the own-tile rule: the tiles before a query's own from the records,
  its own tile in full precision (the tail slot the step started in, then the chunk's K/V).

In both modes the first chunk of a sequence (the prompt) attends over its exact K/V (it has no
history, and seeing all of itself exactly is at least what the own-tile rule gives). A later
chunk in the first mode sees all of itself exactly (and the history's partial tile from its tail
slot); in the second it follows the own-tile rule, as vLLM does. The two agree wherever a later
chunk stays inside one tile (decoding) or is made of whole tiles.

Left-padded batches: each row's tiles start at its first real token, so a row's records do not
depend on how much padding it got. Where the padding comes from, first found wins:

1. ``position_ids`` passed down to ``update`` (newer transformers pass the attention's keyword
   arguments to the cache; a row's real length is its last position + 1);
2. ``KVarNCache(..., attention_mask=mask)``, the prompt's ``[B, T]`` mask as given to ``generate``
   (with ``num_beams`` it is repeated for each beam, as ``generate`` repeats the inputs);
3. with ``attn_implementation="kvarn"``, the padding mask transformers builds the attention mask
   from (the ``kvarn`` mask function records it).

Padding must be on the left, as transformers requires for generation. A batch of more than one
row with none of these is taken as unpadded, with a warning unless padding cannot hide in it: rows
that are copies of one prompt (its beams), or one row of position ids shared by every row.
"""

from kvarn.integration.hf.attention import ATTENTION_NAME, kvarn_attention, register_kvarn_attention
from kvarn.integration.hf.batch import BatchStep, DenseBatch
from kvarn.integration.hf.cache import KVarNCache
from kvarn.integration.hf.layers import FullPrecisionLayer, KVarNLayer

__all__ = [
    "ATTENTION_NAME",
    "BatchStep",
    "DenseBatch",
    "FullPrecisionLayer",
    "KVarNCache",
    "KVarNLayer",
    "kvarn_attention",
    "register_kvarn_attention",
]
