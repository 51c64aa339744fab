"""Tensor parallelism on vLLM's CPU engine: KVarN with two ranks gives the tokens of one.

Tiny random float32 Llamas (``tests/tiny_model.py``): 2 KV heads, which TP=2 splits (one per rank), and 1 KV
head, which TP=2 replicates. For ``kvarn_k4v2_g128`` and ``kvarn_k4v2_g128_ks`` each runs with
``tensor_parallel_size`` 1 and 2 on four prompts of 60-450 tokens in chunks of 96 (chunks inside tiles,
committed tiles, concurrent requests), 24 greedy tokens each; every rank plans its tiles from the same
scheduler output with its local KV heads. Then a ``_sink`` dtype with TP=2, which must be refused with the
reason. Results go to ``OUT.json``; the exit status is non-zero if a TP=2 run's tokens differ from TP=1's.

Each TP=2 engine starts two worker processes (the whole check: about 2 minutes on two cores);
``tests/test_vllm_tp.py`` runs it in the CPU suite. On a machine with two GPUs the same command runs vLLM's GPU
engine, with its decode CUDA graphs (eager on the CPU). Usage::

    PYTHONPATH=. python scripts/vllm_tp_check.py OUT.json

On a machine with fewer NUMA nodes than ranks vLLM's automatic thread binding refuses TP=2, so the script
sets ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=1`` unless they are set.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v2_g128_ks")
KV_HEADS = (2, 1)
PROMPT_TOKENS = (60, 200, 300, 450)
MAX_TOKENS = 24


def _facts(llm) -> list[dict]:
    """Per rank: the KVarN groups' backends, the layer cache view and the planners' counts."""

    def facts(worker):
        runner = worker.model_runner
        stats: dict = {}
        backends = set()
        for per_kv in runner.attn_groups:
            for group in per_kv:
                backends.add(group.backend.__name__)
                planner = getattr(group.metadata_builders[0], "planner", None)
                for key, value in (planner.stats if planner is not None else {}).items():
                    stats[key] = stats.get(key, 0) + value
        return {"backends": sorted(backends), "cache_shape": list(runner.kv_caches[0].shape), "stats": stats}

    return llm.collective_rpc(facts)


def run(out_path: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from tiny_model import build_tiny_model
    from vllm import LLM, SamplingParams, TokensPrompt

    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(256) for _ in range(n)]) for n in PROMPT_TOKENS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    args = {
        "enforce_eager": not torch.cuda.is_available(),  # a GPU engine runs its decode graphs
        "seed": 0,
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 8 * 2**20,
        "max_num_batched_tokens": 96,
    }
    results: dict = {"runs": {}, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for heads in KV_HEADS:
            model = str(build_tiny_model(pathlib.Path(tmp) / f"llama-kv{heads}", num_kv_heads=heads))
            for preset in PRESETS:
                for tp in (1, 2):
                    t0 = time.time()
                    llm = LLM(model=model, kv_cache_dtype=preset, tensor_parallel_size=tp, **args)
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    results["runs"][f"kv{heads}/{preset}/tp{tp}"] = {
                        "tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "ranks": _facts(llm),
                        "seconds": time.time() - t0,
                    }
                    llm.llm_engine.engine_core.shutdown()
                    del llm
                    print(f"kv{heads} {preset} TP={tp}: {time.time() - t0:.1f} s", flush=True)
        try:
            LLM(model=model, kv_cache_dtype="kvarn_k4v2_g128_sink", tensor_parallel_size=2, **args)
            results["sink_refusal"] = None
        except ValueError as exc:
            results["sink_refusal"] = str(exc)
    runs = results["runs"]
    results["same_tokens"] = {
        key: runs[f"{key}/tp2"]["tokens"] == runs[f"{key}/tp1"]["tokens"]
        for key in sorted({k.rsplit("/", 1)[0] for k in runs})
    }
    results["seconds"] = time.time() - t_start
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    res = run(sys.argv[1])
    for key, same in res["same_tokens"].items():
        print(f"{key}: TP=2 {'gives' if same else 'DOES NOT give'} the tokens of TP=1")
    print(f"_sink with TP=2 refused: {res['sink_refusal'] is not None}; {res['seconds']:.0f} s in all")
    sys.exit(0 if all(res["same_tokens"].values()) and res["sink_refusal"] else 1)
