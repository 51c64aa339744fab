"""End to end: sliding-window layers and learned attention sinks on vLLM's CPU engine with ``kv_cache_dtype="kvarn_*"``.

Three tiny random float32 models (:func:`tiny_model.build_tiny_windowed`, no download), window layers of 200
tokens (not a multiple of the 128-token tile) between global layers, every layer quantized:

- ``Gemma3ForCausalLM``: window layers in KV-cache groups of vLLM's sliding-window spec, whose manager frees a
  request's blocks as its window leaves them;
- vLLM's Granite with ``layer_types``: the same, and learned per-head sink logits on every layer;
- ``GptOssForCausalLM`` (MoE): window layers and sinks, served in the ``_ks`` form (biased projections), whose
  window groups keep one tile more than the window for the per-sequence smoothing vector.

Prompts of up to 700 tokens, chunked by 160, so the window moves past several tiles; eight concurrent requests
under a KV budget of a few requests, so vLLM hands blocks a window freed to other requests while the request
that freed them runs on with their stale ids in its block table. Greedy tokens inside the first tile equal the
unquantized engine's (attention reads the own tile in full precision, window and sinks applied as vLLM's engine
applies them), the unquantized tokens rank first at most positions beyond (teacher-forced), and each request's
tokens are the same alone as in its batch and again from a prefix hit (vLLM's window groups hit the tiles of the
last window only, the null block before them). The engines run in one child process
(``python tests/test_vllm_window.py OUT.json DIR``), as in ``tests/test_vllm_e2e.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import time

import pytest
from test_vllm_e2e import _generate, _shutdown, _teacher_forced, run_child
from tiny_model import WINDOW, WINDOWED, build_tiny_windowed

PRESET = "kvarn_k4v4_g128"
FLOORS = {"gemma3": 0.95, "granite_swa": 0.85, "gpt_oss": 0.75}
MAX_TOKENS = 16
SHORT = (40, 90)
"""Prompt lengths whose sequences (with ``MAX_TOKENS``) stay inside the first 128-token tile."""
LONG = (260, 400, 520, 600, 650, 700)
"""Prompt lengths whose window leaves tiles 0 to 3 behind."""
TAIL_BLOCK_KINDS = ("gemma3", "granite_swa")
"""Models also served with tails in vLLM's blocks (``KVARN_TAIL_BLOCKS=1``; GPT-OSS's ``_ks`` form keeps the pool)."""


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in SHORT + LONG]


class _BlockWatch:
    """Counts blocks vLLM frees from a running request's window (its manager's ``_remove_blocks_in_range``) and
    how many of them it hands to another request while the one that freed them still runs."""

    def __init__(self):
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

        self.freed: dict[int, tuple] = {}
        self.stats = {"window_freed": 0, "reused": 0, "reused_while_running": 0}
        watch = self
        remove, get_new = SingleTypeKVCacheManager._remove_blocks_in_range, BlockPool.get_new_blocks

        def _remove_blocks_in_range(self, request_id, first, last):
            before = [b.block_id for b in self.req_to_blocks.get(request_id, [])]
            remove(self, request_id, first, last)
            after = [b.block_id for b in self.req_to_blocks.get(request_id, [])]
            for old, new in zip(before, after, strict=False):
                if old != new:
                    watch.freed[old] = (self, request_id)
                    watch.stats["window_freed"] += 1

        def get_new_blocks(self, num_blocks):
            blocks = get_new(self, num_blocks)
            for b in blocks:
                owner = watch.freed.pop(b.block_id, None)
                if owner is not None:
                    watch.stats["reused"] += 1
                    watch.stats["reused_while_running"] += owner[1] in owner[0].req_to_blocks
            return blocks

        SingleTypeKVCacheManager._remove_blocks_in_range = _remove_blocks_in_range
        BlockPool.get_new_blocks = get_new_blocks


def _facts(llm) -> dict:
    """The worker's attention groups: backend, spec class, freed window and the planner's counts."""

    def groups(worker):
        out = []
        for per_kv in worker.model_runner.attn_groups:
            for g in per_kv:
                builder = g.metadata_builders[0]
                planner = getattr(builder, "planner", None)
                stats = dict(planner.stats) if planner is not None else None
                window = getattr(builder, "window", None)  # where vLLM frees the group's blocks before its window
                out.append([g.backend.__name__, type(g.kv_cache_spec).__name__, window, stats])
        return out

    return {"groups": llm.collective_rpc(groups)[0], "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}


def kvarn_rows(llm, ids: list[list[int]], watch: _BlockWatch, base: list[list[int]] | None) -> dict:
    """A KVarN engine's results on prompts ``ids``: the batch's tokens, the window blocks vLLM freed and handed on
    meanwhile, its attention groups, each long prompt alone, the last one again (a prefix hit), and the
    teacher-forced agreement with the unquantized engine's tokens ``base`` where given."""
    from vllm import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    before = dict(watch.stats)
    row = {"tokens": _generate(llm, prompts, MAX_TOKENS)[0]}
    row["blocks_watch"] = {k: v - before[k] for k, v in watch.stats.items()}
    row["facts"] = _facts(llm)
    row["alone"] = [_generate(llm, [p], MAX_TOKENS)[0][0] for p in prompts[len(SHORT) :]]
    again, outs = _generate(llm, prompts[-1:], MAX_TOKENS)  # the last one again: a prefix hit
    row["again"], row["num_cached_tokens"] = again[0], outs[0].num_cached_tokens
    if base is not None:
        row["teacher_forced_top1"] = _teacher_forced(llm, ids[len(SHORT) :], base[len(SHORT) :])
    return row


