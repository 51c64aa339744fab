"""What a query sees of its own tile: the report's protocol against the paged path vLLM uses.

``kvarn report``'s protocol (and ``generate()`` with :class:`~kvarn.integration.hf.KVarNCache`) lets a
token see the tile it belongs to in full precision: earlier tiles come from the records, the own tile
from the chunk's exact K/V or the tail. vLLM's prefill attends through
``kvarn.reference.paged_attention`` with several queries per sequence, under the own-tile rule (the
tiles before a query's own from the records, its own tile in full precision); reading every *complete*
tile from its record instead, the query's own included, gives 2.6x the report's KL at k4v2 on SmolLM2.
This script measures the three ways on SmolLM2-135M with the sink
(tile 0 in full precision either way), KL of the next-token distributions over ``CONT`` positions
after a ``PREFIX``-token prefix, against the exact run (fp32, ``DynamicCache``):

- ``report protocol``: prefix fed in 128-token chunks through the dequantizing cache (``paged=False``:
  a chunk sees earlier tiles read back and itself exactly), then one token at a time;
- ``paged prompt, then decode``: the same feeding through the paged cache (``paged=True``,
  ``attn_implementation="kvarn"``, the attention a vLLM prompt gets), the continuation one token at a
  time (decode, as vLLM generates);
- ``paged, every position in chunks``: prefix and continuation in 128-token chunks through the paged
  cache: what vLLM's teacher-forced figure (``prompt_logprobs``) measures.

Under the own-tile rule the three agree up to the order of the arithmetic.

    PYTHONPATH=. python scripts/own_tile_study.py [PRESET ...]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvarn.eval.harness import prepare_ids
from kvarn.eval.models import load_model
from kvarn.integration.hf import KVarNCache, register_kvarn_attention

PREFIX, CONT, G = 1024, 128, 128


def main(presets: list[str]) -> None:
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m")
    ids = prepare_ids(tok, PREFIX, CONT)
    n = ids.shape[1]
    register_kvarn_attention()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = F.log_softmax(model(ids, past_key_values=DynamicCache()).logits[0, PREFIX - 1 : n - 1], -1)

        def run(preset: str, paged: bool, decode_continuation: bool) -> tuple[float, float]:
            model.set_attn_implementation("kvarn" if paged else "sdpa")
            cache = KVarNCache(preset, sink=True, dtype=torch.float16, paged=paged)
            end = PREFIX if decode_continuation else n
            logits = [model(ids[:, lo : min(lo + G, end)], past_key_values=cache).logits[0] for lo in range(0, end, G)]
            if decode_continuation:
                logits += [model(ids[:, i : i + 1], past_key_values=cache).logits[0] for i in range(PREFIX, n)]
            lp = F.log_softmax(torch.cat(logits)[PREFIX - 1 : n - 1], -1)
            kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
            return kl, float((lp.argmax(-1) == ref.argmax(-1)).float().mean())

        print("| preset | report protocol | paged prompt, then decode | paged, every position in chunks |")
        print("|---|---|---|---|")
        for preset in presets:
            cells = [run(preset, False, True), run(preset, True, True), run(preset, True, False)]
            print(f"| {preset} | " + " | ".join(f"{kl:.4f} ({100 * t:.1f}%)" for kl, t in cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g128"])
