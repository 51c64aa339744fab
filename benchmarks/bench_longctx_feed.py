"""How the long-context harness feeds a prompt: one tile a chunk against multi-tile paged chunks (``--prefill-chunk``).

``kvarn report --task passkey|niah|vartrack|drift`` feeds each prompt in chunks of one tile, or with
``--prefill-chunk N`` as the first tile and then ``N`` tokens at a time, the KVarN methods through
``KVarNCache(paged=True)`` (:class:`kvarn.eval.longctx.Feed`). This measures both on random fp16 models in the
bundled models' shapes (no weights reach the device machine): the seconds a prompt takes, the milliseconds a
decoded token takes after it, and how far the multi-tile feed's next-token log-probabilities over 256
teacher-forced positions lie from the one-tile feed's. The gate: for every cache, the largest difference stays
within :data:`MAX_ABS_DLOGP` (both paths attend in fp16; a prompt chunk that saw its own earlier tiles exactly
would be orders of magnitude further); the benchmark refuses to report otherwise.

Run on the device machine: ``PYTHONPATH=. python benchmarks/bench_longctx_feed.py --out $OUT``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

MAX_ABS_DLOGP = 0.05
"""Largest |log p| difference allowed between the feeds at one position (fp16 attention in both, in another
order; on a tiny fp32 model with fp16 paged attention the difference is below 0.008, ``test_longctx.py``)."""

SHAPES = {
    "smollm2-135m": (
        "llama",
        {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2.5-coder-0.5b": (
        "qwen2",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
}


def _model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    family, kwargs = SHAPES[shape]
    config, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    model = cls(config(**kwargs)).to("cuda", torch.float16).eval()
    model.set_attn_implementation("sdpa")
    return model


def _run(model, run, feed, ids: list[int], after: list[int], steps: int) -> dict:
    """``run``'s (None: the exact model's) prompt seconds, decode ms a token, and teacher-forced log-probabilities
    of ``after``."""
    from kvarn.eval import longctx
    from kvarn.eval.drift import _teacher_forced

    def fresh():
        longctx.use_attention(model, False)
        return longctx._exact_cache() if run is None else longctx._method_cache(run, model, None, feed)

    with torch.inference_mode():
        cache = fresh()  # a whole untimed pass: the kernels compile for each shape (and launch rule) they meet
        row = longctx._prefill(model, ids, cache, feed, lambda: None)
        for _ in range(steps):
            row = longctx._forward(model, [int(row[-1].argmax())], cache)
        cache = fresh()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        row = longctx._prefill(model, ids, cache, feed, lambda: None)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(steps):
            row = longctx._forward(model, [int(row[-1].argmax())], cache)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        cache = fresh()
        last = longctx._prefill(model, ids, cache, feed, lambda: None)
        logprobs = _teacher_forced(model, cache, last, after, feed, len(ids), lambda: None)
    longctx.use_attention(model, False)
    return {"prompt_s": t1 - t0, "token_ms": (t2 - t1) / steps * 1e3, "logprobs": logprobs}


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out", help="folder for results.json and results.md")
    p.add_argument("--chunk", type=int, default=2048, help="tokens a prompt chunk holds after the first tile")
    p.add_argument("--methods", default="kvarn_k4v2_g128,kivi_k2v2_g128", help="KVarN-record methods, besides exact")
    p.add_argument(
        "--lengths", default="smollm2-135m:8192,qwen2.5-coder-0.5b:8192", help="SHAPE:TOKENS, comma-separated"
    )
    p.add_argument(
        "--chunked-only", default="qwen2.5-coder-0.5b:32768", help="SHAPE:TOKENS timed with the multi-tile feed alone"
    )
    p.add_argument("--steps", type=int, default=16, help="timed decode steps after the prompt")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_longctx_feed needs a CUDA device", file=sys.stderr)
        return 2
    import transformers

    from benchmarks._common import environment
    from kvarn.eval import longctx
    from kvarn.eval.methods import get_method

    methods = [None, *(longctx.Run(get_method(m.strip()), "tail") for m in args.methods.split(",") if m.strip())]
    longctx.check_chunk(args.chunk, [r.method for r in methods if r is not None])
    cases = [(*c.split(":"), True) for c in args.lengths.split(",") if c]
    cases += [(*c.split(":"), False) for c in args.chunked_only.split(",") if c]
    meta = {**environment(), "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}
    meta |= {"chunk": args.chunk, "steps": args.steps, "max_abs_dlogp_gate": MAX_ABS_DLOGP}
    rows, ok = [], True
    for shape in dict.fromkeys(c[0] for c in cases):
        model = _model(shape)
        vocab = model.config.vocab_size
        for _, tokens, both in (c for c in cases if c[0] == shape):
            gen = torch.Generator().manual_seed(int(tokens))
            ids = torch.randint(0, vocab, (int(tokens),), generator=gen).tolist()
            after = torch.randint(0, vocab, (256,), generator=gen).tolist()
            for run in methods:
                method = None if run is None else run.method
                row = {"shape": shape, "tokens": int(tokens), "cache": "exact" if run is None else method.name}
                chunked = _run(model, run, longctx.feed_of(method, args.chunk), ids, after, args.steps)
                row |= {"chunked_prompt_s": chunked["prompt_s"], "chunked_token_ms": chunked["token_ms"]}
                if both:
                    tile = _run(model, run, longctx.feed_of(method, None), ids, after, args.steps)
                    diff = (tile["logprobs"] - chunked["logprobs"]).abs()
                    row |= {"tile_prompt_s": tile["prompt_s"], "tile_token_ms": tile["token_ms"]}
                    row |= {"max_abs_dlogp": float(diff.max()), "mean_abs_dlogp": float(diff.mean())}
                    ok &= row["max_abs_dlogp"] <= MAX_ABS_DLOGP
                print(json.dumps(row), flush=True)
                rows.append(row)
        del model
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "ok": ok, "rows": rows}, indent=1) + "\n")
    if not ok:
        print(f"the feeds differ by more than {MAX_ABS_DLOGP} in a log-probability: not reporting", file=sys.stderr)
        return 1
    lines = [
        f"Random fp16 models, prompt chunks of {args.chunk} tokens after the first tile against one tile a chunk; "
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
        f"commit {meta['commit']}, {meta['date']}",
        "",
        "| shape | tokens | cache | prompt s, one tile | prompt s, chunked | speed-up | ms a token, one tile | "
        "ms a token, chunked | max abs dlogp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tile = r.get("tile_prompt_s")
        cells = [
            _fmt(tile, ".2f"),
            _fmt(r["chunked_prompt_s"], ".2f"),
            _fmt(tile and tile / r["chunked_prompt_s"], ".1f", "x"),
            _fmt(r.get("tile_token_ms"), ".1f"),
            _fmt(r["chunked_token_ms"], ".1f"),
            _fmt(r.get("max_abs_dlogp"), ".4f"),
        ]
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['cache']} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
