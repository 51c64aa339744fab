"""``attn_implementation="kvarn"``: paged attention over a ``KVarNCache(paged=True)``, and the mask function
that lets the cache see the batch's padding.

The layers and this attention function meet through context variables: a paged layer's ``update``
leaves itself in :data:`ATTENDING`, and the attention function takes it when handed the key tensor
that ``update`` returned; the ``kvarn`` mask function leaves the padding mask in :data:`MASKED` for
the next new step of the batch (:class:`~kvarn.integration.hf.batch.Sequences`).
"""

from __future__ import annotations

import contextvars

import torch

ATTENTION_NAME = "kvarn"

ATTENDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("kvarn_attending", default=None)
"""``(layer, key)``: the paged layer whose ``update`` ran last in this context and the key tensor it
returned; the ``kvarn`` attention function takes the layer when it is handed that same key."""
MASKED: contextvars.ContextVar[torch.Tensor | str | None] = contextvars.ContextVar("kvarn_padding", default=None)
"""What the ``kvarn`` mask function saw in this forward: the ``[B, kv_len]`` padding mask (True = real
token), or :data:`UNPADDED` when transformers built the mask without one; taken by the next new step."""
UNPADDED = "unpadded"


def kvarn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``attn_implementation="kvarn"`` attention function: paged attention over a ``KVarNCache(paged=True)``.

    ``query: [B, Hq, n, D]`` -> ``([B, n, Hq, D], None)``. The prompt chunk runs transformers' SDPA
    over its exact K/V; later chunks read the cache through :meth:`kvarn.paged.PagedKV.attend`, within the
    layer's sliding window where it has one (``module.sliding_window``, as transformers passes it). Learned
    attention sinks (``s_aux``) are refused.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("s_aux") is not None:  # transformers' SDPA, which the prompt chunk runs, would drop them
        raise ValueError(
            "attn_implementation='kvarn' does not apply learned attention sinks (s_aux, as GPT-OSS passes them); "
            "use KVarNCache(paged=False) with the model's own attention implementation"
        )
    entry = ATTENDING.get()
    ATTENDING.set(None)
    layer = entry[0] if entry is not None and entry[1] is key else None
    if layer is None:
        raise RuntimeError(
            "attn_implementation='kvarn' needs past_key_values=KVarNCache(..., paged=True); "
            "with another cache use attn_implementation='sdpa'"
        )
    layer.saw_kvarn_attention = True
    if layer.first_chunk or not layer.quantized:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
        if layer.quantized:
            layer.finish_step()
        return out
    # transformers builds the window into the mask, which the paged read does not take: hand the window over
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return layer.attend(query, scaling, window), None


def register_kvarn_attention() -> str:
    """Register ``"kvarn"`` with transformers' attention and mask interfaces; returns the name.

    Then ``model.set_attn_implementation("kvarn")`` (or ``from_pretrained(...,
    attn_implementation="kvarn")``) and ``past_key_values=KVarNCache(paged=True)``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def kvarn_mask(*args, **kwargs):
        """transformers' SDPA mask, after recording the padding mask for :class:`KVarNCache`."""
        padding = kwargs.get("attention_mask")
        MASKED.set(padding if isinstance(padding, torch.Tensor) and padding.dim() == 2 else UNPADDED)
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, kvarn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvarn_mask)
    return ATTENTION_NAME
