"""Tails in vLLM's own blocks, the vLLM side (``kvarn.integration.vllm.tail_blocks``; ``KVARN_TAIL_BLOCKS=1``).

Held against vLLM's real ``KVCacheManager`` (this CPU build's): a request holds the blocks its tokens
need plus ``tail_blocks``, from its first allocation through decode steps that cross tile boundaries,
prefix hits share only the blocks of whole tiles, freeing returns every block, the admission check
counts the tail blocks, and vLLM's own registration chain hands the spec its manager.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.request import Request

from kvarn.config import PRESETS, KVarNConfig
from kvarn.integration.vllm import hooks
from kvarn.integration.vllm import tail_blocks as tb
from kvarn.integration.vllm.registry import BACKENDS
from kvarn.integration.vllm.state import serving
from kvarn.paged import tail_geometry

pytestmark = pytest.mark.vllm

PRESET = "kvarn_k4v2_g128"
G = 128


def _vllm_config(max_model_len: int = 4096):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
    )


def _spec(preset: str = PRESET, d: int = 64, heads: int = 2):
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    base = FullAttentionSpec(block_size=cfg.group_size, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16)
    return cfg, BACKENDS[preset].customize_spec(base)


@pytest.mark.parametrize("preset", [p for p in PRESETS if "_sink" not in p])
def test_a_tail_fits_in_its_blocks_and_no_block_is_spare(preset):
    """``tail_geometry``: ``rows`` tail tokens (K and V, 16-bit) fit in one record's bytes, ``N`` blocks hold a
    whole tile and ``N - 1`` do not; the design's counts at head_dim 128 (k4v2 5, k4v4 4, k2v2 7)."""
    for d in (64, 128, 256):
        cfg = KVarNConfig.from_preset(preset, head_dim=d)
        rows, n = tail_geometry(cfg)
        assert rows * 2 * d * 2 <= cfg.record_bytes < (rows + 1) * 2 * d * 2
        assert n * rows >= cfg.group_size > (n - 1) * rows
    counts = {p: tail_geometry(KVarNConfig.from_preset(p, head_dim=128)) for p in PRESETS}
    assert counts["kvarn_k4v2_g128"] == (27, 5) and counts["kvarn_k4v2_g64"][1] == 5
    assert counts["kvarn_k4v4_g128"][1] == 4 and counts["kvarn_k2v2_g128"][1] == 7
    assert tail_geometry(KVarNConfig.from_preset(PRESET, head_dim=128), pool_itemsize=4) == (13, 10)


def test_the_spec_counts_its_tail_blocks_and_survives_merge_and_pickle():
    cfg, spec = _spec()
    n = tail_geometry(cfg)[1]
    tail = tb.tail_spec(spec, n)
    assert isinstance(tail, type(spec)) and tail.tail_blocks == n
    assert tail.page_size_bytes == spec.page_size_bytes == 2 * cfg.record_bytes
    vc = _vllm_config(4096)
    assert tail.max_num_blocks_per_req(vc, 4096) == spec.max_num_blocks_per_req(vc, 4096) + n == 32 + n
    assert tail.max_memory_usage_bytes(vc) == (32 + n) * spec.page_size_bytes
    assert type(tail).merge([tail, tail]) == tail
    with pytest.raises(ValueError, match="one tail block count"):
        type(tail).merge([tail, tb.tail_spec(spec, n + 1)])
    assert tb.tail_spec(tail, 2).tail_blocks == 2 and type(tb.tail_spec(tail, 2)) is type(tail)
    assert tail.copy_with_new_block_size(64).tail_blocks == n
    with pytest.raises(ValueError, match="tail_blocks must be >= 0"):
        tb.tail_spec(spec, -1)
    assert pickle.loads(pickle.dumps(tail)) == tail
    # a process that never built the class (vLLM's engine core) unpickles it by name
    code = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(type(s).__name__, s.tail_blocks)"
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tail), capture_output=True, check=True)
    assert out.stdout.decode().split() == ["KVarNTailFullAttentionSpec", str(n)]


