"""End to end: hybrid (Mamba/conv + attention) models on vLLM's CPU engine with ``kv_cache_dtype="kvarn_*"``.

The attention layers are quantized with KVarN and the Mamba/conv layers keep their state as vLLM keeps it,
in pages of vLLM's hybrid allocator (one block pool for every KV-cache group). Two tiny random float32 models
(:func:`tiny_model.build_tiny_hybrid`, no download):

- ``Lfm2ForCausalLM`` (short conv + attention): blocks of one tile. Its greedy tokens equal the unquantized
  engine's while a sequence stays inside its first tile, whose attention reads its tokens in full precision;
  beyond, the engine ranks the unquantized tokens first at most positions (teacher-forced). Tails in vLLM's
  blocks (``KVARN_TAIL_BLOCKS=1``) give the pool's tokens exactly, with the last decode step of an attention
  layer held to kvarn's reference over the cache it left.
- ``NemotronHForCausalLM`` (Mamba2 + attention): vLLM raises the block size to 640 tokens (five tiles) so a
  page holds the Mamba state, after kvarn's start-up check set it to one tile, and gives each of the two
  attention layers a KV-cache group of its own. The same token checks, and a prefix hit (on a block boundary)
  gives the same tokens; tails in blocks are refused there, with the reason; the capacity line counts 640-token
  blocks and both layers. Each request's tokens are the same alone as in its batch, as the unquantized
  engine's are: vLLM's CPU runner zeroed one tile of another block, a Mamba layer's state among them, for each
  new block of several tiles (:func:`kvarn.integration.vllm.hooks.install_zeroing_hook`), and a 60-token
  request changed with the requests beside it.

The engines run in one child process (``python tests/test_vllm_hybrid.py OUT.json DIR``), as in
``tests/test_vllm_e2e.py``.
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
from tiny_model import HYBRIDS, build_tiny_hybrid

PRESET = "kvarn_k4v2_g128"
MAX_TOKENS = 24
SHORT = (40, 60, 80, 100)
"""Prompt lengths whose sequences (with ``MAX_TOKENS``) stay inside the first 128-token tile."""
LONG = (200, 300, 450, 700)
"""Prompt lengths whose sequences cross tiles (700 > one 640-token block of the Mamba hybrid)."""
PROBE_LAYER = "model.layers.3.self_attn.attn"
"""Lfm2's second attention layer, whose last decode step with tails in blocks is held to the reference."""


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in SHORT + LONG]


def _facts(llm) -> dict:
    """The worker's attention groups (backend, kernel block, planner counts) and vLLM's block size and count."""

    def groups(worker):
        out = []
        for per_kv in worker.model_runner.attn_groups:
            for g in per_kv:
                planner = getattr(g.metadata_builders[0], "planner", None)
                stats = dict(planner.stats) if planner is not None else None
                block = getattr(g, "kernel_block_size", None)  # vLLM 0.26's groups do not name it
                out.append([g.backend.__name__, type(g.kv_cache_spec).__name__, block, stats])
        return out

    cache = llm.llm_engine.vllm_config.cache_config
    return {"groups": llm.collective_rpc(groups)[0], "block_size": cache.block_size, "blocks": cache.num_gpu_blocks}


def kvarn_rows(llm, ids: list[list[int]], base: list[list[int]] | None, prefix_caching: bool, alone: bool) -> dict:
    """A KVarN engine's results on prompts ``ids``: the batch's tokens, each request alone (with ``alone``), the
    teacher-forced agreement with the unquantized engine's tokens ``base`` where given, the longest prompt again
    (a prefix hit, with ``prefix_caching``), and its attention groups."""
    from vllm import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    row = {"tokens": _generate(llm, prompts, MAX_TOKENS)[0]}
    if alone:
        row["alone"] = [_generate(llm, [p], MAX_TOKENS)[0][0] for p in prompts]
    if base is not None:
        row["teacher_forced_top1"] = _teacher_forced(llm, ids[len(SHORT) :], base[len(SHORT) :])
    if prefix_caching:
        again, outs = _generate(llm, prompts[-1:], MAX_TOKENS)  # the longest prompt again: a prefix hit
        row["again"], row["num_cached_tokens"] = again[0], outs[0].num_cached_tokens
    row["facts"] = _facts(llm)
    return row


def _model_rows(llm_cls, models_dir: str, kind: str, args: dict, ids: list[list[int]]) -> dict:
    """One hybrid model: the unquantized engine, then KVarN (chunks of 96 tokens), then KVarN with
    ``KVARN_TAIL_BLOCKS=1`` (its tokens and probe where built, else the refusal)."""
    from vllm import TokensPrompt

    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV
    from kvarn.integration.vllm.state import serving

    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    model_dir = str(pathlib.Path(models_dir) / kind)
    row: dict = {}
    llm = llm_cls(model=model_dir, kv_cache_dtype="auto", **args)
    row["base"], _ = _generate(llm, prompts, MAX_TOKENS)
    row["base_facts"] = _facts(llm)
    _shutdown(llm)

    t0 = time.time()
    llm = llm_cls(model=model_dir, kv_cache_dtype=PRESET, **args)
    # vLLM's own Lfm2 engine on CPU gives a request other tokens alone than in a batch
    row.update(kvarn_rows(llm, ids, row["base"], args["enable_prefix_caching"], alone=kind == "nemotron_h"))
    row["seconds"] = time.time() - t0
    _shutdown(llm)

    os.environ[TAIL_BLOCKS_ENV] = "1"
    serving.probe.layer = PROBE_LAYER
    serving.probe.reset()
    try:
        llm = llm_cls(model=model_dir, kv_cache_dtype=PRESET, **args)
        row["tail_blocks"], _ = _generate(llm, prompts, MAX_TOKENS)
        row["tail_blocks_facts"] = _facts(llm)
        row["probe"] = serving.probe.check()  # the last step: a decode of the longest prompt
        _shutdown(llm)
    except ValueError as exc:
        if kind == "lfm2":  # built there
            raise
        row["tail_blocks_refused"] = str(exc)
    finally:
        del os.environ[TAIL_BLOCKS_ENV]
        serving.probe.layer = None
        serving.probe.reset()
    return row


