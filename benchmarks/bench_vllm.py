"""kvarn inside vLLM on one GPU, dummy weights: engine checks and serving figures (one mode per process).

usage: python benchmarks/bench_vllm.py check OUT.json
       python benchmarks/bench_vllm.py preempt OUT.json   (check's preemption scenario alone: OUT.json.preempt)
       python benchmarks/bench_vllm.py skip OUT.json      (check's skipped-layer scenario alone: OUT.json.skip)
       python benchmarks/bench_vllm.py bench MODEL CACHE_DTYPE OUT.json     (MODEL: llama3-8b | qwen3-8b)
       python benchmarks/bench_vllm.py steps MODEL CACHE_DTYPE OUT.json     (one decode step's kernels, profiled)
       python benchmarks/bench_vllm.py capacity MODEL CACHE_DTYPE OUT.json  (CAP_CTX-token requests held)
       python benchmarks/bench_vllm.py spec MODEL CACHE_DTYPE OUT.json      (TPOT with and without drafts)

``check``: a tiny Llama (2 layers, head_dim 128, GQA 8/2) with ``kvarn_k4v2_g128`` (or the cache dtype
in ``CHECK_DTYPE``, e.g. ``kvarn_k4v2_g128_ks``; ``CHECK_MODEL=tiny-biased``: the same Llama with
biased q/k/v projections, which KVarN serves in the ``_ks`` form) under vLLM's
default compilation (decode CUDA graphs) and with ``enforce_eager``, and the bf16 cache: chunk
boundaries inside tiles (``max_num_batched_tokens`` 200), a prefix hit, ``n = 2`` sampling and 24
concurrent requests. The graph run must give the eager run's tokens exactly (same kernels; the
graph path adds the persistent plan buffers and the commits after replays), and every run must finish.
``CHECK_PREEMPT=1`` adds two engines (graphs, eager) whose cache holds ``PREEMPT_BLOCKS`` blocks, so
the 24 concurrent requests are preempted and recomputed: again the same tokens, and at least one
preemption. ``CHECK_SKIP=1`` adds engines with layer 0 kept in bf16 (``kv_cache_dtype_skip_layers``),
at KVarN's default block and at blocks of two tiles: every request finishes, agreement with bf16
recorded. Each KVarN engine's last decode step of the probed layer (``KVARN_PROBE_LAYER``, replayed
from a CUDA graph in the graph engine) is held to :func:`kvarn.reference.paged_attention` over the
cache it left (``probe_stats``). Exit status 1 if any of this fails.

``bench`` knobs (environment): ``KV_GIB`` gives the engine an explicit KV budget of that many GiB
(``kv_cache_memory_bytes``; the tail pool then comes on top) instead of vLLM's default memory,
so that filling the cache fits one device call; ``CAP=0`` skips the capacity-bound part,
``CAP_ONLY=1`` runs only it, ``CAP_DECODE=0`` skips its decode phase (below), ``TPOT=0`` skips the
time-per-output-token part; ``TPOT_GRID``
(default ``4096:1,8,32``; e.g. ``4096:1,8,32;32768:1,8``) picks its contexts and batches (a batch
whose tokens exceed the cache is recorded as not fitting, not timed); ``CAP_PROMPT`` (default 4096)
and ``CAP_OUT`` (default 256) are the capacity run's prompt and output lengths. One engine serves every part.
The long-output workload (short prompts, long answers: where a cache that holds more requests pays most):
``CAP_ONLY=1 CAP_DECODE=0 CAP_PROMPT=1024 CAP_OUT=8192 KV_GIB=21 ... bench qwen3-8b DTYPE OUT.json``, a KV
budget at which bf16's cache holds 16 such requests.

``bench``: Llama-3-8B or Qwen3-8B shapes, vLLM's defaults otherwise: KV token capacity (``num_gpu_blocks
* block_size``), prefill tokens/s of one 16K prompt, time per output token (prefix-cached prompts,
``(t(129 tokens) - t(65 tokens)) / 64``, the median of ``TPOT_PAIRS`` pairs, default 5, with their
range: single pairs spread by up to ±0.2 ms on the H200), and capacity-bound output tokens/s:
``CAP_PROMPT``-token prompts + ``CAP_OUT`` generated (``ignore_eos``), as many requests as the cache
holds (tail blocks counted), all submitted at once, end to end (each request's prefill included: with
16K prompts and 256 outputs that is 64 prompt tokens per output token, so prefill-bound for any cache),
with vLLM's preemption count; then its decode phase: the same requests again on their prefix-cached
prompts, time per output token at that batch as above (``CAP_DECODE_PAIRS`` pairs, default 2),
``cap_decode_tok_s`` = requests / TPOT, with the prefix-cache hit rate of those runs (near 1: only each
prompt's last block is recomputed; vLLM 0.26's counter reads 0 for its own backends while their cache
hits, as its stats lines' prompt throughput shows). ``start_jit`` and ``cap_jit``: Triton's compiles
(count, seconds, kernels; :class:`JitLog`) during engine start and during the end-to-end capacity run,
where a machine whose Triton cache lacks kvarn's kernels pays them.

``spec``: time per output token at ``SPEC_BATCH`` (default 1) prompts of ``SPEC_CTX`` tokens (default 4096), as
in ``bench`` (5 pairs), for three engines in turn: the cache dtype's default engine, the engine speculative decoding
runs on (vLLM's V1 runner: ``VLLM_USE_V2_MODEL_RUNNER=0``) without drafts, and that engine with ``SPEC_JSON``'s
drafts (default ngram, 3 tokens); each with vLLM's draft and acceptance counts. ``SPEC_ONLY`` names one of them
(``default``, ``v1``, ``v1_drafts``) and adds its row to ``OUT.json``: vLLM 0.26 captures no CUDA graphs for a
second engine in a process, so a GPU run gives each engine a process of its own. The prompts repeat a random
256-token passage, so ngram drafts find matches in them as they would in a document-grounded answer.

``steps``: one engine (``max_num_seqs`` 8 or the batch, ``max_model_len`` the prompt + 512; ``STEPS_MAX_SEQS`` and
``STEPS_MAX_LEN`` set them), ``STEPS_BATCH`` prompts of ``STEPS_CTX`` tokens
(defaults 1 and 4096): TPOT as in ``bench`` (2 pairs), then 33 decode tokens under the torch profiler,
written as every GPU activity (name, start, duration; kernels replayed from CUDA graphs included) and
the metadata builders' host time per call (inflated by the profiler), to see what a step launches and
what each launch costs against bf16's.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

_TINY = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=8192,
)
SHAPES = {
    "tiny": _TINY,
    # five sliding-window layers (1,024 tokens) to one global layer, head_dim 256, as Gemma 3 12B's text model
    "gemma3-12b": dict(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
        max_position_embeddings=131072,
    ),
    "tiny-biased": _TINY | {"attention_bias": True},  # biased q/k/v projections, as Qwen2.5: KVarN serves _ks
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=500000.0,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
}


def _model_dir(shape: str) -> str:
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    d = tempfile.mkdtemp()
    family = {"qwen3": (Qwen3Config, "Qwen3ForCausalLM"), "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM")}
    cls, arch = family.get(shape.split("-")[0], (LlamaConfig, "LlamaForCausalLM"))
    cfg = cls(**SHAPES[shape])
    cfg.torch_dtype = "bfloat16"
    # without it vLLM resolves a Qwen3 config to the bare ``Qwen3Model``, a pooling (embedding) runner
    cfg.architectures = [arch]
    cfg.save_pretrained(d)
    return d


def _llm(shape: str, kv: str, **kw):
    import kvarn.integration.vllm as kvarn_vllm

    kvarn_vllm.register()  # the entry point needs kvarn installed; the in-process engine needs only this
    if not kvarn_vllm.is_enabled():
        raise RuntimeError(f"kvarn plugin not installed: {kvarn_vllm.status()}")
    from vllm import LLM

    base = dict(model=_model_dir(shape), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", seed=0)
    return LLM(**base, kv_cache_dtype=kv, **kw)


def _warmup_stats() -> dict:
    """What kvarn's rehearsal of serving steps did in this process so far (:mod:`kvarn.integration.vllm.warmup`)."""
    from kvarn.integration.vllm.state import serving

    return {k: round(v, 1) if isinstance(v, float) else v for k, v in serving.warmup_stats.items()}


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