@pytest.fixture
def registered():
    """vLLM's own registration chain (built-in specs, then the platform's hook) with kvarn's hook installed."""
    from vllm.platforms import current_platform
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    cls = type(current_platform)
    before = vars(cls).get("register_custom_kv_cache_specs")
    try:
        hooks.install_registry_hook(current_platform)  # kvarn's register() may have installed it already
        assert not hooks.install_registry_hook(current_platform)  # once
        register_all_kvcache_specs(None)
        yield
    finally:
        if before is None:
            delattr(cls, "register_custom_kv_cache_specs")
        else:
            cls.register_custom_kv_cache_specs = before


def test_the_registration_chain_gives_the_tail_spec_its_manager(registered):
    _, spec = _spec()
    assert KVCacheSpecRegistry.get_manager_class(tb.tail_spec(spec, 5)) is tb.manager_class()
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(tb.tail_spec(spec, 5)) is FullAttentionSpec
    assert KVCacheSpecRegistry.get_manager_class(spec) is not tb.manager_class()  # kvarn's spec itself: unchanged


def _manager(spec, num_blocks: int, max_model_len: int = 4096) -> KVCacheManager:
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=G, hash_block_size=G)


def _request(rid: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=512), None, block_hasher=get_request_block_hasher(G, sha256))


def _held(manager: KVCacheManager, rid: str) -> list[int]:
    return list(manager.get_block_ids(rid)[0])


def test_a_request_holds_its_tiles_blocks_plus_the_tail_blocks_from_prefill_to_free(registered):
    cfg, spec = _spec()
    n = tail_geometry(cfg)[1]
    m = _manager(tb.tail_spec(spec, n), num_blocks=64)  # 63 usable: a 4096-token request's 32 + n fit
    assert type(m.coordinator.single_type_managers[0]) is tb.manager_class()
    free0 = m.block_pool.get_num_free_blocks()
    req = _request("a", list(range(300)))
    assert m.allocate_slots(req, 300) is not None
    assert len(_held(m, "a")) == math.ceil(300 / G) + n
    req.num_computed_tokens = 300
    for step in range(300, 520):  # decode steps, crossing the tile boundaries at 384 and 512
        req.append_output_token_ids(7)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens = step + 1
        assert len(_held(m, "a")) == math.ceil((step + 1) / G) + n, step
    assert len(set(_held(m, "a"))) == len(_held(m, "a"))
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == free0
    longest = _request("b", list(range(4096)))  # max_model_len tokens: the tail blocks too, as the table is wide
    assert m.allocate_slots(longest, 4096) is not None
    assert (
        len(_held(m, "b"))
        == 32 + n
        == m.coordinator.single_type_managers[0].kv_cache_spec.max_num_blocks_per_req(_vllm_config(4096), 4096)
    )


def test_a_prefix_hit_shares_whole_tiles_only_and_admission_counts_the_tail_blocks(registered):
    cfg, spec = _spec()
    n = tail_geometry(cfg)[1]
    m = _manager(tb.tail_spec(spec, n), num_blocks=2 * n + 6)  # the null block, a's 3 + n, b's 1 + n new, 1 spare
    prompt = list(range(2 * G + 40))
    a = _request("a", prompt)
    assert m.allocate_slots(a, len(prompt)) is not None
    a.num_computed_tokens = len(prompt)
    b = _request("b", prompt[: 2 * G] + [9] * 40)
    hit, hit_tokens = m.get_computed_blocks(b)[:2]  # (blocks, tokens[, ...]) by version
    assert hit_tokens == 2 * G  # the two whole tiles; a's tail blocks were never hashed
    assert m.allocate_slots(b, len(prompt) - hit_tokens, hit_tokens, hit) is not None
    a_blocks, b_blocks = _held(m, "a"), _held(m, "b")
    assert b_blocks[:2] == a_blocks[:2] and not set(b_blocks[2:]) & set(a_blocks)
    assert len(b_blocks) == 3 + n
    c = _request("c", list(range(1000, 1040)))  # 1 tile + n tail blocks: more than the one block left
    assert m.block_pool.get_num_free_blocks() == 1
    assert m.allocate_slots(c, 40) is None
    m.free(a)
    m.free(b)
    assert m.allocate_slots(c, 40) is not None and len(_held(m, "c")) == 1 + n


