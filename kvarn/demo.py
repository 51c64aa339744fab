"""``kvarn demo``: quantize a synthetic KV tensor with outlier channels, compare with plain RTN.

The synthetic cache imitates what makes real KV caches hard to quantize: a few key channels with
a large offset and a large spread, and values whose per-token scale is heavy-tailed. For each
preset it prints the record bytes per token, the capacity against fp16, and the relative error
of K, V and of the attention output of random queries, for KVarN, for Hadamard + RTN
(QuaRot-style) and for plain per-channel-K / per-token-V RTN (KIVI-style) at the same bits and
the same bytes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvarn.api import quantize
from kvarn.config import PRESETS, KVarNConfig


def synthetic_kv(
    tokens: int = 1024, heads: int = 8, head_dim: int = 128, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v): [tokens, heads, head_dim]`` fp16: outlier key channels, heavy-tailed value token scales."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, head_dim, generator=g)
    outliers = torch.randperm(head_dim, generator=g)[:4]
    k[..., outliers] = k[..., outliers] * 8 + 20
    k = k * torch.empty(tokens, 1, 1).uniform_(0.8, 1.25, generator=g)
    token_scale = (torch.randn(tokens, 1, 1, generator=g) / torch.rand(tokens, 1, 1, generator=g).sqrt()).abs()
    v = torch.randn(tokens, heads, head_dim, generator=g) * (0.3 + token_scale.clamp(max=8))
    return k.half(), v.half()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal attention of ``q: [Q, H, D]`` over ``k, v: [T, H, D]`` in fp32."""
    s = torch.einsum("qhd,thd->hqt", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("hqt,thd->qhd", torch.softmax(s, -1), v.float())


def run(tokens: int = 1024, seed: int = 0) -> list[dict]:
    """One row per preset and method: bytes per token, capacity vs fp16, K/V/attention error."""
    k, v = synthetic_kv(tokens, seed=seed)
    q = torch.randn(16, k.shape[1], k.shape[2], generator=torch.Generator().manual_seed(seed + 1))
    ref = attention(q, k, v)
    rows = []
    for preset in PRESETS:
        base = KVarNConfig.from_preset(preset, head_dim=k.shape[-1])
        methods = {
            "kvarn": base,
            "had+rtn": dataclasses.replace(base, normalize=False),
            "rtn": dataclasses.replace(base, rotate=False, normalize=False),
        }
        for method, cfg in methods.items():
            qkv = quantize((k, v), cfg)
            k2, v2 = qkv.dequantize()
            rows.append(
                {
                    "preset": preset,
                    "method": method,
                    "bytes_per_token": cfg.bytes_per_token,
                    "capacity_vs_fp16": cfg.capacity_vs_fp16,
                    "k_err": rel_err(k2, k),
                    "v_err": rel_err(v2, v),
                    "attn_err": rel_err(attention(q, k2, v2), ref),
                }
            )
    return rows


ABLATIONS = {
    "kvarn": {},
    "no hadamard": {"rotate": False},
    "no normalize": {"normalize": False},
    "neither (RTN)": {"rotate": False, "normalize": False},
}


def ablation(tokens: int = 1024, seed: int = 0) -> list[dict]:
    """Round-trip error of K and V per preset and stage ablation, on a Gaussian and an outlier cache.

    The Gaussian cache is i.i.d. N(0, 1). The outlier cache puts 4 channels of K and of V at 20x
    the spread of the rest, K's with an offset of 20 as well.
    """
    g = torch.Generator().manual_seed(seed)
    gauss = tuple(torch.randn(tokens, 8, 128, generator=g).half() for _ in range(2))
    k, v = (torch.randn(tokens, 8, 128, generator=g) for _ in range(2))
    chans = torch.randperm(128, generator=g)[:4]
    k[..., chans] = k[..., chans] * 20 + 20
    v[..., chans] = v[..., chans] * 20
    outlier = (k.half(), v.half())
    rows = []
    for preset in PRESETS:
        base = KVarNConfig.from_preset(preset, head_dim=128)
        for name, changes in ABLATIONS.items():
            cfg = dataclasses.replace(base, **changes)
            row = {"preset": preset, "variant": name}
            for data_name, (kk, vv) in (("gauss", gauss), ("outlier", outlier)):
                k2, v2 = quantize((kk, vv), cfg).dequantize()
                row[f"{data_name}_k"] = rel_err(k2, kk)
                row[f"{data_name}_v"] = rel_err(v2, vv)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="kvarn demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens in the synthetic cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.seed)
    print(f"synthetic KV cache: {args.tokens} tokens, 8 KV heads, head_dim 128, fp16, 4 outlier key channels")
    print("relative error = ||x~ - x|| / ||x||; attn = attention output of 16 random queries")
    header = f"{'preset':<17} {'B/token':>8} {'vs fp16':>8}  {'method':<8} {'K err':>7} {'V err':>7} {'attn err':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['preset']:<17} {r['bytes_per_token']:>8.1f} {r['capacity_vs_fp16']:>7.2f}x  {r['method']:<8} "
            f"{r['k_err']:>7.4f} {r['v_err']:>7.4f} {r['attn_err']:>9.4f}"
        )
    print()
    print("round-trip relative error by stage: Gaussian cache, and 4 outlier channels (20x) in K and V")
    header = f"{'preset':<17} {'variant':<14} {'gauss K':>8} {'gauss V':>8} {'outl. K':>8} {'outl. V':>8}"
    print(header)
    print("-" * len(header))
    for r in ablation(args.tokens, args.seed):
        print(
            f"{r['preset']:<17} {r['variant']:<14} {r['gauss_k']:>8.4f} {r['gauss_v']:>8.4f} "
            f"{r['outlier_k']:>8.4f} {r['outlier_v']:>8.4f}"
        )
    return 0