CHECK_ENGINE = dict(gpu_memory_utilization=0.15, max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=200)
"""Engine settings of ``check``: chunks of 200 tokens end inside tiles. ``CHECK_ENGINE_JSON`` (a JSON object) adds
or overrides engine arguments for every engine of ``check``, e.g. ``{"block_size": 256, "prefix_match_unit": 128}``:
prefix hits that end inside a block of two tiles, so vLLM copies the block on write."""
CHECK_ENGINE |= json.loads(os.environ.get("CHECK_ENGINE_JSON", "{}"))


def agree(a, b) -> float:
    """The fraction of equal tokens at equal places of two runs' outputs (requests x samples x tokens)."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    same = sum(sum(1 for u, v in zip(x, y, strict=False) if u == v) for x, y in pairs)
    return same / max(1, sum(len(x) for x, _ in pairs))


def _probe_reset() -> None:
    from kvarn.integration.vllm.state import serving

    serving.probe.reset()


def _free_gpu() -> None:
    """Let the next engine of the process have the GPU memory of the last one (its ``LLM`` deleted)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _check_inputs():
    """``check``'s prompts (8 of 17-700 tokens), its 24 concurrent requests and greedy sampling."""
    from vllm import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (300, 131, 17, 520, 129, 128, 255, 700)]
    many = [[rng.randrange(1, 1000) for _ in range(rng.randrange(100, 400))] for _ in range(24)]
    return prompts, many, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _sink_stats() -> dict | None:
    """The sink counters of this process's KVarN builders (GPU runner), or ``None`` where the engine runs
    in another process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps it here)."""
    from kvarn.integration.vllm.state import serving

    pools = list(serving.sink_book.pools)
    if not pools:
        return None
    keys = ("new_sinks", "recycled_sinks", "evicted_sinks")
    return {k: sum(p.stats[k] for p in pools) for k in keys} | {"live": sum(len(p.live) for p in pools)}