def _run(device="cpu", block_size=G, max_num_seqs=8, v2=False, dcp=1, skip=(), text=None):
    return SimpleNamespace(
        use_v2_model_runner=v2,
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp),
        device_config=SimpleNamespace(device_type=device),
        cache_config=SimpleNamespace(block_size=block_size, kv_cache_dtype_skip_layers=list(skip)),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(dtype=torch.bfloat16, hf_text_config=text or SimpleNamespace()),
    )


GEMMA3 = SimpleNamespace(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=1024)
MISTRAL = SimpleNamespace(sliding_window=4096)
QWEN2 = SimpleNamespace(layer_types=["full_attention"] * 4, sliding_window=None)  # use_sliding_window off
QWEN2_MOE = SimpleNamespace(sliding_window=0)  # the same, where transformers writes 0


def test_a_model_with_window_layers_keeps_its_tails_in_blocks(monkeypatch):
    """A request's tail blocks follow its last tile, which no window has left: window models take tails in blocks
    on the GPU as any other, whether vLLM frees their window blocks (0.32 and later, 0.26 with the spec hook) or
    not, and ``KVARN_TAIL_BLOCKS=1`` is not refused for them."""
    from kvarn.integration.vllm.backend import tail_blocks_enabled
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV, freed_window_problems

    monkeypatch.delenv(TAIL_BLOCKS_ENV, raising=False)
    monkeypatch.setattr(serving, "block_tables_widened", True)
    for freed in (True, False):
        monkeypatch.setattr(serving, "window_blocks_freed", freed)
        for text in (QWEN2, QWEN2_MOE, None, GEMMA3, MISTRAL):
            assert tail_blocks_enabled(_run("cuda", v2=True, text=text), PRESET)
        monkeypatch.setenv(TAIL_BLOCKS_ENV, "1")
        assert tail_blocks_enabled(_run("cuda", v2=True, text=GEMMA3), PRESET)
        assert freed_window_problems(PRESET, _run("cuda", v2=True, text=GEMMA3)) == []
        monkeypatch.delenv(TAIL_BLOCKS_ENV)
    # a _ks format's tails-in-blocks planner reads the smoothing vector from the first tile, which a window frees
    # on the CPU engine; on a GPU such window layers get full-attention pages, which keep it
    monkeypatch.setattr(serving, "window_blocks_freed", True)
    assert tail_blocks_enabled(_run("cuda", v2=True, text=GEMMA3), PRESET + "_ks")
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "1")
    assert tail_blocks_enabled(_run("cpu", text=QWEN2), PRESET + "_ks")
    with pytest.raises(ValueError, match="smoothing vector from the first tile's record"):
        tail_blocks_enabled(_run("cpu", text=GEMMA3), PRESET + "_ks")


def _window_spec(window: int = 300, preset: str = PRESET, d: int = 64, heads: int = 2):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    base = SlidingWindowSpec(
        block_size=cfg.group_size, num_kv_heads=heads, head_size=d, dtype=torch.bfloat16, sliding_window=window
    )
    return cfg, BACKENDS[preset].customize_spec(base)


