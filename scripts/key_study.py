"""Why rotated keys fail on some models: per-layer attention error with only K quantized.

Runs a bundled model (or ``--model PATH``) over 1280 tokens of the bundled text, records every
layer's q, K and V, and quantizes K alone: tokens 128..1023 (seven 128-token tiles; the first
tile stays exact, as the sink does), V and the last 256 tokens exact. The 256 queries at
positions 1024..1279 then attend over it; the figure is the relative L2 error of the attention
output against the exact one, per layer. Methods are configs of ``kvarn.quantize(k, role="key")``
plus ``centered`` (each tile's per-channel mean subtracted before quantizing and added back,
per-tile centering, kept here as an experiment).

    python scripts/key_study.py --model qwen2.5-coder-0.5b --bits 4
"""

from __future__ import annotations

import argparse

import torch

import kvarn
from kvarn.config import KVarNConfig
from kvarn.eval.harness import PROBE, install_probe, prepare_ids
from kvarn.eval.models import load_model

PREFIX, QUERIES, G = 1024, 256, 128
SWITCHES = {
    "kivi": {"rotate": False, "normalize": False},
    "hadrtn": {"normalize": False},
    "kvarn": {},
    "centered": {},
    "smooth": {"smooth_keys": True},
}


def quantized_keys(k: torch.Tensor, method: str, bits: int) -> torch.Tensor:
    """``k: [T, Hkv, D]`` with tokens ``G .. PREFIX`` replaced by their K-only reconstruction."""
    preset = f"kvarn_k{bits}v2_g{G}"
    cfg = KVarNConfig.from_preset(preset, head_dim=k.shape[-1], **SWITCHES[method])
    part = k[G:PREFIX]
    mu = torch.zeros_like(part)
    if method == "centered":
        mu = part.unflatten(0, (-1, G)).mean(1, keepdim=True).half().float().expand(-1, G, -1, -1).flatten(0, 1)
    rec = kvarn.quantize(part - mu, cfg, role="key").dequantize() + mu
    return torch.cat([k[:G], rec, k[PREFIX:]])


def layer_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor) -> float:
    """Relative error of the last QUERIES positions' attention output; q: [Hq, T, D], k, v: [T, Hkv, D]."""
    rep = q.shape[0] // k.shape[1]
    mask = torch.ones(QUERIES, PREFIX + QUERIES, dtype=torch.bool).tril(PREFIX)
    qs = q[None, :, PREFIX:]
    vv = v.transpose(0, 1).repeat_interleave(rep, 0)[None]

    def out(keys):
        kk = keys.transpose(0, 1).repeat_interleave(rep, 0)[None]
        return torch.nn.functional.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask)

    ref = out(k)
    return float((out(k_hat) - ref).norm() / ref.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bits", type=int, default=4, choices=(2, 4))
    p.add_argument("--methods", default=",".join(SWITCHES))
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    install_probe(model)
    ids = prepare_ids(tok, PREFIX, QUERIES)
    PROBE.start(want_qkv=True)
    with torch.no_grad():
        model(ids)
    PROBE.stop()
    methods = args.methods.split(",")
    rows = {m: [] for m in methods}
    for q, k, v in PROBE.tensors():  # q: [Hq, T, D], k, v: [Hkv, T, D]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        for m in methods:
            rows[m].append(layer_error(q, k, v, quantized_keys(k, m, args.bits)))
    print(f"{args.model}, {args.bits}-bit keys (V exact), attention output error per layer")
    print("| method | mean | max | layers 0-7 |")
    print("|---|---|---|---|")
    for m, e in rows.items():
        t = torch.tensor(e)
        first = " ".join(f"{x:.3f}" for x in e[:8])
        print(f"| {m} | {t.mean():.4f} | {t.max():.4f} | {first} |")


if __name__ == "__main__":
    main()
