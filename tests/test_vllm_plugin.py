"""Registration and selection: the kvarn plugin as vLLM loads it, without running a model."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.config.cache as cache_mod
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

import kvarn.integration.vllm as kv
from kvarn.config import (
    CACHE_DTYPES,
    PRESETS,
    cache_dtype_config,
    has_key_smoothing,
    has_sink,
    with_key_smoothing,
)
from kvarn.integration.vllm import checks, hooks, plugin
from kvarn.integration.vllm.registry import BACKENDS, backend_path
from kvarn.integration.vllm.state import serving

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    kv.register()
    assert kv.is_enabled(), kv.status()


def test_register_is_idempotent_and_every_preset_is_a_valid_cache_dtype():
    hooked = type(current_platform).get_attn_backend_cls
    kv.register()
    kv.register()
    assert type(current_platform).get_attn_backend_cls == hooked
    assert not hooks.install_selection_hook(current_platform, backend_path), "a second hook must not wrap the first"
    assert not hooks.install_config_hook(current_platform), "a second hook must not wrap the first"
    expected_mode = "registry" if hasattr(cache_mod, "register_kv_cache_dtype") else "literal"
    assert kv.status()["mode"] == expected_mode
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert set(CACHE_DTYPES) == {p + ks + sink for p in PRESETS for ks in ("", "_ks") for sink in ("", "_sink")}
    for preset in CACHE_DTYPES:
        assert CacheConfig(cache_dtype=preset).cache_dtype == preset
        assert STR_DTYPE_TO_TORCH_DTYPE[preset] is torch.uint8
        assert parser.parse_args(["--kv-cache-dtype", preset]).kv_cache_dtype == preset
    with pytest.raises(ValueError):
        CacheConfig(cache_dtype="kvarn_k3v3_g128")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "kvarn_k3v3_g128"])


@pytest.mark.parametrize("preset", list(CACHE_DTYPES))
def test_the_dtype_flag_alone_selects_the_preset_backend_and_its_block_size(preset):
    config = VllmConfig()
    if preset.endswith("_sink"):
        with set_current_vllm_config(config), pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
            get_attn_backend(64, torch.bfloat16, preset)  # vLLM's CPU default runs the worker in its own process
        config.parallel_config.distributed_executor_backend = "uni"
    with set_current_vllm_config(config):
        for head_size in (64, 128):
            assert get_attn_backend(head_size, torch.bfloat16, preset) is BACKENDS[preset]
        assert config.cache_config.block_size == checks.group_size(preset)
        assert BACKENDS[preset].sink == preset.endswith("_sink")
        other = get_attn_backend(64, torch.bfloat16, "auto")
    assert not issubclass(other, BACKENDS[preset]), "other dtypes go to the platform's own backend"


def _selector(**kw):
    base = {"head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "kvarn_k4v2_g128", "block_size": None}
    return AttentionSelectorConfig(**(base | kw))


@pytest.mark.parametrize(
    ("overrides", "advice"),
    [
        ({"use_mla": True}, "--kv-cache-dtype auto"),
        ({"has_sliding_window": True}, "--kv-cache-dtype-skip-layers sliding_window"),
        ({"attn_type": "encoder_only"}, "--kv-cache-dtype auto"),
        ({"attn_type": "encoder_decoder"}, "--kv-cache-dtype auto"),
        ({"head_size": 96}, "64, 128, 256"),
        ({"use_kv_connector": True}, "--kv-cache-dtype auto"),
        ({"has_sink": True}, "--kv-cache-dtype auto"),
    ],
)
def test_unservable_layers_are_refused_with_what_to_change(overrides, advice):
    with pytest.raises(ValueError, match="--kv-cache-dtype kvarn_k4v2_g128") as err:
        current_platform.get_attn_backend_cls(None, _selector(**overrides))
    assert advice in str(err.value)


def _run(block_size=128, user_block=False, unit=None, spec=None, dbo=False, dp=1):
    cache = SimpleNamespace(block_size=block_size, user_specified_block_size=user_block, prefix_match_unit=unit)
    parallel = SimpleNamespace(enable_dbo=dbo, data_parallel_size=dp)
    return SimpleNamespace(cache_config=cache, speculative_config=spec, parallel_config=parallel)


@pytest.mark.parametrize(
    ("run", "advice"),
    [
        (_run(block_size=192, user_block=True), "set it to 128"),
        (_run(unit=64), "multiple of 128"),
        (_run(spec=object()), "drop --speculative-config"),
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


def test_where_vllm_has_a_dtype_registry_the_handlers_go_through_it(monkeypatch):
    registered = {}

    def register_kv_cache_dtype(name):
        def decorate(cls):
            registered[name] = cls()
            STR_DTYPE_TO_TORCH_DTYPE[name] = registered[name].torch_dtype()
            return cls

        return decorate

    monkeypatch.setattr(cache_mod, "register_kv_cache_dtype", register_kv_cache_dtype, raising=False)
    literal_before = cache_mod.CacheDType
    for preset in CACHE_DTYPES:
        monkeypatch.delitem(STR_DTYPE_TO_TORCH_DTYPE, preset)
    assert hooks.install_dtypes() == "registry"
    assert cache_mod.CacheDType is literal_before, "the registry path leaves the Literal alone"
    assert set(registered) == set(CACHE_DTYPES)
    from vllm.v1.kv_cache_interface import KVQuantMode

    for preset, handler in registered.items():
        assert handler.name == preset
        assert handler.torch_dtype() is torch.uint8 and handler.is_quantized()
        assert isinstance(handler.quant_mode(), KVQuantMode)
        assert handler.supports_platform(current_platform)
    assert hooks.install_dtypes() == "registry"
    assert len(registered) == len(CACHE_DTYPES), "names already registered are not registered twice"


_ERROR_PATH = r"""
import json, logging, sys
import torch
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("vllm.kvarn").addHandler(Keep())
from kvarn.integration.vllm import hooks
def boom():
    raise RuntimeError("simulated failure while adding the dtype names")