def test_a_window_tail_spec_counts_its_tail_blocks_once_in_admission_and_memory():
    """vLLM sizes a window layer's pool and caps a request's blocks by ``max_admission_blocks_per_request``: the
    tail blocks come on top of it, once (the window spec's memory figure is that cap times the page)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cfg, spec = _window_spec()
    n = tail_geometry(cfg)[1]
    tail = tb.tail_spec(spec, n)
    assert isinstance(tail, SlidingWindowSpec) and tail.sliding_window == 300 and tail.tail_blocks == n
    cap = spec.max_admission_blocks_per_request(max_in_flight_tokens=256, max_model_len=4096)
    assert tail.max_admission_blocks_per_request(max_in_flight_tokens=256, max_model_len=4096) == cap + n
    vc = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=4096),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        max_in_flight_tokens=256,
    )
    assert tail.max_memory_usage_bytes(vc) == spec.max_memory_usage_bytes(vc) + n * spec.page_size_bytes
    assert type(tail).merge([tail, tail]) == tail
    code = "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); print(type(s).__name__, s.tail_blocks)"
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tail), capture_output=True, check=True)
    assert out.stdout.decode().split() == ["KVarNTailSlidingWindowSpec", str(n)]


def test_vllm_026s_window_page_holds_a_record_and_gets_the_window_manager(registered):
    """vLLM 0.26 has no page field on its window spec: ``KVarNWindowPageSpec`` is one with a record's bytes per
    token slot, which vLLM's registry hands the window manager (its tail subclass the window tail manager), and
    which an engine core that never built it unpickles."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvarn.integration.vllm.backend import page_slot_bytes
    from kvarn.integration.vllm.window_spec import window_page_spec_class

    cfg = KVarNConfig.from_preset(PRESET, head_dim=128)
    cls = window_page_spec_class()
    page = cls(
        block_size=G, num_kv_heads=8, head_size=128, dtype=torch.uint8, sliding_window=1024,
        record_slot_bytes=page_slot_bytes(cfg),
    )  # fmt: skip
    assert page.real_page_size_bytes == 8 * cfg.record_bytes  # what vLLM 0.26 sizes a page by
    plain = SlidingWindowSpec(block_size=G, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=1024)
    assert plain.real_page_size_bytes / page.real_page_size_bytes > 4.7
    assert KVCacheSpecRegistry.get_manager_class(page) is SlidingWindowManager
    n = tail_geometry(cfg)[1]
    tail = tb.tail_spec(page, n)
    assert KVCacheSpecRegistry.get_manager_class(tail) is tb.manager_class(window=True)
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(tail) is SlidingWindowSpec
    assert tail.real_page_size_bytes == page.real_page_size_bytes
    code = (
        "import pickle, sys; s = pickle.loads(sys.stdin.buffer.read()); "
        "print(type(s).__name__, s.tail_blocks, s.real_page_size_bytes)"
    )
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(tail), capture_output=True, check=True)
    assert out.stdout.decode().split() == ["KVarNTailKVarNWindowPageSpec", str(n), str(page.real_page_size_bytes)]


