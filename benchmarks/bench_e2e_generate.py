"""End-to-end decode throughput of a transformers model: fp16 DynamicCache vs KVarNCache.

Qwen3-8B shapes (36 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128) with random fp16
weights (no weights reach the device machine), 16K tokens of context per sequence, one new token
per sequence per step. Two comparisons:

(a) equal batch: the same batch for both caches;
(b) equal KV memory: fp16 at batch ``B``, KVarN at the largest batch whose cache fits in the bytes
    the fp16 cache uses (the target: >= 3x the fp16 tokens/s).

The context is written straight into the caches (random K/V through ``cache.update``, the same
store path a prefill takes) instead of running a 16K prefill; the timed part is the decode steps
through the whole model. The KVarN cache attends through ``attn_implementation="kvarn"``
(:func:`kvarn.ops.paged_attention`: the Triton kernel when it imports, the reference otherwise).

A tiny-size self-check runs first (paged vs dequantizing KVarN path on the same stored context,
KVarN vs fp16 logits); the benchmark refuses to report if it fails.

Run on the device machine: ``PYTHONPATH=. python benchmarks/bench_e2e_generate.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import platform
import subprocess
import sys
import time

import torch

QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TINY = {**QWEN3_8B, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "vocab_size": 1024}


def build_model(shape: dict, attn: str, device: str):
    import transformers

    cfg = transformers.Qwen3Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.float16)
    model.set_attn_implementation(attn)
    return model.eval()


def fill(cache, shape: dict, batch: int, context: int, device: str, chunk: int = 2048) -> None:
    """Write ``context`` random-but-structured K/V tokens per sequence into every layer of ``cache``."""
    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(1)
    bias = torch.randn(1, hkv, 1, d, device=device, generator=g, dtype=torch.float16) * 2  # outlier channels
    for layer in range(shape["num_hidden_layers"]):
        for a in range(0, context, chunk):
            n = min(chunk, context - a)
            k = torch.randn(batch, hkv, n, d, device=device, generator=g, dtype=torch.float16) + bias
            v = torch.randn(batch, hkv, n, d, device=device, generator=g, dtype=torch.float16)
            cache.update(k, v, layer)
            del k, v


def make_cache(kind: str, shape: dict, context: int, steps: int, sink: bool = True):
    import transformers

    from kvarn.integration.hf import KVarNCache

    if kind == "fp16":
        return transformers.DynamicCache()
    return KVarNCache("kvarn_k4v2_g128", sink=sink, paged=kind == "kvarn", max_cache_len=context + steps + 8)


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes()["total"])
    return sum(layer.keys.numel() * 2 * layer.keys.element_size() for layer in cache.layers)


def decode(model, cache, batch: int, steps: int, device: str, warmup: int = 2) -> tuple[float, torch.Tensor]:
    """Seconds per greedy decode step (after ``warmup``) and the logits of the first step."""
    tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    first = None
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        first = logits if first is None else first
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times), first


def self_check(device: str) -> dict:
    """Tiny model: paged vs dequantizing KVarN paths agree, KVarN logits track fp16 logits."""
    from kvarn.integration.hf import register_kvarn_attention

    register_kvarn_attention()
    context, batch = 640, 2
    out = {}
    for kind, attn in (("fp16", "sdpa"), ("kvarn", "kvarn"), ("kvarn_dequant", "sdpa")):
        model = build_model(TINY, attn, device)
        cache = make_cache(kind, TINY, context, 8)
        fill(cache, TINY, batch, context, device, chunk=256)
        with torch.inference_mode():
            _, logits = decode(model, cache, batch, 3, device, warmup=0)
        out[kind] = logits.float()
    paged_vs_dequant = float((out["kvarn"] - out["kvarn_dequant"]).abs().max() / out["kvarn_dequant"].abs().max())
    corr = float(torch.corrcoef(torch.stack([out["kvarn"].flatten(), out["fp16"].flatten()]))[0, 1])
    ok = paged_vs_dequant < 2e-2 and corr > 0.5 and bool(torch.isfinite(out["kvarn"]).all())
    return {"paged_vs_dequant_rel": paged_vs_dequant, "kvarn_vs_fp16_corr": corr, "ok": ok}


def run_case(kind: str, batch: int, args, device: str) -> dict:
    attn = "kvarn" if kind == "kvarn" else "sdpa"
    row = {"cache": kind, "batch": batch, "context": args.context}
    model = cache = None
    try:
        model = build_model(QWEN3_8B, attn, device)
        cache = make_cache(kind, QWEN3_8B, args.context, args.steps + 2)
        fill(cache, QWEN3_8B, batch, args.context, device)
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            sec, _ = decode(model, cache, batch, args.steps, device)
        row.update(
            step_ms=1e3 * sec,
            tokens_per_s=batch / sec,
            kv_gib=cache_bytes(cache) / 2**30,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        )
    except torch.OutOfMemoryError as e:
        row["error"] = f"OOM: {str(e).splitlines()[0]}"
    finally:
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def kvarn_bytes_per_seq(shape: dict, context: int, sink: bool = True) -> int:
    from kvarn.config import KVarNConfig

    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=shape["head_dim"])
    hkv, layers = shape["num_key_value_heads"], shape["num_hidden_layers"]
    records = (context // cfg.group_size) * hkv * cfg.record_bytes
    pool = (2 if sink else 1) * 2 * cfg.group_size * hkv * cfg.head_dim * 2
    return layers * (records + pool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out", help="folder for results.json and results.md")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16, help="fp16 batch (and the equal-batch case)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--kv-budget-gib", type=float, default=90.0, help="cap on any cache's bytes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_e2e_generate needs a CUDA device", file=sys.stderr)
        return 2
    device = "cuda"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    import kvarn.ops

    check = self_check(device)
    print("self-check:", json.dumps(check), flush=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton_kernels": kvarn.ops.triton_available(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "self_check": check,
    }
    try:
        meta["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        meta["commit"] = "unknown"
    if not check["ok"]:
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": []}, indent=1))
        print("self-check failed: not reporting", file=sys.stderr)
        return 1
    shape = QWEN3_8B
    fp16_per_seq = shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2 * args.context
    batch = min(args.batch, int(args.kv_budget_gib * 2**30 // fp16_per_seq))
    kv_batch = int(batch * fp16_per_seq // kvarn_bytes_per_seq(shape, args.context))
    rows = [
        run_case("fp16", batch, args, device),
        run_case("kvarn", batch, args, device),
        run_case("kvarn", kv_batch, args, device),
    ]
    rows[0]["case"], rows[1]["case"], rows[2]["case"] = "fp16", "(a) equal batch", "(b) equal KV memory"
    base = rows[0].get("tokens_per_s")
    for r in rows:
        if base and "tokens_per_s" in r:
            r["vs_fp16"] = r["tokens_per_s"] / base
    lines = [
        f"Qwen3-8B shapes, random fp16 weights, context {args.context}, {args.steps} decode steps; "
        f"{meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"Triton kernels: {meta['triton_kernels']}, commit {meta['commit']}, {meta['date']}",
        "",
        "| case | cache | batch | step ms | tokens/s | vs fp16 | KV GiB | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['cache']} | {r['batch']} | {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['cache']} | {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r.get('vs_fp16', float('nan')):.2f}x | {r['kv_gib']:.1f} | {r['peak_gib']:.1f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
