"""``benchmarks/results_page.py``: RESULTS.md is what the script makes of ``benchmarks/results/``, and the script
reads every schema it knows, takes the newest file per area and skips what it does not know (no GPU, stdlib only)."""

import json

from benchmarks import results_page as rp


def test_committed_page_is_the_generated_page():
    # Regenerate with `python benchmarks/results_page.py --write` after adding or changing a results file.
    assert rp.PAGE.read_text() == rp.render(rp.RESULTS)


def _decode_run(commit, us):
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "commit": commit}
    row = {"preset": "kvarn_k4v2_g128", "d": 128, "hq": 32, "hkv": 8, "batch": 16, "ctx": 32768}
    return {"env": env, "grid": [row | {"dtype": "float16", "kvarn_us": us, "sdpa_us": 3 * us}]}


def _vllm(dtype, kv_tokens, tpot, **extra):
    rec = {"model": "llama3-8b", "kv_cache_dtype": dtype, "kv_budget": "gpu_memory_utilization 0.9"}
    return rec | {"kv_tokens": kv_tokens, "prefill_16k_tok_s": 30000, "tpot_ms_b8_ctx4096": tpot} | extra


def _write(tmp_path, name, data):
    (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))


def test_a_synthetic_results_dir(tmp_path):
    _write(tmp_path, "2026-01-02-h100-decode.json", _decode_run("aaaaaaa", 100.0))
    # Newer by the number in its name (10 sorts after 9), nested one level deep as device-call records are.
    _write(tmp_path, "2026-01-03-h100-run10.json", {"call1": _decode_run("bbbbbbb", 50.0)})
    _write(tmp_path, "2026-01-03-h100-run9.json", {"call1": _decode_run("ccccccc", 80.0)})
    store_row = {"preset": "kvarn_k2v2_g128", "d": 128, "dtype": "float16", "store_GBps": 95.5, "store_us": 5000.0}
    _write(tmp_path, "2026-01-03-h100-store.json", {"env": {"gpu": "NVIDIA H100"}, "rows": [store_row]})
    serving = {
        "gpu": "NVIDIA H100",
        "vllm": "0.26.0",
        "calls": {
            "bf16": _vllm("auto", 1000, 10.0),
            "kvarn": _vllm("kvarn_k4v2_g128", 4720, 5.0, cap_requests=40, cap_decode_tok_s=900, cap_out_tok_s=90),
            "other_budget": _vllm("kvarn_k4v2_g128", 10, 1.0) | {"kv_budget": "20 GiB"},
        },
    }
    _write(tmp_path, "2026-01-04-h100-serving.json", serving)
    _write(tmp_path, "2026-01-05-h100-serving.json", {"bf16": _vllm("auto", 1000, 10.0, cap_decode_tok_s=300)})
    held = {"model": "gemma3-12b", "kv_budget": "gpu_memory_utilization 0.9", "kv_tokens": 1}
    runs = {"auto": held | {"kv_cache_dtype": "auto", "max_requests_ctx32768": 3.89}}
    runs["kvarn"] = held | {"kv_cache_dtype": "kvarn_k4v2_g128", "max_requests_ctx32768": 18.27}
    _write(tmp_path, "2026-01-05-h100-held.json", {"gpu": "NVIDIA H100", "runs": runs})
    smooth = {"preset": "kvarn_k4v2_g128", "d": 128, "batch": 16, "ctx": 32768, "kvarn_us": 180.0, "sdpa_us": 720.0}
    smooth |= {"smoothed_us": 630.0, "seq_smoothed_us": 198.0}
    _write(tmp_path, "2026-01-05-h100-smooth.json", {"env": {"gpu": "NVIDIA H100"}, "rows": [smooth]})
    spec = {"model": "llama3-8b", "kv_cache_dtype": "kvarn_k4v2_g128", "batch": 1, "ctx": 4096, "vllm": "0.26.0"}
    spec["drafts"] = {"method": "ngram", "num_speculative_tokens": 3}
    counts = {"vllm:spec_decode_num_draft_tokens": 30, "vllm:spec_decode_num_accepted_tokens": 27}
    spec["engines"] = {
        "default": {"tpot_ms": 7.0, "tpot_range": [6.9, 7.1]},
        "v1_drafts": {"tpot_ms": 5.6, "tpot_range": [5.5, 5.8], "spec_counts": counts},
    }
    _write(tmp_path, "2026-01-05-h100-spec.json", spec)
    e2e = {"meta": {"gpu": "NVIDIA H100", "transformers": "5.17.0", "date": "2026-01-06"}, "rows": []}
    e2e["rows"] = [{"cache": "kvarn", "batch": 70, "context": 16384, "tokens_per_s": 749.1, "vs_fp16": 5.3}]
    _write(tmp_path, "2026-01-06-h100-e2e.json", e2e)
    feed = {"meta": {"gpu": "NVIDIA H100", "transformers": "5.17.0", "chunk": 2048}, "ok": True, "rows": []}
    row = {"shape": "smollm2-135m", "tokens": 8192, "cache": "kvarn_k4v2_g128", "chunked_prompt_s": 0.2}
    row |= {"chunked_token_ms": 30.0, "tile_prompt_s": 2.0, "tile_token_ms": 29.0, "max_abs_dlogp": 0.01}
    feed["rows"] = [row]
    _write(tmp_path, "2026-01-06-h100-feed.json", feed)
    _write(tmp_path, "2026-01-06-h100-feed-failed.json", feed | {"ok": False})  # a run that refused to report
    _write(tmp_path, "2026-01-07-h100-broken.json", "{not json")
    _write(tmp_path, "2026-01-07-h100-unknown.json", [{"rows": [1, 2]}, {"grid": "x", "env": 3}, None])
    _write(tmp_path, "notes.json", {})
    bad = _decode_run("ddddddd", 1.0)
    bad["grid"][0]["kvarn_us"] = "fast"
    _write(tmp_path, "2026-01-08-h100-bad-grid.json", bad)

    page = rp.render(tmp_path)

    assert "50.0 µs, 3.00x" in page and "commit bbbbbbb" in page  # the newest decode grid, run10 after run9
    assert "80.0 µs" not in page and "100.0 µs" not in page
    assert "| k2v2_g128 | 128 | float16 | no |" in page and "95.5" in page
    assert "4,720 (4.72x)" in page and "5.00 (0.50x)" in page  # capacity and TPOT against bf16's
    assert "| requests held at once |  | 40 |" in page  # bf16 has no such figure: no ratio
    assert "900 (3.00x)" in page and "2026-01-05 [1]" in page
    assert "20 GiB: no bf16 run" in page
    assert "| requests of 32K tokens held at once | 3.89 | 18.27 (4.70x) |" in page
    assert "| kvarn | 70 | 16K |" in page and "5.30x" in page and "2026-01-06: NVIDIA H100" in page
    assert "| k4v2_g128 | 128 | 16 | 32K | 180.0 | 198.0 (1.10x) | 630.0 (3.50x) | 4.00x |" in page
    assert "| V1 runner, drafts | 5.60 (0.80x) | 5.50 - 5.80 | 27 of 30 |" in page and "vLLM 0.26.0" in page
    assert "| smollm2-135m | 8K | kvarn_k4v2_g128 | 2.00 | 0.20 (0.10x) | 29.0 | 30.0 | 0.0100 |" in page
    assert "then 2048-token chunks" in page and "`2026-01-06-h100-feed-failed.json`" in page.split("## Files not")[1]
    assert "`2026-01-07-h100-broken.json`: not JSON" in page
    assert "`notes.json`: no date" in page
    assert "`2026-01-07-h100-unknown.json`" in page.split("## Files not shown")[1]
    assert "`2026-01-08-h100-bad-grid.json`, the whole file: not read as a decode run" in page  # run10 shown instead