PROBE_LAYER = "model.layers.1.self_attn.attn"
"""The layer whose last decode step ``check`` holds to the reference (``KVARN_PROBE_LAYER``)."""


def _probe_check(llm) -> dict:
    """The probed layer's last decode step through the blocks (replayed from a CUDA graph where the engine
    captured it) against the reference over the cache as that step left it
    (:meth:`~kvarn.integration.vllm.probe.DecodeProbe.check`), within the kernels' tolerance
    (``tests/tolerances.py``: max |kernel - reference| / max |reference|). An engine whose tails are in a
    pool (``_sink`` dtypes, ``KVARN_TAIL_BLOCKS=0``) has no such step: nothing to check."""
    import torch

    from benchmarks._common import TOL
    from kvarn.integration.vllm.state import serving

    decode_probe = serving.probe

    if not _tail_blocks(llm):
        return {"probed": False, "ok": True, "note": "tails in a pool: no decode step through the blocks"}
    res = decode_probe.check()
    if not res["probed"]:
        return res | {"ok": False, "error": "no decode step through the blocks reached the probed layer"}
    res["tol"] = TOL.ATTN_REL[getattr(torch, res["dtype"])]
    res["ok"] = res["last_step_was_decode"] and res["seq_lens_match_build"] and res["rel_err"] <= res["tol"]
    return res


def check(out_path: str) -> int:
    from vllm import SamplingParams

    from kvarn.integration.vllm.probe import PROBE_ENV
    from kvarn.integration.vllm.state import serving

    decode_probe = serving.probe

    decode_probe.layer = os.environ.get(PROBE_ENV) or PROBE_LAYER  # the probe reads the variable at import
    decode_probe.reset()

    prompts, many, greedy = _check_inputs()
    kvarn_dtype = os.environ.get("CHECK_DTYPE", "kvarn_k4v2_g128")
    results = {"kvarn_dtype": kvarn_dtype}
    for name, kv, eager in (
        ("kvarn_graphs", kvarn_dtype, False),
        ("kvarn_eager", kvarn_dtype, True),
        ("bf16_graphs", "auto", False),
    ):
        t0 = time.time()
        llm = _llm(os.environ.get("CHECK_MODEL", "tiny"), kv, enforce_eager=eager, **CHECK_ENGINE)
        res = {"start_s": round(time.time() - t0, 1)}
        res["run_cache_dtype"] = llm.llm_engine.vllm_config.cache_config.cache_dtype
        cc = llm.llm_engine.vllm_config.compilation_config
        res["cudagraph_mode"] = str(cc.cudagraph_mode)
        res["kv_blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        p = [{"prompt_token_ids": x} for x in prompts]
        res["cold"] = _tokens(llm.generate(p, greedy, use_tqdm=False))
        res["prefix_hit"] = _tokens(llm.generate(p, greedy, use_tqdm=False))
        res["n2"] = _tokens(
            llm.generate(p[:3], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24), use_tqdm=False)
        )
        res["many"] = _tokens(llm.generate([{"prompt_token_ids": x} for x in many], greedy, use_tqdm=False))
        res["total_s"] = round(time.time() - t0, 1)
        if kv != "auto":
            res["probe_stats"] = _probe_check(llm)
            res["warmup_stats"] = _warmup_stats()
        if kv.endswith("_sink"):
            res["sink_stats"] = _sink_stats()
        if kv != "auto":  # steps built with tails in blocks by route, this engine's and those before it
            from kvarn.integration.vllm.state import serving

            res["tail_block_steps"] = dict(serving.tail_block_steps)
        results[name] = res
        with open(out_path + ".partial", "w") as f:  # what a cut-off call still returns
            json.dump(results, f)
        del llm
        _probe_reset()
        _free_gpu()

    g, e, b = results["kvarn_graphs"], results["kvarn_eager"], results["bf16_graphs"]
    summary = {f"graphs_vs_eager_{k}": agree(g[k], e[k]) for k in ("cold", "prefix_hit", "n2", "many")} | {
        f"kvarn_vs_bf16_{k}": agree(g[k], b[k]) for k in ("cold", "prefix_hit", "many")
    }
    summary["prefix_hit_vs_cold_kvarn"] = agree(g["cold"], g["prefix_hit"])
    summary["prefix_hit_vs_cold_bf16"] = agree(b["cold"], b["prefix_hit"])
    keep = ("_s", "mode", "blocks", "dtype", "_stats")
    runs = {k: {kk: vv for kk, vv in v.items() if kk.endswith(keep)} for k, v in results.items() if k != "kvarn_dtype"}
    out = {"kvarn_dtype": kvarn_dtype, "summary": summary, "runs": runs}
    print(json.dumps(out, indent=1))
    with open(out_path, "w") as f:
        json.dump(out | {"tokens": results}, f)
    ok = all(summary[f"graphs_vs_eager_{k}"] == 1.0 for k in ("cold", "prefix_hit", "many"))
    ok = ok and all(results[k]["probe_stats"]["ok"] for k in ("kvarn_graphs", "kvarn_eager"))
    if os.environ.get("CHECK_PREEMPT") == "1":
        ok = _check_preemption(kvarn_dtype, many, greedy, out_path) and ok
    if os.environ.get("CHECK_SKIP") == "1":
        ok = _check_skip_layers(kvarn_dtype, prompts, many, greedy, b, out_path) and ok
    return 0 if ok else 1