def run_scenarios(out_path: str, models_dir: str) -> None:
    """The child process: each model's engines in turn, results as JSON at ``out_path``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    t_start = time.time()
    args = {
        "enforce_eager": True,
        "seed": 0,
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 16 * 2**20,
        "max_num_batched_tokens": 96,
    }
    ids = _prompts()
    results = {}
    for kind in HYBRIDS:
        # vLLM's own Lfm2 engine on CPU gives a request other tokens alone than among others (0.5-1.0 in a token's
        # log-probability, kvarn or not), which makes its prefix-hit tokens no check of kvarn: those are NemotronH's
        caching = {"enable_prefix_caching": kind == "nemotron_h"}
        results[kind] = _model_rows(LLM, models_dir, kind, {**args, **caching}, ids)
    results["seconds"] = time.time() - t_start
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    models = tmp_path_factory.mktemp("hybrids")
    for kind in HYBRIDS:
        build_tiny_hybrid(models / kind, kind)
    out = tmp_path_factory.mktemp("hybrid") / "results.json"
    cmd = [sys.executable, __file__, str(out), str(models)]
    return run_child(cmd, out, tmp_path_factory.getbasetemp() / "hybrid.log")


def _check_tokens(row: dict) -> None:
    short = len(SHORT)
    assert row["tokens"][:short] == row["base"][:short], "inside the first tile attention reads full precision"
    if "alone" in row:  # as the unquantized engine's, each request's tokens do not depend on the others of its batch
        assert row["alone"] == row["tokens"]
    assert all(len(t) == MAX_TOKENS for t in row["tokens"])
    # measured 0.885 (Lfm2) and 0.927 (NemotronH) over the long prompts' 96 positions
    assert row["teacher_forced_top1"] >= 0.8, row["teacher_forced_top1"]


def _kvarn_groups(facts: dict) -> list:
    return [g for g in facts["groups"] if g[0] == f"KVarNBackend_{PRESET.removeprefix('kvarn_')}"]


def test_a_conv_hybrid_quantizes_its_attention_layers_in_blocks_of_one_tile(results):
    row = results["lfm2"]
    _check_tokens(row)
    assert row["facts"]["block_size"] == 128
    names = sorted(g[0] for g in row["facts"]["groups"])
    assert names == ["KVarNBackend_k4v2_g128", "ShortConvAttentionBackend"], "the conv layers keep vLLM's backend"
    (group,) = _kvarn_groups(row["facts"])
    assert group[3]["committed_tiles"] > 0 and group[3]["released_tails"] > 0, group


def test_a_conv_hybrid_keeps_its_tails_in_vllm_blocks_as_in_the_pool(results):
    """``KVARN_TAIL_BLOCKS=1``: the tail spec and its manager in vLLM's hybrid allocator next to the conv state's
    group; the pool run's tokens exactly, and the last decode step of an attention layer equal to kvarn's
    reference over the cache it left."""
    row = results["lfm2"]
    assert row["tail_blocks"] == row["tokens"]
    (group,) = _kvarn_groups(row["tail_blocks_facts"])
    assert group[1] == "KVarNTailFullAttentionSpec"
    probe = row["probe"]
    assert probe["probed"] and probe["last_step_was_decode"] and probe["seq_lens_match_build"], probe
    assert probe["dtype"] == "float32" and probe["rel_err"] <= 1e-5, probe


def test_a_mamba_hybrid_quantizes_its_attention_layers_in_blocks_of_several_tiles(results):
    row = results["nemotron_h"]
    _check_tokens(row)
    facts = row["facts"]
    assert facts["block_size"] == 640, "vLLM raised the block size so that a page holds the Mamba state"
    assert row["num_cached_tokens"] == 640 and row["again"] == row["tokens"][-1], "a prefix hit ends on a block"
    kvarn = _kvarn_groups(facts)
    assert len(kvarn) == 2 and all(g[2] == 128 for g in kvarn), "two groups, blocks split into tiles"
    assert sorted({g[0] for g in facts["groups"]} - {kvarn[0][0]}) == ["Mamba2AttentionBackend"]
    for group in kvarn:
        assert group[3]["committed_tiles"] > 0 and group[3]["released_tails"] > 0, group
    blocks = facts["blocks"]
    line = f"KVarN {PRESET} KV cache: {blocks} blocks of 640 tokens = {blocks * 640 // 2} tokens"
    assert line in results["log"] and "(2 layers, 2 KV heads" in results["log"]
    assert "the state of 1 Mamba/conv layer," in results["log"]
    refused = row["tail_blocks_refused"]
    assert "KVARN_TAIL_BLOCKS=1" in refused and "not 640" in refused and "Mamba layer's state" in refused


if __name__ == "__main__":
    run_scenarios(sys.argv[1], sys.argv[2])