def test_an_empty_dir_gives_a_page_without_tables(tmp_path):
    page = rp.render(tmp_path)
    assert page.startswith("# Benchmark results") and "|" not in page


def test_the_script_writes_to_stdout(tmp_path, capsys):
    _write(tmp_path, "2026-01-02-h100-decode.json", _decode_run("aaaaaaa", 100.0))
    assert rp.main(["--results", str(tmp_path)]) == 0
    assert capsys.readouterr().out == rp.render(tmp_path)


def _task_run(task, lengths, acc, extra="", device="--device cuda "):
    command = f"kvarn report --task {task} --model smollm2-135m {device}--methods kvarn_k4v2_g128 {extra}--samples 50"
    summary = []
    for n in lengths:
        summary.append({"label": "exact", "length": n, "n": 50, "accuracy": 0.9, "agreement": 1.0})
        summary.append({"label": "kvarn_k4v2_g128 [tail]", "length": n, "n": 50, "accuracy": acc, "recall": acc / 2})
    return {"command": command, "summary": summary}


def test_long_context_records_merge_by_cell_newest_first(tmp_path):
    env = {"gpu": "NVIDIA H100", "torch": "2.11.0", "commit": "aaaaaaa"}
    _write(tmp_path, "2026-01-02-h100-niah.json", env | {"runs": [_task_run("niah", [1024, 2048], 0.5)]})
    _write(tmp_path, "2026-01-03-h100-niah.json", env | {"runs": [_task_run("niah", [2048], 0.7)]})
    _write(tmp_path, "2026-01-04-h100-niah-seed.json", env | {"r": _task_run("niah", [1024], 0.1, "--seed 3 ")})
    more = _task_run("niah", [1024], 0.3)
    for row in more["summary"]:
        row["n"] = 200
    _write(tmp_path, "2026-01-04-h100-niah-200.json", env | {"r": more})
    _write(tmp_path, "2026-01-04-cpu-vartrack.json", {"r": _task_run("vartrack", [1024], 0.25, device="")})
    drift = {"label": "kvarn_k4v2_g128 [tail]", "kl_at": {"64": 0.02, "1024": 0.01}, "kl_mean": 0.015, "top1": 0.95}
    command = "kvarn report --task drift --model smollm2-135m --device cuda --samples 20"
    _write(tmp_path, "2026-01-05-h100-drift.json", env | {"r": {"command": command, "summary": [drift]}})
    page = rp.render(tmp_path)
    assert "## Long-context accuracy and drift" in page and "no records this page reads" not in page
    seed0 = page.split("### niah, smollm2-135m, 50 samples a length (--seed 0, --filler task default)")[1]
    seed0 = seed0.split("###")[0]
    assert "| kvarn_k4v2_g128 [tail] | 50% | 70% |" in seed0  # 2K from the newer file
    assert "2026-01-02-h100-niah.json" in seed0 and "2026-01-03-h100-niah.json" in seed0
    seed3 = page.split("### niah, smollm2-135m, 50 samples a length (--seed 3, --filler task default)")[1]
    seed3 = seed3.split("###")[0]
    assert "| kvarn_k4v2_g128 [tail] | 10% |" in seed3 and "2026-01-02" not in seed3
    vartrack = page.split("### vartrack, smollm2-135m")[1].split("###")[0]
    n200 = page.split("### niah, smollm2-135m, 200 samples a length (--seed 0")[1].split("###")[0]
    assert "| kvarn_k4v2_g128 [tail] | 30.0% |" in n200 and "2026-01-04-h100-niah-200.json" in n200
    assert "| kvarn_k4v2_g128 [tail] | 12.5% |" in vartrack and ": CPU, torch" in vartrack  # recall
    assert "### drift, smollm2-135m, 20 prefixes" in page
    assert "| kvarn_k4v2_g128 [tail] | 2.0e-02 | - | - | 1.0e-02 | 1.5e-02 | 95% |" in page
