"""The transformers ``Cache`` that stores KVarN records: one layer object per attention layer, one batch for all."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvarn import ops
from kvarn.config import DEFAULT_PRESET, KVarNConfig, LayerPolicy, check_preset
from kvarn.integration.hf.batch import Sequences
from kvarn.integration.hf.layers import STORE_DTYPE_NAMES, STORE_DTYPES, FullPrecisionLayer, KVarNLayer


class KVarNCache(Cache):
    """A transformers ``Cache`` holding KVarN records, a full-precision tail and an optional sink.

    Args:
        preset: a preset name (default ``kvarn_k4v2_g128``) or a :class:`~kvarn.KVarNConfig`
            (its ``head_dim`` is replaced by the model's).
        sink: keep a full-precision copy of each sequence's first tile and attend over it.
        dtype: dtype K/V are rounded to before storing (tail pool, and the input of the
            quantizer): ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``; default the
            model's. ``torch.float16`` on an fp32 CPU model mirrors an fp16 deployment.
        max_cache_len: preallocate records for this many tokens (otherwise they grow tile by tile).
        paged: attend through :meth:`kvarn.paged.PagedKV.attend`; needs
            ``attn_implementation="kvarn"`` (:func:`register_kvarn_attention`).
        impl: ``"auto" | "reference" | "triton"``, passed to every :mod:`kvarn.ops` call.
        keep_decoded: keep what each layer attends over (its history read back, in the model's
            dtype) from step to step, reading back only what a step changed (its tokens, the tiles it
            completed), instead of decoding every record at every step: a speed aid for evaluation,
            with the same outputs, but the copy costs an unquantized cache's memory; it is counted
            under ``"decoded"`` in :meth:`nbytes`.
        attention_mask: the prompt's ``[B, T]`` attention mask (as given to ``generate``) for a
            left-padded batch, so that each row's tiles start at its first real token. With
            ``num_beams`` (or ``num_return_sequences``) each row serves its prompt's beams, as
            ``generate`` repeats the inputs. Needed only where transformers passes no position ids
            to the cache and the attention is not ``"kvarn"`` (see :mod:`kvarn.integration.hf`).
        layer_policy: a :class:`~kvarn.config.LayerPolicy` keeping some layers (e.g. the first and
            the last) unquantized in ``dtype`` or at another preset of the same tile length.
        num_layers: the model's attention layer count (``model.config.num_hidden_layers``); needed
            when ``layer_policy`` counts layers from the end, checked against the layers seen.

    Example:
        >>> from kvarn.integration.hf import KVarNCache
        >>> out = model.generate(ids, max_new_tokens=32, past_key_values=KVarNCache())  # doctest: +SKIP
        >>> policy = LayerPolicy(first=1, last=1)  # layers 0 and L-1 unquantized
        >>> n = model.config.num_hidden_layers  # doctest: +SKIP
        >>> cache = KVarNCache("kvarn_k2v2_g128", layer_policy=policy, num_layers=n)  # doctest: +SKIP
    """

    def __init__(
        self,
        preset: str | KVarNConfig = DEFAULT_PRESET,
        *,
        sink: bool = False,
        dtype: torch.dtype | None = None,
        max_cache_len: int | None = None,
        paged: bool = False,
        impl: str = "auto",
        keep_decoded: bool = False,
        attention_mask: torch.Tensor | None = None,
        layer_policy: LayerPolicy | None = None,
        num_layers: int | None = None,
    ):
        if impl not in ops.IMPLS:
            raise ValueError(f"impl must be one of {ops.IMPLS}, got {impl!r}")
        if dtype is not None and dtype not in STORE_DTYPES:
            raise ValueError(
                f"dtype must be {STORE_DTYPE_NAMES} (what the full-precision pool holds), or None for the "
                f"model's dtype; got {dtype}"
            )
        check_preset(preset)
        if layer_policy is not None and not isinstance(layer_policy, LayerPolicy):
            raise TypeError(f"layer_policy must be a kvarn.config.LayerPolicy, got {type(layer_policy).__name__}")
        self.preset, self.sink, self.paged = preset, sink, paged
        self.layer_policy, self.num_layers = layer_policy, num_layers
        kept, kept_preset = (), None
        if layer_policy is not None:
            kept = layer_policy.kept(num_layers)
            kept_preset = layer_policy.kept_config(KVarNConfig.from_preset(preset))
        self._sequences = Sequences(sink, attention_mask)
        kwargs = {
            "dtype": dtype,
            "max_cache_len": max_cache_len,
            "paged": paged,
            "impl": impl,
            "keep_decoded": keep_decoded,
        }

        def make_layer() -> CacheLayerMixin:
            index = len(self.layers)  # transformers appends layers in order, each when first updated
            if num_layers is not None and index >= num_layers:
                raise ValueError(f"KVarNCache(num_layers={num_layers}) got an update for layer {index}")
            if index not in kept:
                return KVarNLayer(self._sequences, preset, **kwargs)
            if kept_preset is None:
                return FullPrecisionLayer(dtype=dtype, paged=paged)
            return KVarNLayer(self._sequences, kept_preset, **kwargs)

        super().__init__(layer_class_to_replicate=make_layer)

    def reset(self) -> None:
        super().reset()
        self._sequences.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        moves = self._sequences.rows.reorder(beam_idx.tolist())
        for layer in self.layers:
            layer.reorder_rows(beam_idx, moves)

    def nbytes(self) -> dict[str, int]:
        """Bytes held by all layers: ``records``, ``tail``, ``sink``, ``decoded``, ``full_precision`` (the layers a
        :class:`~kvarn.config.LayerPolicy` keeps unquantized) and ``total``."""
        out = {"records": 0, "tail": 0, "sink": 0, "decoded": 0, "full_precision": 0}
        for layer in self.layers:
            for key, value in layer.nbytes().items():
                out[key] += value
        out["total"] = sum(out.values())
        return out

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 ``DynamicCache`` holding the same real tokens would take (2 bytes per K and V element)."""
        tokens = sum(self._sequences.rows.real)
        if not any(layer.quantized for layer in self.layers if layer.is_initialized):  # a policy keeping every layer
            tokens = sum(layer.batch_size * layer.length for layer in self.layers[:1] if layer.is_initialized)
        return sum(2 * 2 * layer.num_heads * tokens * layer.head_dim for layer in self.layers if layer.is_initialized)

    def memory_report(self) -> dict[str, float]:
        """What the cache holds against an fp16 cache of the same tokens.

        ``nbytes()`` (allocated bytes) plus ``fp16_bytes``, ``capacity_vs_fp16`` (fp16 bytes / bytes
        held: pools included, so short sequences, whose tail slot is mostly empty, score low),
        ``tail_used`` (bytes of the tokens the tail slots hold now) and ``records_vs_fp16`` (fp16
        bytes of the committed tokens / their record bytes: the ratio a long sequence tends to).
        """
        out: dict[str, float] = dict(self.nbytes())
        out["fp16_bytes"] = self.fp16_nbytes()
        out["capacity_vs_fp16"] = out["fp16_bytes"] / out["total"] if out["total"] else float("nan")
        real, committed, used, record = self._sequences.rows.real, 0, 0, 0
        for layer in self.layers:
            if layer.is_initialized and layer.quantized:
                g, per_token = layer.cfg.group_size, layer.num_heads * layer.cfg.head_dim
                committed += sum(r // g * g for r in real) * 2 * 2 * per_token
                used += sum(r % g for r in real) * 2 * per_token * layer.kv.tail_k.element_size()
                record += sum(r // g for r in real) * layer.num_heads * layer.cfg.record_bytes
        out["tail_used"] = used
        out["records_vs_fp16"] = committed / record if record else float("nan")
        return out