hooks.install_dtypes = boom
import kvarn.integration.vllm as kv
kv.register()
kv.register()
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.platforms import current_platform
from vllm.v1.attention.selector import get_attn_backend
out = {"status": kv.status(), "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}
out["hook_left"] = any(
    getattr(getattr(type(current_platform), name), "_kvarn_wrapped", False)
    for name in ("get_attn_backend_cls", "check_and_update_config")
)
try:
    CacheConfig(cache_dtype="kvarn_k4v2_g128")
    out["kvarn_dtype"] = "accepted"
except Exception as exc:
    out["kvarn_dtype"] = type(exc).__name__
with set_current_vllm_config(VllmConfig()):
    out["auto_backend"] = get_attn_backend(64, torch.bfloat16, "auto").get_name()
out["auto_config"] = CacheConfig(cache_dtype="auto").cache_dtype
print("RESULT" + json.dumps(out))
"""


def test_platform_hooks_come_off_as_they_went_on():
    """A hook on a platform class that defines the method restores it; on one that inherits it, removes itself."""

    class Base:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            return ("base", cls.__name__)

        @classmethod
        def get_attn_backend_cls(cls, *args, **kwargs):
            return "platform backend"

    class Own(Base):
        @classmethod
        def check_and_update_config(cls, vllm_config):
            return ("own", cls.__name__)

    class Inherits(Base):
        pass

    config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    for cls, want in ((Own, ("own", "Own")), (Inherits, ("base", "Inherits"))):
        platform = cls()
        assert hooks.install_config_hook(platform) and hooks.install_selection_hook(platform, backend_path)
        assert not hooks.install_config_hook(platform)
        assert cls.check_and_update_config(config) == want  # not a KVarN dtype: passed through
        assert hooks._unwrap(platform, "check_and_update_config") and hooks.uninstall_selection_hook(platform)
        assert not hooks._unwrap(platform, "check_and_update_config")
        assert cls.check_and_update_config(config) == want
        assert ("check_and_update_config" in vars(cls)) == (cls is Own)
        assert "get_attn_backend_cls" not in vars(cls)
    assert Base.get_attn_backend_cls() == "platform backend"


def test_a_failing_plugin_warns_once_and_leaves_vllm_working_without_kvarn():
    proc = subprocess.run([sys.executable, "-c", _ERROR_PATH], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line.removeprefix("RESULT"))
    assert out["status"]["enabled"] is False
    assert "simulated failure" in out["status"]["error"]
    assert len(out["warnings"]) == 1 and "unavailable" in out["warnings"][0]
    assert out["hook_left"] is False
    assert out["kvarn_dtype"] == "ValidationError"
    assert out["auto_backend"] == "CPU_ATTN"
    assert out["auto_config"] == "auto"


def test_importing_the_integration_imports_neither_vllm_nor_transformers():
    code = (
        "import sys, kvarn.integration, kvarn.integration.vllm, kvarn.paged\n"
        "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


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


def test_where_the_backend_enum_takes_no_new_names_kvarn_registers_as_custom(monkeypatch):
    from vllm.v1.attention.backends import registry

    from kvarn.integration.vllm.backend import KVarNBackend

    calls = []

    def closed_register_backend(backend, class_path=None, is_mamba=False):
        calls.append(backend)
        if isinstance(backend, str):
            return lambda x: x  # 0.26 stores the string and never adds an enum member
        return lambda x: x

    enum = registry.AttentionBackendEnum
    members = {k: v for k, v in enum.__members__.items() if k != "KVARN"}
    closed = SimpleNamespace(__members__=members, CUSTOM=enum.CUSTOM)
    monkeypatch.setattr(registry, "register_backend", closed_register_backend)
    monkeypatch.setattr(registry, "AttentionBackendEnum", closed)
    monkeypatch.setattr(KVarNBackend, "registered_name", "KVARN")
    assert plugin.install_backend_name() == "CUSTOM"
    assert registry.AttentionBackendEnum.CUSTOM in calls
    assert BACKENDS["kvarn_k4v2_g128"].get_name() == "CUSTOM"


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


TINY = "kvarn_k4v2_g128"


@dataclass
class CacheDtype:
    cache_dtype: str


def test_the_config_hook_serves_a_biased_model_in_the_ks_form(tmp_path, monkeypatch):
    """vLLM builds the run's config: the platform hook has turned the dtype into ``_ks`` before any layer reads it."""
    pytest.importorskip("transformers")
    from tiny_model import build_tiny_model
    from vllm.config import ModelConfig

    monkeypatch.delenv(checks.KEY_SMOOTHING_ENV, raising=False)
    biased = build_tiny_model(tmp_path / "biased", attention_bias=True)

    def build():
        return VllmConfig(model_config=ModelConfig(model=str(biased)), cache_config=CacheConfig(cache_dtype=TINY))

    config = build()
    assert config.cache_config.cache_dtype == "kvarn_k4v2_g128_ks"
    config.parallel_config.distributed_executor_backend = "uni"
    with set_current_vllm_config(config):
        assert get_attn_backend(64, torch.bfloat16, config.cache_config.cache_dtype) is BACKENDS["kvarn_k4v2_g128_ks"]
    monkeypatch.setenv(checks.KEY_SMOOTHING_ENV, "off")
    assert build().cache_config.cache_dtype == TINY


def test_the_gpu_runner_hooks_hand_the_sink_rows_ids_and_scheduler_outputs(monkeypatch):
    """On vLLM's GPU runner (V2) the plugin wraps ``prepare_attn`` (rows, request ids) and ``execute_model``
    (each real step's scheduler output, before the original runs; dummy runs pass untouched)."""
    import sys
    import types
    import weakref

    import numpy as np

    from kvarn.integration.vllm.state import SinkBook
    from kvarn.paged import SinkSlots

    calls = []

    class Runner:
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=64), layer_names=["l0"])]
        )

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            calls.append(("execute", dict(serving.sink_book.first)))
            return "out"

    class ModelState:
        def prepare_attn(self, input_batch):
            calls.append(("prepare", serving.step_req_ids))

    runner_mod = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    runner_mod.GPUModelRunner = Runner
    state_mod = types.ModuleType("vllm.v1.worker.gpu.model_states.default")
    state_mod.DefaultModelState = ModelState
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.model_runner", runner_mod)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.model_states.default", state_mod)
    monkeypatch.setattr(serving, "rows_hooked", False)
    monkeypatch.setattr(serving, "scheduler_hooked", False)
    monkeypatch.setattr(serving, "sink_book", SinkBook())

    class Builder:  # a graph builder: the tiles its replayed steps filled are committed before the step runs
        def commit_replayed(self):
            calls.append(("commit", None))
            return 0

    builder = Builder()
    monkeypatch.setattr(serving, "graph_builders", weakref.WeakSet([builder]))
    sinks = SinkSlots(4, 64)
    serving.sink_book.pools.add(sinks)
    sinks.assign([(0, 9, 0)], 1)  # block 9 held a first tile before; the scheduler now hands it out fresh
    assert hooks.install_runner_hook() and serving.scheduler_hooked
    ModelState().prepare_attn(
        SimpleNamespace(idx_mapping_np=np.array([3]), query_start_loc_np=np.array([0, 5]), req_ids=["a"])
    )
    assert calls[-1] == ("prepare", ["a"])
    output = SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([4, 9],), num_computed_tokens=64)],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[]),
        num_scheduled_tokens={"a": 70},
    )
    assert Runner().execute_model(output) == "out"
    assert calls[-2] == ("commit", None)  # before vLLM's execute_model (its copy-on-write block copies)
    assert calls[-1] == ("execute", {"a": (4,)}) and sinks.live == {}  # block 9 (past the 64-token hit) is fresh
    assert serving.sink_book.group_of == {"l0": 0} and serving.sink_book.scheduled == {"a"}
    Runner().execute_model(SimpleNamespace(), None, True)  # a dummy run: not read
    output.finished_req_ids, output.scheduled_new_reqs = {"a"}, []
    Runner().execute_model(output)
    assert calls[-1] == ("execute", {})


