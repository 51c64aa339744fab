"""Sliding windows, speculative decoding and a hybrid model on vLLM's GPU engine (``pytest -m gpu``).

``scripts/vllm_gpu_shapes.py`` runs the engines (the tiny random models of the CPU suite's engine tests, under
vLLM's default compilation with CUDA graphs) in a child process; these tests hold its results to the checks of
``test_vllm_window.py``, ``test_vllm_spec_e2e.py`` and ``test_vllm_hybrid.py``, and the window model's KVarN
engine with CUDA graphs to the same engine without them. The models run in bfloat16, where greedy tokens are
compared only inside the first tile (attention reads it in full precision) and by teacher-forced agreement
beyond; speculative decoding runs in float32, where its tokens must equal those without drafts.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "vllm_gpu_shapes.py"
WINDOW_FLOORS = {"gemma3": 0.9, "granite_swa": 0.8}
"""Teacher-forced top-1 agreement with the unquantized engine over the long prompts' continuations (measured on
an H100 with vLLM 0.26: Gemma 3 0.990; 0.875 on the CPU engine without the window)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    from test_vllm_e2e import run_child

    folder = tmp_path_factory.mktemp("gpu_shapes")
    out = folder / "results.json"
    data = run_child([sys.executable, str(SCRIPT), str(out)], out, folder / "gpu_shapes.log", timeout=1800)
    assert not data["errors"], data["errors"]
    return data


def _graphs(row: dict) -> bool:
    return row["mode"].rsplit(".", 1)[-1] != "NONE"


def _kvarn_backend(preset: str) -> str:
    return f"KVarNBackend_{preset.removeprefix('kvarn_')}"


@pytest.mark.parametrize("kind", sorted(WINDOW_FLOORS))
def test_window_layers_under_cuda_graphs(results, kind):
    from test_vllm_window import MAX_TOKENS, PRESET, SHORT, WINDOW

    if kind in results.get("skipped", {}):
        pytest.skip(results["skipped"][kind])
    window = results["window"]
    base, graphs, plain = (window[f"{kind}_{name}"] for name in ("auto", "graphs", "no_graphs"))
    assert _graphs(graphs) and not _graphs(plain), (graphs["mode"], plain["mode"])
    assert graphs["tokens"] == plain["tokens"], "the captured steps compute what the uncaptured ones do"
    short = len(SHORT)
    assert graphs["tokens"][:short] == base["tokens"][:short], "inside the first tile attention reads full precision"
    assert all(len(t) == MAX_TOKENS for t in graphs["tokens"])
    assert graphs["alone"] == graphs["tokens"][short:], "a request's tokens do not depend on the others of its batch"
    assert graphs["again"] == graphs["tokens"][-1] and graphs["num_cached_tokens"] == 640, "a hit on whole tiles"
    assert graphs["teacher_forced_top1"] >= WINDOW_FLOORS[kind], graphs["teacher_forced_top1"]
    groups = graphs["facts"]["groups"]
    assert all(g[0] == _kvarn_backend(PRESET) for g in groups), "every layer, window or global, is KVarN's"
    windowed = [g for g in groups if "SlidingWindow" in g[1] or "WindowPage" in g[1]]
    if windowed:  # vLLM frees the blocks a window leaves (0.32 and later; 0.26 with KVarN's window pages)
        assert all(g[2] == WINDOW for g in windowed), groups
        watch = graphs["blocks_watch"]
        assert watch["window_freed"] >= 6 and watch["reused_while_running"] >= 4, watch
    else:  # full-attention pages for every layer, the window applied in attention
        assert graphs["blocks_watch"]["window_freed"] == 0
        assert any(g[1].endswith("FullAttentionSpec") for g in groups), groups


def _drafted(results: dict, scenario: str) -> tuple[dict, dict]:
    """A speculative scenario's KVarN engine with drafts and vLLM's own with the same drafts, after what both
    scenarios hold: graphs, every token generated, the tokens of KVarN without drafts, again from prefix hits."""
    from test_vllm_spec_e2e import MAX_TOKENS

    spec = results[scenario]
    plain, drafted, base_drafted = (spec[n] for n in ("kvarn", "kvarn_spec", "auto_spec"))
    assert _graphs(plain) and _graphs(drafted), (plain["mode"], drafted["mode"])
    assert all(len(t) == MAX_TOKENS for t in drafted["tokens"])
    assert drafted["tokens"] == plain["tokens"], "drafts verified and rolled back give the tokens without drafts"
    assert drafted["again"] == drafted["tokens"] and max(drafted["num_cached_tokens"]) >= 128, "prefix hits"
    return drafted, base_drafted


def test_speculative_decoding_under_cuda_graphs(results):
    from test_vllm_spec_e2e import PRESET

    drafted, base_drafted = _drafted(results, "spec")
    assert drafted["preemptions"] > 0, "the KV budget was meant to force preemption"
    stats = drafted["facts"]["stats"]
    assert stats.get("verified_tails", 0) > 0 and stats.get("reopened_tails", 0) > 0, stats
    assert drafted["facts"]["backends"] == [_kvarn_backend(PRESET)]
    for counts in (drafted["spec"], base_drafted["spec"]):
        assert counts["drafts"] > 0 and 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts
    # the two caches' token streams differ (vLLM's own engine gives other tokens with drafts than without, even in
    # float32), so the rates are compared loosely: measured 0.76 (KVarN) and 0.59 (vLLM's cache) on an H100
    rate, base_rate = (c["spec"]["accepted_tokens"] / c["spec"]["draft_tokens"] for c in (drafted, base_drafted))
    assert rate >= base_rate - 0.1, (rate, base_rate)


def test_a_draft_models_layers_in_the_kvarn_cache_under_cuda_graphs(results):
    """vLLM's ``draft_model`` (the tiny Llama drafting for itself) with its layers in the KVarN cache, on the V1 GPU
    runner: the tokens without drafts, and its drafts (the target's own greedy tokens where the draft layers' cache
    holds what the target's does) accepted as often as with vLLM's own cache."""
    from test_vllm_spec_e2e import PRESET

    drafted, base_drafted = _drafted(results, "draft")
    assert drafted["draft_facts"]["backends"] == [_kvarn_backend(PRESET)], "the draft layers are KVarN's"
    stats = drafted["draft_facts"]["stats"]
    assert stats.get("reopened_tails", 0) > 0 and stats.get("evicted_tails", 0) == 0, stats
    rate, base_rate = (c["spec"]["accepted_tokens"] / c["spec"]["draft_tokens"] for c in (drafted, base_drafted))
    assert base_rate > 0.95 and rate >= base_rate - 0.03, (rate, base_rate)


def test_a_conv_hybrid_under_cuda_graphs(results):
    from test_vllm_hybrid import MAX_TOKENS, PRESET, SHORT

    base, row = results["hybrid"]["lfm2_auto"], results["hybrid"]["lfm2_kvarn"]
    assert _graphs(row), row["mode"]
    short = len(SHORT)
    assert row["tokens"][:short] == base["tokens"][:short], "inside the first tile attention reads full precision"
    assert all(len(t) == MAX_TOKENS for t in row["tokens"])
    assert row["alone"] == row["tokens"], "a request's tokens do not depend on the others of its batch"
    assert row["teacher_forced_top1"] >= 0.85, row["teacher_forced_top1"]  # measured 0.927 on an H100
    kvarn = [g for g in row["facts"]["groups"] if g[0] == _kvarn_backend(PRESET)]
    assert len(kvarn) == 1 and kvarn[0][3]["committed_tiles"] > 0, row["facts"]
    assert row["facts"]["block_size"] == 128
