"""Tensor parallelism on vLLM's CPU engine (``scripts/vllm_tp_check.py``): TP=2 gives the tokens of TP=1.

About 2 minutes on two cores (each TP=2 engine starts two worker processes).

The plain and ``_ks`` presets on a tiny Llama whose 2 KV heads TP=2 splits and one whose single KV head it
replicates; every rank plans the same tiles from the same scheduler output with its local KV heads. A ``_sink``
dtype with TP=2 is refused, saying why.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "vllm_tp_check.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("tp") / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPT.parents[1]), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    log = tmp_path_factory.getbasetemp() / "tp.log"
    log.write_text(proc.stdout + proc.stderr)
    assert out.exists(), f"the TP check did not finish, log at {log}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    data = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in data.items() if k != "runs"}, indent=1))
    return data


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k4v2_g128_ks"])
@pytest.mark.parametrize("heads", [2, 1], ids=["split", "replicated"])
def test_two_ranks_give_the_tokens_of_one(results, preset, heads):
    key = f"kv{heads}/{preset}"
    one, two = results["runs"][f"{key}/tp1"], results["runs"][f"{key}/tp2"]
    assert two["tokens"] == one["tokens"]
    assert len(one["ranks"]) == 1 and len(two["ranks"]) == 2
    backend = f"KVarNBackend_{preset.removeprefix('kvarn_')}"
    assert all(rank["backends"] == [backend] for rank in one["ranks"] + two["ranks"])
    assert one["ranks"][0]["cache_shape"][1] == heads
    assert all(rank["cache_shape"][1] == 1 for rank in two["ranks"]), "each rank keeps one KV head"
    first, second = (rank["stats"] for rank in two["ranks"])
    assert first == second == one["ranks"][0]["stats"], "every rank plans the same tiles"
    assert first["committed_tiles"] > 0 and first["chunks_starting_inside_a_tile"] > 0, first


def test_a_sink_dtype_is_refused_under_tensor_parallelism_saying_why(results):
    refused = results["sink_refusal"]
    assert refused is not None and "--kv-cache-dtype kvarn_k4v2_g128_sink" in refused
    assert "block pool" in refused and "2 workers (tensor or pipeline parallelism)" in refused
    assert "--kv-cache-dtype kvarn_k4v2_g128)" in refused