def test_a_decode_batch_admitting_a_prefix_hit_is_not_replayed_from_the_full_graph(monkeypatch, caplog):
    """vLLM caches a block in the step that computes it, so a request admitted through a prefix hit into a
    single-token batch may read a tile that another row fills in that step; replayed from the full graph,
    the step commits that tile only at the next step. The plugin has vLLM dispatch such a step (and only
    such a step) as one of mixed query lengths: piecewise graphs or eager, whose forward commits first."""
    import sys
    import types
    import weakref

    from kvarn.integration.vllm.state import SinkBook

    class Manager:  # vLLM 0.26's ModelCudaGraphManager.dispatch: a full graph only for uniform batches
        def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
            return "FULL" if uniform_token_count == 1 else "PIECEWISE"

    class Runner:
        def __init__(self, manager):
            self.cudagraph_manager = manager

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            n = len(scheduler_output.num_scheduled_tokens)  # every step here has one token a request
            return self.cudagraph_manager.dispatch(n, n, 1, num_active_loras=0)

    runner_mod = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    runner_mod.GPUModelRunner = Runner
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.model_runner", runner_mod)
    monkeypatch.setattr(serving, "scheduler_hooked", False)
    monkeypatch.setattr(serving, "sink_book", SinkBook())

    class Builder:  # a CUDA-graph decode builder with nothing to commit
        def commit_replayed(self):
            return 0

    builder = Builder()
    monkeypatch.setattr(serving, "graph_builders", weakref.WeakSet())
    assert hooks.install_scheduler_hook()

    def step(new=(), cached=(), resumed=(), tokens=1):
        """``new``, ``cached``: (request id, tokens computed before the step)."""
        return SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([1],), num_computed_tokens=c) for r, c in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r for r, _ in cached],
                num_computed_tokens=[c for _, c in cached],
                resumed_req_ids=set(resumed),
                new_block_ids=[],
            ),
            num_scheduled_tokens={r: tokens for r, _ in (*new, *cached)},
        )

    runner = Runner(Manager())
    hit = step(new=[("b", 128)], cached=[("a", 255)])  # b: 128 tokens hit, its last prompt token; a fills a tile
    assert runner.execute_model(hit) == "FULL", "no CUDA-graph decode builder: nothing to steer"
    monkeypatch.setattr(serving, "graph_builders", weakref.WeakSet([builder]))
    steered = serving.tail_block_steps["mixed_dispatch"]
    assert runner.execute_model(hit) == "PIECEWISE"
    assert serving.tail_block_steps["mixed_dispatch"] == steered + 1
    assert "dispatch" not in vars(runner.cudagraph_manager), "the step's dispatch is put back after it"
    assert runner.execute_model(step(cached=[("a", 256)])) == "FULL"  # decode steps keep the full graph
    assert runner.execute_model(step(new=[("c", 0)], cached=[("a", 257)])) == "FULL"  # admitted without a hit
    assert runner.execute_model(step(cached=[("a", 258), ("d", 128)], resumed={"d"})) == "PIECEWISE"
    assert runner.execute_model(step(cached=[("a", 259), ("d", 128)])) == "FULL"  # d running, not resumed
    assert runner.execute_model(step(new=[("e", 128)], tokens=2)) == "FULL"  # not a single-token batch

    class OtherManager:  # a dispatch without the argument: the step runs as vLLM picks, and that is logged
        def dispatch(self, *args, **kwargs):
            return "FULL"

    class SlotManager:  # takes the argument but no instance attribute: the step is not broken either
        __slots__ = ()

        def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
            return "FULL"

    monkeypatch.setattr(serving, "warned", set())
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        assert Runner(OtherManager()).execute_model(hit) == "FULL"
        assert Runner(SlotManager()).execute_model(hit) == "FULL"
    assert "offers no CUDA-graph dispatch to steer" in caplog.text


