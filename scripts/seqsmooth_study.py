"""Per-SEQUENCE key smoothing, measured through the `kvarn report` harness without editing the library.

An experiment (issue 10, 2026-11-30; results in ``docs/fidelity.md``, "One smoothing vector per
sequence"), not a feature: it monkeypatches the reference, and a real implementation would store
``s_seq`` once per sequence and rotate the query once per step.

Method names (any KVarN preset after the family):
  seqsmooth_<preset>     s_seq = smoothing_vector(tile 0 of the sequence), every tile (tile 0 too) divided by it
  seqsmooth1_<preset>    the same, tile 0's first token (BOS / attention sink) left out of the std
  seqsmooth4_<preset>    the same, tile 0's first 4 tokens left out
  seqones_<preset>       s forced to 1 (check only: must match kvarn_<preset> up to fp32 round-off)
plus every library method (kvarn_*, kivi_*, smooth_*, ...).

How: the seq* families are registered in kvarn.eval.methods.FAMILIES with smooth_keys=True, so they
use the smooth_* record layout (s stored in every record; a real implementation would store it once
per sequence: its bits/elem here include D bytes per record). kvarn.reference.record.smoothing_vector
(the only place encode_half gets s from) is replaced by a function that, while a seq* method runs,
returns the sequence's s_seq instead of the tile's own s:
  - cache path (KVarNCache, batch 1): KVarNLayer.update is wrapped to say which layer is storing; the
    first tile a layer encodes (asserted to be tile 0: the update starts at position 0 and encodes one
    tile) fixes that layer's s_seq [Hkv, D], kept on the layer object (survives deepcopy).
  - static path (Method.roundtrip -> kvarn.quantize on a whole sequence [T, Hkv, D]): tiles arrive as
    [M, Hkv, G, D] in sequence order; s_seq comes from tiles[0].
Decoding is unchanged (it multiplies by the s stored in each record).

Run:  OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/seqsmooth_study.py \
          --model smollm2-135m --regions sink --methods seqsmooth_k4v2_g128,... --out x.json
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import sys
import time

import torch

import kvarn.reference.record as record
from kvarn.eval import methods as methods_mod
from kvarn.integration import hf

ORIG_SMOOTHING_VECTOR = record.smoothing_vector
SKIP: int | str | None = None
"""None: library behaviour (per-tile s). int n: per-sequence s from tile 0 without its first n tokens. "ones": s = 1."""
VARIANTS = {"seqsmooth": 0, "seqsmooth1": 1, "seqsmooth4": 4, "seqones": "ones"}
for fam in VARIANTS:
    methods_mod.FAMILIES[fam] = (f"KVarN + per-sequence key smoothing ({fam})", {"smooth_keys": True})

CURRENT: contextvars.ContextVar = contextvars.ContextVar("seqsmooth_layer", default=None)
STATS = {"cache_calls": 0, "static_calls": 0, "seq_vectors": 0}


def seq_vector(tile0: torch.Tensor) -> torch.Tensor:
    """s_seq of rotated tile(s) 0 ``[..., G, D]`` -> ``[..., D]`` for the current variant."""
    if SKIP == "ones":
        return torch.ones(tile0.shape[:-2] + tile0.shape[-1:], dtype=torch.float32, device=tile0.device)
    return ORIG_SMOOTHING_VECTOR(tile0[..., SKIP:, :])


def patched_smoothing_vector(tiles: torch.Tensor) -> torch.Tensor:
    if SKIP is None:
        return ORIG_SMOOTHING_VECTOR(tiles)
    d = tiles.shape[-1]
    out_shape = (*tiles.shape[:-2], d)
    layer = CURRENT.get()
    if layer is None:  # static path: [M, Hkv, G, D], the sequence's tiles in order
        assert tiles.dim() == 4, tiles.shape
        STATS["static_calls"] += 1
        return seq_vector(tiles[:1]).expand(out_shape).contiguous()
    STATS["cache_calls"] += 1
    assert tiles.dim() == 4 and layer.batch_size == 1, (tiles.shape, layer.batch_size)
    s = getattr(layer, "_seq_s", None)
    if s is None:
        # the first tile this layer encodes must be the sequence's tile 0
        assert layer._seq_past == 0 and tiles.shape[0] == 1, (layer._seq_past, tiles.shape)
        s = layer._seq_s = seq_vector(tiles[:1])  # [1, Hkv, D]
        STATS["seq_vectors"] += 1
    return s.expand(out_shape).contiguous()


record.smoothing_vector = patched_smoothing_vector
_ORIG_UPDATE = hf.KVarNLayer.update
_ORIG_RESET = hf.KVarNLayer.reset


def _update(self, key_states, value_states, *args, **kwargs):
    self._seq_past = self.length
    token = CURRENT.set(self)
    try:
        return _ORIG_UPDATE(self, key_states, value_states, *args, **kwargs)
    finally:
        CURRENT.reset(token)


def _reset(self):
    self._seq_s = None
    return _ORIG_RESET(self)


hf.KVarNLayer.update = _update
hf.KVarNLayer.reset = _reset


def set_variant(method_name: str) -> None:
    global SKIP
    fam = method_name.partition("_")[0]
    SKIP = VARIANTS.get(fam)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--methods", required=True)
    p.add_argument("--regions", default="sink")
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--greedy", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    from kvarn.eval.harness import install_probe, prepare_ids, reference_run, run_method
    from kvarn.eval.methods import get_method
    from kvarn.eval.models import load_model

    model, tok = load_model(args.model)
    ids = prepare_ids(tok, args.prefix, args.continuation)
    install_probe(model)
    out = {
        "model": args.model,
        "prefix": args.prefix,
        "continuation": args.continuation,
        "greedy": args.greedy,
        "command": " ".join(sys.argv),
        "results": [],
    }
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = reference_run(model, ids, args.prefix, args.greedy)
        out["reference"] = {"ppl": ref.ppl, "seconds": ref.seconds}
        print(f"{args.model}: reference ppl {ref.ppl:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for region in args.regions.split(","):
            for name in args.methods.split(","):
                set_variant(name)
                before = dict(STATS)
                r = run_method(model, ids, args.prefix, get_method(name), region, ref, args.greedy)
                set_variant("")
                d = r.__dict__
                d["static_mean"] = float(
                    sum(sum(row[1:]) / max(len(row) - 1, 1) for row in r.attn_static) / len(r.attn_static)
                )
                d["accum_mean"] = float(
                    sum(sum(row[1:]) / max(len(row) - 1, 1) for row in r.attn_accum) / len(r.attn_accum)
                )
                d["patch_calls"] = {k: STATS[k] - before[k] for k in STATS}
                out["results"].append(d)
                print(
                    f"{args.model} | {region} | {name} | KL {r.kl:.4f} | top1 {100 * r.top1:.1f}% | ppl {r.ppl:.3f} | "
                    f"bits {r.bits_per_element:.3f} | attn static {d['static_mean']:.4f} accum {d['accum_mean']:.4f} | "
                    f"{r.seconds:.0f}s | calls {d['patch_calls']}",
                    flush=True,
                )
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