SKIP_BLOCK_SIZES = (None, 256)
"""Cache block sizes of ``CHECK_SKIP``: vLLM's default for KVarN (one tile) and two tiles a block."""


def _check_skip_layers(kvarn_dtype: str, prompts: list, many: list, greedy, bf16: dict, out_path: str) -> bool:
    """``CHECK_SKIP=1``: layer 0 kept in bf16 (``kv_cache_dtype_skip_layers=["0"]``, vLLM's own backend there),
    the other KVarN, under decode CUDA graphs, at each of :data:`SKIP_BLOCK_SIZES`: every request finishes
    with bf16's greedy tokens (the tiny model's agreement, as the plain KVarN engine's). An engine that
    does not start is recorded with its error and fails the check."""
    res, ok = {}, True
    for bs in SKIP_BLOCK_SIZES:
        name = f"block_{bs or 'default'}"
        try:
            llm = _llm(
                os.environ.get("CHECK_MODEL", "tiny"),
                kvarn_dtype,
                kv_cache_dtype_skip_layers=["0"],
                **({} if bs is None else {"block_size": bs}),
                **CHECK_ENGINE,
            )
        except Exception as e:  # a refused configuration is a result here
            res[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            ok = False
            continue
        cc = llm.llm_engine.vllm_config
        row = {"cudagraph_mode": str(cc.compilation_config.cudagraph_mode), "block_size": cc.cache_config.block_size}
        row["backends"] = llm.collective_rpc(  # vLLM 0.26's attention groups carry no kernel_block_size
            lambda w: sorted(
                {
                    (g.backend.__name__, getattr(g, "kernel_block_size", None))
                    for gs in getattr(w.model_runner, "attn_groups", ())
                    for g in gs
                }
            )
        )[0]
        cold = _tokens(llm.generate([{"prompt_token_ids": x} for x in prompts], greedy, use_tqdm=False))
        conc = _tokens(llm.generate([{"prompt_token_ids": x} for x in many], greedy, use_tqdm=False))
        row |= {"vs_bf16_cold": agree(cold, bf16["cold"]), "vs_bf16_many": agree(conc, bf16["many"])}
        row["finished"] = sum(len(c) == greedy.max_tokens for r in cold + conc for c in r)
        res[name] = row
        ok = ok and row["finished"] == len(prompts) + len(many)
        del llm
        _free_gpu()
    print(json.dumps({"skip_layers": res}), flush=True)
    with open(out_path + ".skip", "w") as f:
        json.dump(res, f)
    return ok


def skip_only(out_path: str) -> bool:
    """``check``'s ``CHECK_SKIP`` scenario alone: the bf16 engine's tokens first, then :func:`_check_skip_layers`."""
    prompts, many, greedy = _check_inputs()
    llm = _llm(os.environ.get("CHECK_MODEL", "tiny"), "auto", **CHECK_ENGINE)
    bf16 = {
        k: _tokens(llm.generate([{"prompt_token_ids": x} for x in p], greedy, use_tqdm=False))
        for k, p in (("cold", prompts), ("many", many))
    }
    del llm
    _free_gpu()
    return _check_skip_layers(os.environ.get("CHECK_DTYPE", "kvarn_k4v2_g128"), prompts, many, greedy, bf16, out_path)


PREEMPT_BLOCKS = 40
"""KV blocks (of 128 tokens for KVarN) of the preemption check: 24 requests of 100-400 prompt tokens
plus 40 generated need ~7000 tokens, so vLLM must preempt and recompute some of them."""


def _check_preemption(kvarn_dtype: str, many: list, greedy, out_path: str) -> bool:
    """``CHECK_PREEMPT=1``: the 24 concurrent requests in ``PREEMPT_BLOCKS`` blocks, with decode CUDA
    graphs and eager: the same tokens, and at least one preemption (``vllm:num_preemptions``)."""
    runs = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = _llm(
            os.environ.get("CHECK_MODEL", "tiny"),
            kvarn_dtype,
            enforce_eager=eager,
            num_gpu_blocks_override=PREEMPT_BLOCKS,
            disable_log_stats=False,  # get_metrics() needs the stat loggers
            **CHECK_ENGINE,
        )
        toks = _tokens(llm.generate([{"prompt_token_ids": x} for x in many], greedy, use_tqdm=False))
        preempted = _preemptions(llm)
        runs[name] = {"tokens": toks, "preemptions": preempted}
        del llm
        _free_gpu()
    same = runs["graphs"]["tokens"] == runs["eager"]["tokens"]
    res = {"blocks": PREEMPT_BLOCKS, "same_tokens": same}
    res |= {f"preemptions_{k}": v["preemptions"] for k, v in runs.items()}
    print(json.dumps({"preemption": res}), flush=True)
    with open(out_path + ".preempt", "w") as f:
        json.dump(res | {"runs": runs}, f)
    return same and min(v["preemptions"] for v in runs.values()) > 0


class JitLog:
    """Triton compiles in this process (the in-process engine's kernels), with their wall time.

    Installed as Triton's ``jit_cache_hook`` (called before a compile; returns what the hook it replaced
    returns, so the compile proceeds) and ``jit_post_compile_hook`` (after it), each chaining the hook it
    found; vLLM's JIT monitor, installed after warm-up, chains to these in turn. ``since(mark)``: the
    compiles after ``len(events)`` was ``mark``, as ``{"compiles", "seconds", "kernels"}``.
    """

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self._started: dict[str, float] = {}

    @classmethod
    def install(cls) -> JitLog | None:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without the runtime hooks: compiles are not recorded
            return None
        rt = getattr(knobs, "runtime", None)
        if rt is None or not hasattr(rt, "jit_post_compile_hook") or not hasattr(rt, "jit_cache_hook"):
            return None
        log = cls()
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def pre(**kw):
            skip = before(**kw) if before is not None else None
            if not skip:
                log._started[log._key(kw)] = time.time()
            return skip

        def post(**kw):
            key = log._key(kw)
            t0 = log._started.pop(key, None)
            log.events.append((key.split("|")[0], 0.0 if t0 is None else time.time() - t0))
            return after(**kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        return log

    @staticmethod
    def _key(kw: dict) -> str:
        return f"{getattr(kw.get('fn'), 'name', '?')}|{kw.get('key')!r}"

    def since(self, mark: int) -> dict:
        new = self.events[mark:]
        kernels: dict[str, int] = {}
        for name, _ in new:
            kernels[name] = kernels.get(name, 0) + 1
        return {"compiles": len(new), "seconds": round(sum(t for _, t in new), 1), "kernels": kernels}


def _random_prompt(rng: random.Random, shape: str, n: int) -> dict:
    """``n`` random token ids of ``shape``'s vocabulary (below 100,000, above the first 100) as a prompt."""
    vocab = min(100000, SHAPES[shape]["vocab_size"])
    return {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]}


def bench(shape: str, kv: str, out_path: str) -> int:
    from vllm import SamplingParams

    rng = random.Random(0)
    res = {"model": shape, "kv_cache_dtype": kv}

    def prompt(n):
        return _random_prompt(rng, shape, n)

    def save():
        print(json.dumps(res), flush=True)
        with open(out_path, "w") as f:
            json.dump(res, f)

    grid = {}
    for part in os.environ.get("TPOT_GRID", "4096:1,8,32").split(";"):
        ctx, batches = part.split(":")
        grid[int(ctx)] = [int(b) for b in batches.split(",")]
    cap_prompt = int(os.environ.get("CAP_PROMPT", "4096"))
    n_pairs = int(os.environ.get("TPOT_PAIRS", "5"))
    kv_gib = os.environ.get("KV_GIB")
    memory = (
        {"gpu_memory_utilization": 0.9} if kv_gib is None else {"kv_cache_memory_bytes": int(float(kv_gib) * 2**30)}
    )
    jit = JitLog.install()
    t0 = time.time()
    cap_out = int(os.environ.get("CAP_OUT", "256"))
    llm = _llm(
        shape,
        kv,
        max_model_len=max(16384 + 320, cap_prompt + cap_out + 64, *(c + 320 for c in grid)),
        disable_log_stats=False,  # the capacity run reads vLLM's preemption count (get_metrics)
        **memory,
    )
    cfg = llm.llm_engine.vllm_config
    res["start_s"] = round(time.time() - t0, 1)
    if jit is not None:
        res["start_jit"] = jit.since(0)
    res["warmup_stats"] = _warmup_stats()
    res["kv_budget"] = "gpu_memory_utilization 0.9" if kv_gib is None else f"{kv_gib} GiB"
    res["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
    res["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
    res["kv_tokens"] = cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
    res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)

    def timed(prompts, n):
        t = time.time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.time() - t

    if os.environ.get("CAP_ONLY") != "1":
        timed([prompt(512)], 1)
        res["prefill_16k_tok_s"] = round(16384 / timed([prompt(16384)], 1))
        pool = {}
        tail_tokens = _tail_blocks(llm) * cfg.cache_config.block_size  # kvarn's tails in blocks, per request
        for ctx, batches in {} if os.environ.get("TPOT") == "0" else grid.items():
            for batch in batches:
                key = f"tpot_ms_b{batch}_ctx{ctx}"
                if batch * (ctx + 160 + tail_tokens) > res["kv_tokens"]:
                    res[key] = "does not fit"
                    continue
                # prompts prefix-cached after the first call (:func:`_tpot`); a context's prompts are shared
                # by its batches (batch 8's are batch 32's first 8): a larger batch prefills only the rest
                shared = pool.setdefault(ctx, [])
                shared += [prompt(ctx) for _ in range(batch - len(shared))]
                ps = shared[:batch]
                timed(ps, 1)
                res[key], res[key + "_range"] = _tpot(llm, ps, n_pairs)
                save()
        save()
    if os.environ.get("CAP", "1") != "0":
        _capacity(llm, res, prompt, cap_prompt, cap_out, save, jit)
        save()
    return 0


def steps(shape: str, kv: str, out_path: str) -> int:
    """Where a decode step's time goes: ``STEPS_BATCH`` (default 1) prefix-cached prompts of ``STEPS_CTX``
    tokens (default 4096) decoded 33 tokens under the torch profiler (CUDA kernels, replayed from vLLM's
    graphs included). Writes the TPOT (``_tpot``, 2 pairs), the metadata builders' host time per call,
    and every GPU activity of the profiled run (name, start, duration in µs) for offline analysis."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    batch, ctx = int(os.environ.get("STEPS_BATCH", "1")), int(os.environ.get("STEPS_CTX", "4096"))
    builds: dict[str, list[float]] = {}

    def timed_build(cls):
        original = cls.build

        def build(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                builds.setdefault(cls.__name__, []).append((time.perf_counter() - t) * 1e6)

        cls.build = build

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    from kvarn.integration.vllm.builder import KVarNMetadataBuilder

    timed_build(FlashAttentionMetadataBuilder)
    timed_build(KVarNMetadataBuilder)
    rng = random.Random(0)
    prompts = [_random_prompt(rng, shape, ctx) for _ in range(batch)]
    # STEPS_MAX_LEN / STEPS_MAX_SEQS: the engine's limits (defaults: the prompt + 512, the batch or 8)
    max_len = int(os.environ.get("STEPS_MAX_LEN", ctx + 512))
    max_seqs = int(os.environ.get("STEPS_MAX_SEQS", max(8, batch)))
    llm = _llm(shape, kv, max_model_len=max_len, max_num_seqs=max_seqs, gpu_memory_utilization=0.9)
    cfg = llm.llm_engine.vllm_config
    res = {"model": shape, "kv_cache_dtype": kv, "batch": batch, "ctx": ctx, "max_len": max_len, "max_seqs": max_seqs}
    res["async_scheduling"] = cfg.scheduler_config.async_scheduling
    res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
    greedy = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)
    res["tpot_ms"], res["tpot_range"] = _tpot(llm, prompts, 2)
    builds.clear()
    greedy = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        res["profiled_s"] = round(time.perf_counter() - t, 4)
    res["build_us"] = {k: [len(v), round(sum(v) / len(v), 1), round(max(v), 1)] for k, v in builds.items()}
    gpu, api = [], []
    for e in prof.events():
        kind = str(e.device_type)
        if kind.endswith("CUDA"):
            gpu.append((e.name, round(e.time_range.start, 2), round(e.time_range.elapsed_us(), 2)))
        elif e.name.startswith("cu"):  # runtime and driver calls
            api.append((e.name, round(e.time_range.start, 2), round(e.time_range.elapsed_us(), 2)))
    res["gpu"] = sorted(gpu, key=lambda x: x[1])
    res["api"] = sorted(api, key=lambda x: x[1])
    with open(out_path, "w") as f:
        json.dump(res, f)
    print(json.dumps({k: v for k, v in res.items() if k not in ("gpu", "api")}), flush=True)
    return 0


def spec(shape: str, kv: str, out_path: str) -> int:
    """``spec`` (module doc): TPOT of the default engine, of the V1 runner without drafts and with them."""
    from vllm import SamplingParams

    batch, ctx = int(os.environ.get("SPEC_BATCH", "1")), int(os.environ.get("SPEC_CTX", "4096"))
    drafts = json.loads(os.environ.get("SPEC_JSON", '{"method": "ngram", "num_speculative_tokens": 3}'))
    rng = random.Random(0)
    vocab = min(100000, SHAPES[shape]["vocab_size"])
    prompts = []
    for _ in range(batch):
        passage = [rng.randrange(100, vocab) for _ in range(256)]
        prompts.append({"prompt_token_ids": (passage * (ctx // 256 + 1))[:ctx]})
    res = {"model": shape, "kv_cache_dtype": kv, "batch": batch, "ctx": ctx, "drafts": drafts, "engines": {}}
    if os.path.exists(out_path):
        with open(out_path) as f:
            res["engines"] = json.load(f).get("engines", {})
    runs = (("default", None, None), ("v1", "0", None), ("v1_drafts", "0", drafts))
    only = os.environ.get("SPEC_ONLY")
    for name, v2, spec_config in runs:
        if only and name != only:
            continue
        if v2 is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = v2
        t0 = time.time()
        llm = _llm(
            shape,
            kv,
            max_model_len=ctx + 512,
            max_num_seqs=max(8, batch),
            gpu_memory_utilization=0.28,  # engines in one process: each leaves its memory behind
            speculative_config=spec_config,
            disable_log_stats=False,
        )
        row = {"start_s": round(time.time() - t0, 1)}
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True), use_tqdm=False)
        row["tpot_ms"], row["tpot_range"] = _tpot(llm, prompts, 5)
        counts = {m.name: int(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if "spec_decode_num" in m.name}
        row["spec_counts"] = counts
        res["engines"][name] = row
        print(json.dumps({name: row}), flush=True)
        with open(out_path, "w") as f:
            json.dump(res, f)
        llm.llm_engine.engine_core.shutdown()
        del llm
        _free_gpu()
    return 0


def capacity(shape: str, kv: str, out_path: str) -> int:
    """What one engine's cache holds at vLLM's defaults and ``CAP_CTX`` tokens a request (default 32,768): KV
    tokens, blocks, each group's spec and vLLM's own count of such requests held at once (its "maximum
    concurrency", which counts a window layer's blocks by its window and kvarn's tail blocks); then
    ``CAP_SERVE`` requests (default 8) of 3,000 prompt + 64 generated tokens, so the window leaves tiles behind,
    timed and checked to finish."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    ctx = int(os.environ.get("CAP_CTX", "32768"))
    t0 = time.time()
    llm = _llm(shape, kv, max_model_len=ctx, gpu_memory_utilization=0.9, disable_log_stats=False)
    cfg = llm.llm_engine.vllm_config
    res = {"model": shape, "kv_cache_dtype": kv, "kv_budget": "gpu_memory_utilization 0.9", "ctx": ctx}
    res["start_s"] = round(time.time() - t0, 1)
    res["kv_tokens"] = cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
    res["num_gpu_blocks"] = cfg.cache_config.num_gpu_blocks
    kv_config = _kv_cache_config(llm)
    res["groups"] = [
        [type(g.kv_cache_spec).__name__, len(g.layer_names), getattr(g.kv_cache_spec, "sliding_window", None)]
        for g in kv_config.kv_cache_groups
    ]
    res[f"max_requests_ctx{ctx}"] = round(get_max_concurrency_for_kv_cache_config(cfg, kv_config), 2)
    res["tail_blocks"] = _tail_blocks(llm)
    print(json.dumps(res), flush=True)
    rng = random.Random(0)
    prompts = [_random_prompt(rng, shape, 3000) for _ in range(int(os.environ.get("CAP_SERVE", "8")))]
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    res["serve_s"] = round(time.time() - t, 2)
    res["served_tokens"] = [len(o.outputs[0].token_ids) for o in outs]
    res["preemptions"] = _preemptions(llm)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0 if all(n == 64 for n in res["served_tokens"]) else 1


def _capacity(llm, res: dict, prompt, plen: int, out: int, save, jit: JitLog | None = None) -> None:
    """Capacity-bound output tokens/s: as many ``plen`` + ``out`` requests as the engine's cache holds, at once.

    A request takes ``cdiv(plen + out, block_size)`` blocks, plus kvarn's tail blocks where its tails live
    in vLLM's blocks (the KV spec's ``tail_blocks``): sized from tokens alone, the run overcommits the
    cache and measures preemptions (252 requests where 241 fit, on Qwen3-8B shapes). ``cap_preemptions``:
    vLLM's count over the run (0 when the sizing is right). ``cap_jit``: Triton's compiles during the
    end-to-end run (count, seconds, kernels), which an engine whose kernels were compiled would not pay.
    """
    from vllm import SamplingParams

    cfg = llm.llm_engine.vllm_config.cache_config
    nreq = max(1, cfg.num_gpu_blocks // (-(-(plen + out) // cfg.block_size) + _tail_blocks(llm)))
    ps = [prompt(plen) for _ in range(nreq)]
    before = _preemptions(llm)
    mark = len(jit.events) if jit is not None else 0
    t = time.time()
    llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    el = time.time() - t
    if jit is not None:
        res["cap_jit"] = jit.since(mark)
    res |= {"cap_prompt": plen, "cap_out": out, "cap_requests": nreq, "cap_s": round(el, 2)}
    res["cap_out_tok_s"] = round(nreq * out / el)
    res["cap_preemptions"] = _preemptions(llm) - before
    save()
    if os.environ.get("CAP_DECODE", "1") == "0":
        return
    # the decode phase at that batch: the same prompts again, now prefix-cached (their last block is
    # recomputed, in both runs of a pair), (t(129) - t(65)) / 64 per step
    pairs = int(os.environ.get("CAP_DECODE_PAIRS", "2"))
    hits = _prefix_hits(llm)
    per_step, before = _tpot(llm, ps, pairs), _preemptions(llm)
    res["cap_decode_tpot_ms"], res["cap_decode_tpot_range"] = per_step
    res["cap_decode_tok_s"] = round(nreq / per_step[0] * 1e3)
    res["cap_decode_preemptions"] = _preemptions(llm) - before
    got = _prefix_hits(llm)
    res["cap_decode_prefix_hit_rate"] = round((got[0] - hits[0]) / max(1, got[1] - hits[1]), 4)


def _tpot(llm, prompts: list, pairs: int) -> tuple[float, list[float]]:
    """Time per output token of ``prompts`` decoded together: the median (the upper one of an even count)
    and the range over ``pairs`` of ``(t(129 tokens) - t(65 tokens)) / 64`` in ms. Each run prefills what
    the prefix cache lacks, the same in both runs of a pair, and the first decode steps, so the
    difference is 64 decode steps of the whole batch."""
    from vllm import SamplingParams

    def timed(n):
        t = time.time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.time() - t

    per_token = sorted((b - a) / 64 * 1e3 for a, b in ((timed(65), timed(129)) for _ in range(pairs)))
    return round(per_token[len(per_token) // 2], 3), [round(per_token[0], 3), round(per_token[-1], 3)]


def _prefix_hits(llm) -> tuple[int, int]:
    """vLLM's prefix-cache hits and queries so far, in tokens (``vllm:prefix_cache_hits`` / ``_queries``)."""
    got = {m.name: int(getattr(m, "value", 0)) for m in llm.get_metrics()}
    return got.get("vllm:prefix_cache_hits", 0), got.get("vllm:prefix_cache_queries", 0)


def _preemptions(llm) -> int:
    """vLLM's preemption count so far (``vllm:num_preemptions``)."""
    return sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def _kv_cache_config(llm):
    """The engine core's ``KVCacheConfig`` (the in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config


def _tail_blocks(llm) -> int:
    """The blocks per request kvarn keeps tails in (0 for a pool or another cache), from the engine core's KV spec."""
    try:
        groups = _kv_cache_config(llm).kv_cache_groups
    except AttributeError:
        return 0
    return max((int(getattr(g.kv_cache_spec, "tail_blocks", 0) or 0) for g in groups), default=0)


if __name__ == "__main__":
    if sys.argv[1] == "check":
        sys.exit(check(sys.argv[2]))
    if sys.argv[1] == "preempt":  # the preemption scenario of check alone
        _, many, greedy = _check_inputs()
        ok = _check_preemption(os.environ.get("CHECK_DTYPE", "kvarn_k4v2_g128"), many, greedy, sys.argv[2])
        sys.exit(0 if ok else 1)
    if sys.argv[1] == "skip":  # the skipped-layer scenario of check alone, against a bf16 engine's tokens
        sys.exit(0 if skip_only(sys.argv[2]) else 1)
    if sys.argv[1] == "steps":
        sys.exit(steps(sys.argv[2], sys.argv[3], sys.argv[4]))
    if sys.argv[1] == "spec":
        sys.exit(spec(sys.argv[2], sys.argv[3], sys.argv[4]))
    if sys.argv[1] == "capacity":
        sys.exit(capacity(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit(bench(sys.argv[2], sys.argv[3], sys.argv[4]))