def test_decode_graphs_need_the_execute_model_wrapper(monkeypatch, caplog):
    """The builder offers single-token decode CUDA graphs on the GPU runner only where the plugin wraps its
    ``execute_model`` (replayed steps' commits before vLLM's block copies, prefix-hit steps kept out of the
    full graph); without the wrapper it offers none, and says so."""
    from kvarn.integration.vllm.builder import AttentionCGSupport as support
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV

    builder = BACKENDS["kvarn_k4v2_g128"].get_builder_cls()
    gpu = SimpleNamespace(use_v2_model_runner=True, device_config=SimpleNamespace(device_type="cuda"))
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "0")  # request-index slots: the tail pool's graph path
    monkeypatch.setattr(serving, "rows_hooked", True)
    monkeypatch.setattr(serving, "scheduler_hooked", True)
    assert builder.get_cudagraph_support(gpu, None) == support.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.setattr(serving, "scheduler_hooked", False)
    monkeypatch.setattr(serving, "warned", set())
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        assert builder.get_cudagraph_support(gpu, None) == support.NEVER
    assert "without full CUDA graphs" in caplog.text
    monkeypatch.setattr(serving, "scheduler_hooked", True)
    cpu = SimpleNamespace(use_v2_model_runner=False, device_config=SimpleNamespace(device_type="cpu"))
    assert builder.get_cudagraph_support(cpu, None) == support.NEVER