def test_a_window_request_holds_its_window_plus_the_tail_blocks_and_frees_the_rest(registered):
    """vLLM's window manager with the tail blocks: as a request decodes past its window, the blocks before the
    window go back to the pool while the current tile's block and the ``N`` tail blocks after it stay held;
    freeing returns every block."""
    cfg, spec = _window_spec(window=300)
    n = tail_geometry(cfg)[1]
    m = _manager(tb.tail_spec(spec, n), num_blocks=64)
    assert type(m.coordinator.single_type_managers[0]) is tb.manager_class(window=True)
    null = m.block_pool.null_block.block_id
    free0 = m.block_pool.get_num_free_blocks()
    req = _request("a", list(range(200)))
    assert m.allocate_slots(req, 200) is not None
    req.num_computed_tokens = 200
    for step in range(200, 1100):  # past the window by several tiles
        req.append_output_token_ids(7)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens = step + 1
        held = _held(m, "a")
        assert len(held) == math.ceil((step + 1) / G) + n, step
        first_live = max(0, step + 1 - 300) // G  # the block of the oldest token a query may still see
        assert all(b != null for b in held[first_live:]), step  # the window, the current tile, the tail blocks
    assert held[: (1100 - 300) // G - 1] == [null] * ((1100 - 300) // G - 1), "blocks before the window freed"
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == free0


def test_tails_in_blocks_are_opt_in_and_refused_where_not_built(monkeypatch):
    """``$KVARN_TAIL_BLOCKS``: unset, on for the GPU engine's V2 runner whose block tables kvarn widens (no sink,
    blocks of one tile), else the pool; ``0`` the pool; ``1`` on, refused with what to change on CUDA without
    such a runner, with a sink, with cache blocks of several tiles, with skipped layers (vLLM groups them with
    KVarN's); other values refused. With it the pool is the shared step pool."""
    from kvarn.integration.vllm.backend import pool_slots, tail_blocks_enabled
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV

    monkeypatch.delenv(TAIL_BLOCKS_ENV, raising=False)
    monkeypatch.setattr(serving, "block_tables_widened", True)
    assert not tail_blocks_enabled(_run(), PRESET)  # the default: the pool on the CPU engine
    assert tail_blocks_enabled(_run("cuda", v2=True), PRESET)  # ... tails in blocks on the GPU's V2 runner
    elsewhere = [
        (_run("cuda"), PRESET),
        (_run("cuda", v2=True), PRESET + "_sink"),
        (_run("cuda", v2=True, block_size=2 * G), PRESET),
        (_run("cuda", v2=True, dcp=2), PRESET),
        (_run("cuda", v2=True, skip=["0"]), PRESET),
    ]
    for run, preset in elsewhere:
        assert not tail_blocks_enabled(run, preset)  # not built there: the pool, no error
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "0")
    assert not tail_blocks_enabled(_run("cuda", v2=True), PRESET)
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "1")
    assert tail_blocks_enabled(_run(), PRESET)
    assert pool_slots(_run(max_num_seqs=8), preset=PRESET) == 8
    monkeypatch.setattr(serving, "block_tables_widened", False)
    assert not serving.block_tables_widened
    for run, preset, why in [
        (_run("cuda"), PRESET, "V2 model runner"),
        (_run("cuda", v2=True), PRESET, "V2 model runner"),
        (_run(), PRESET + "_sink", "does not keep a sink yet"),
        (_run(block_size=2 * G), PRESET, "cache blocks of one tile"),
        (_run(dcp=2), PRESET, "decode context parallelism"),
        (_run(skip=["0"]), PRESET, "skip-layers"),
    ]:
        with pytest.raises(ValueError, match=why):
            tail_blocks_enabled(run, preset)
    monkeypatch.setattr(serving, "block_tables_widened", True)
    assert tail_blocks_enabled(_run("cuda", v2=True), PRESET)
    with pytest.raises(ValueError, match="V2 model runner"):
        tail_blocks_enabled(_run("cuda"), PRESET)
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        tail_blocks_enabled(_run(), PRESET)


def test_a_spec_without_its_tail_blocks_is_refused_at_start_up(monkeypatch):
    """With ``$KVARN_TAIL_BLOCKS=1`` the builder checks that vLLM's spec gives each request the tail blocks its
    geometry needs, so a spec built without the run's config fails at start-up, not at the first long request."""
    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV

    cfg, spec = _spec()
    monkeypatch.setenv(TAIL_BLOCKS_ENV, "1")
    run = _run()
    run.cache_config.num_gpu_blocks = None  # no capacity log
    builder_cls = BACKENDS[PRESET].get_builder_cls()
    rows, n = tail_geometry(cfg)
    with pytest.raises(RuntimeError, match=f"gives each request 0 tail blocks, the backend needs {n}"):
        builder_cls(spec, ["layer.0"], run, torch.device("cpu"))
    builder = builder_cls(tb.tail_spec(spec, n), ["layer.0"], run, torch.device("cpu"))
    assert (builder.tail_rows, builder.num_slots, builder.planner) == (rows, 8, None)