def run_scenarios(out_path: str, models_dir: str) -> None:
    """The child process: each model's unquantized and KVarN engines, results as JSON at ``out_path``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, TokensPrompt

    watch = _BlockWatch()
    t_start = time.time()
    args = {
        "enforce_eager": True,
        "seed": 0,
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_model_len": 1024,
        "max_num_batched_tokens": 160,
    }
    ids = _prompts()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    results = {}
    for kind in WINDOWED:
        model = str(pathlib.Path(models_dir) / kind)
        row: dict = {}
        base = {"kv_cache_memory_bytes": 16 * 2**20, "enable_prefix_caching": False}
        llm = LLM(model=model, kv_cache_dtype="auto", **base, **args)
        row["base"], _ = _generate(llm, prompts, MAX_TOKENS)
        _shutdown(llm)
        t0 = time.time()
        # about 50 blocks: the eight requests need some 80 at once, so they queue and take each other's freed blocks
        llm = LLM(
            model=model, kv_cache_dtype=PRESET, kv_cache_memory_bytes=int(1.3 * 2**20), **args
        )  # prefix caching on
        row.update(kvarn_rows(llm, ids, watch, row["base"]))
        row["seconds"] = time.time() - t0
        _shutdown(llm)
        if kind == "gemma3":  # the sink lives by the first tile's block: window layers get full-attention pages
            llm = LLM(model=model, kv_cache_dtype=PRESET + "_sink", kv_cache_memory_bytes=4 * 2**20, **args)
            row["sink"] = {"tokens": _generate(llm, prompts, MAX_TOKENS)[0], "facts": _facts(llm)}
            row["sink"]["teacher_forced_top1"] = _teacher_forced(llm, ids[len(SHORT) :], row["base"][len(SHORT) :])
            _shutdown(llm)
        if kind in TAIL_BLOCK_KINDS:  # tails in vLLM's blocks, which follow a request's last tile past its window
            os.environ["KVARN_TAIL_BLOCKS"] = "1"
            try:
                llm = LLM(model=model, kv_cache_dtype=PRESET, kv_cache_memory_bytes=int(1.6 * 2**20), **args)
                before = dict(watch.stats)
                row["tail_blocks_tokens"] = _generate(llm, prompts, MAX_TOKENS)[0]
                row["tail_blocks_watch"] = {k: v - before[k] for k, v in watch.stats.items()}
                row["tail_blocks_facts"] = _facts(llm)
                _shutdown(llm)
            finally:
                del os.environ["KVARN_TAIL_BLOCKS"]
        results[kind] = row
    results["seconds"] = time.time() - t_start
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    models = tmp_path_factory.mktemp("windowed")
    for kind in WINDOWED:
        build_tiny_windowed(models / kind, kind)
    out = tmp_path_factory.mktemp("window") / "results.json"
    cmd = [sys.executable, __file__, str(out), str(models)]
    return run_child(cmd, out, tmp_path_factory.getbasetemp() / "window.log")


@pytest.mark.parametrize("kind", WINDOWED)
def test_window_layers_are_quantized_and_follow_the_unquantized_engine(results, kind):
    row = results[kind]
    short = len(SHORT)
    assert row["tokens"][:short] == row["base"][:short], "inside the first tile attention reads full precision"
    assert all(len(t) == MAX_TOKENS for t in row["tokens"])
    assert row["alone"] == row["tokens"][short:], "a request's tokens do not depend on the others of its batch"
    assert row["again"] == row["tokens"][-1] and row["num_cached_tokens"] == 640, "a hit on whole tiles"
    # measured 1.0 (Gemma 3), 0.917 (Granite) and 0.833 (GPT-OSS); 0.875, 0.5 and 0.479 without the window
    assert row["teacher_forced_top1"] >= FLOORS[kind], row["teacher_forced_top1"]
    served = PRESET + "_ks" * (kind == "gpt_oss")  # biased projections: keys smoothed per sequence
    kvarn = [g for g in row["facts"]["groups"] if g[0] == f"KVarNBackend_{served.removeprefix('kvarn_')}"]
    assert len(kvarn) == len(row["facts"]["groups"]), "every layer, window or global, is served by KVarN"
    windowed = [g for g in kvarn if g[1] == "SlidingWindowSpec"]
    # a _ks window group keeps one tile more, whose record its stores read the smoothing vector from
    assert windowed and all(g[2] == WINDOW + 128 * (kind == "gpt_oss") for g in windowed), kvarn
    assert any(g[1] == "FullAttentionSpec" and g[2] is None for g in kvarn), kvarn
    for group in kvarn:
        assert group[3]["committed_tiles"] > 0 and group[3]["stored_tiles"] > 0, group
    assert "2 of the 4 layers have a sliding window" in results["log"]
    watch = row["blocks_watch"]
    assert watch["window_freed"] >= 6 and watch["reused_while_running"] >= 4, watch


def test_a_sink_dtype_serves_window_layers_in_full_attention_pages(results):
    """``kvarn_..._sink`` keeps each first tile by its block, which vLLM would free under a window: the window layers
    get full-attention pages instead of a refusal, the window applied in attention, the sink kept."""
    row = results["gemma3"]["sink"]
    short = len(SHORT)
    assert row["tokens"][:short] == results["gemma3"]["base"][:short]
    assert all(len(t) == MAX_TOKENS for t in row["tokens"])
    assert all(g[1] == "FullAttentionSpec" and g[2] is None for g in row["facts"]["groups"]), row["facts"]
    assert row["teacher_forced_top1"] >= FLOORS["gemma3"], row["teacher_forced_top1"]
    assert "full-attention pages in this run" in results["log"]


@pytest.mark.parametrize("kind", TAIL_BLOCK_KINDS)
def test_window_layers_keep_their_tails_in_vllms_blocks_with_the_pools_tokens(results, kind):
    """``KVARN_TAIL_BLOCKS=1``: the window groups get vLLM's window manager with the tail blocks, which frees the
    blocks before each window while the tail blocks after the last tile stay; the same tokens as the pool run."""
    row = results[kind]
    assert row["tail_blocks_tokens"] == row["tokens"]
    specs = [g[1] for g in row["tail_blocks_facts"]["groups"]]
    assert "KVarNTailSlidingWindowSpec" in specs and "KVarNTailFullAttentionSpec" in specs, specs
    assert row["tail_blocks_watch"]["window_freed"] >= 6, row["tail_blocks_watch"]


if __name__ == "__main__":
    run_scenarios(sys.argv[1], sys.argv[2])
