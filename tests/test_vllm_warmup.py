"""The steps :mod:`kvarn.integration.vllm.warmup` rehearses before serving (the engine run is in ``test_vllm_e2e``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvarn.integration.vllm.warmup import REHEARSAL_TILES, WARMUP_ENV, rehearsal_steps, warmup_wanted
from kvarn.paged import PREFILL_MIN_QUERIES


@pytest.mark.parametrize(
    ("g", "max_seqs", "max_tokens"), [(128, 1024, 16384), (64, 16, 96), (128, 6, 8192), (128, 1, 8192)]
)
def test_rehearsed_steps_fit_the_engine_and_reach_every_kind_of_step(g, max_seqs, max_tokens):
    max_len = 8 * g
    steps = rehearsal_steps(g, max_len, max_seqs, max_tokens)
    for queries, lens in steps:
        assert len(queries) == len(lens) <= max_seqs
        assert sum(queries) <= max_tokens
        assert all(0 < q <= n <= min(max_len, REHEARSAL_TILES * g) for q, n in zip(queries, lens, strict=True))
    decodes = {len(q) for q, _ in steps if set(q) == {1}}
    assert decodes == {*(2**i for i in range(max_seqs.bit_length()) if 2**i < max_seqs), max_seqs}
    # a decode token that completes a tile (the commit), prompt chunks long enough for the page path, one
    # of them beside decode rows, one starting inside a tile, and multi-token queries too short for it
    assert any(n % g == 0 for q, lens in steps if set(q) == {1} for n in lens)
    prompts = [(q, lens) for q, lens in steps if max(q) >= PREFILL_MIN_QUERIES]
    assert prompts and (any(1 in q for q, _ in prompts) or max_seqs == 1)  # a decode beside a chunk takes 2
    inside = any((n - m) % g and m >= PREFILL_MIN_QUERIES for q, lens in prompts for m, n in zip(q, lens, strict=True))
    assert inside or max_tokens < g + 1 or max_seqs == 1  # that step: a chunk of g and a decode row
    assert any(1 < max(q) < PREFILL_MIN_QUERIES for q, _ in steps)


def test_no_steps_where_the_block_table_reaches_too_few_tiles():
    assert rehearsal_steps(128, 2 * 128, 8, 8192) == []


def test_the_switch(monkeypatch):
    monkeypatch.delenv(WARMUP_ENV, raising=False)
    assert warmup_wanted("cuda") and not warmup_wanted("cpu")
    monkeypatch.setenv(WARMUP_ENV, "1")
    assert warmup_wanted("cpu")
    monkeypatch.setenv(WARMUP_ENV, "0")
    assert not warmup_wanted("cuda")
    monkeypatch.setenv(WARMUP_ENV, "yes")
    with pytest.raises(ValueError, match=WARMUP_ENV):
        warmup_wanted("cuda")


class _Impl:
    num_heads, num_kv_heads, head_size = 4, 2, 64

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = []

    def forward(self, layer, query, key, value, kv_cache, meta, output=None):
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append((query.shape[0], kv_cache, meta))
        return output


class _Builder:
    """What :func:`rehearse` reads of a metadata builder; ``build`` counts as the real one does."""

    def __init__(self, kv, impl, tail_rows=27, tail_blocks=5):
        from kvarn.integration.vllm.state import serving

        self.serving = serving
        layer = SimpleNamespace(kv_cache=kv, impl=impl)
        self.layer_names = ["model.layers.0.attn"]
        self.vllm_config = SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={self.layer_names[0]: layer}),
            scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512),
            model_config=SimpleNamespace(dtype=torch.float16),
        )
        self.cfg = SimpleNamespace(group_size=128)
        self.tail_rows, self.tail_blocks, self.num_slots = tail_rows, tail_blocks, 8
        self.cams = []

    def build(self, common_prefix_len, cam):
        self.serving.tail_block_steps["decode"] += 1
        self.serving.probe.note_build(self.layer_names)
        self.cams.append(cam)
        return ("meta", len(self.cams))


def _cam(width: int):
    return SimpleNamespace(block_table_tensor=torch.zeros(2, width, dtype=torch.int32))


@pytest.mark.vllm
def test_rehearse_runs_its_steps_on_a_scratch_cache_and_leaves_counters_and_the_probe_alone():
    pytest.importorskip("vllm")
    from kvarn.integration.vllm.state import serving
    from kvarn.integration.vllm.warmup import rehearse

    warmup_stats = serving.warmup_stats

    width = 40
    kv = torch.full((64, 2, 128, 60), 7, dtype=torch.uint8)
    impl = _Impl()
    builder = _Builder(kv, impl)
    serving.tail_block_steps["decode"] = 11
    probe, serving.probe.layer = serving.probe.layer, builder.layer_names[0]
    serving.probe.reset()
    runs = warmup_stats["runs"]
    try:
        assert rehearse(builder, _cam(width), serving.bookkeeping_paused)
        assert serving.tail_block_steps["decode"] == 11 and serving.probe.builds == 0
        assert serving.probe.layer == builder.layer_names[0]
    finally:
        serving.probe.layer = probe
        serving.probe.reset()
        serving.tail_block_steps.clear()
    steps = rehearsal_steps(128, (width - 5) * 128, 8, 512)
    assert [c.num_reqs for c in builder.cams] == [len(q) for q, _ in steps]
    assert [n for n, _, _ in impl.calls] == [sum(q) for q, _ in steps]
    for cam, (_, cache, meta) in zip(builder.cams, impl.calls, strict=True):
        assert cam.block_table_tensor.shape[1] == width  # vLLM's width: the launch rules read it
        assert int(cam.block_table_tensor.max()) < cache.shape[0] == REHEARSAL_TILES + 5
        assert cache.shape[1:] == kv.shape[1:] and cache.data_ptr() != kv.data_ptr()
        assert meta == ("meta", builder.cams.index(cam) + 1)
    assert bool((kv == 7).all())  # the real cache untouched
    assert warmup_stats["runs"] == runs + 1 and warmup_stats["error"] is None


@pytest.mark.vllm
def test_rehearse_waits_for_a_bound_cache_skips_a_pool_and_survives_a_failure(caplog):
    pytest.importorskip("vllm")
    from kvarn.integration.vllm.state import serving
    from kvarn.integration.vllm.warmup import rehearse

    warmup_stats = serving.warmup_stats

    unbound = _Builder(torch.empty(0, dtype=torch.uint8), _Impl())
    assert not rehearse(unbound, _cam(40)) and not unbound.cams  # asked again at a later build
    pool = _Builder(torch.zeros(64, 2, 128, 60, dtype=torch.uint8), _Impl(), tail_rows=0)
    assert rehearse(pool, _cam(40)) and not pool.cams  # tails in a pool: nothing to rehearse
    failing = _Builder(torch.zeros(64, 2, 128, 60, dtype=torch.uint8), _Impl(fail=True))
    before = dict(serving.tail_block_steps)
    with caplog.at_level("WARNING", logger="vllm.kvarn"):
        assert rehearse(failing, _cam(40), serving.bookkeeping_paused)
    assert "rehearsing serving steps failed (boom)" in caplog.text
    assert warmup_stats["error"] == "RuntimeError: boom" and dict(serving.tail_block_steps) == before
    warmup_stats["error"] = None


@pytest.mark.vllm
def test_an_unknown_value_is_refused_on_every_engine(monkeypatch):
    """``KVARN_WARMUP`` is read as every metadata builder is made, so an unknown value is refused on the CPU
    engine too, whose builders (tails in a pool) rehearse nothing."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvarn.integration.vllm.checks import TAIL_BLOCKS_ENV
    from kvarn.integration.vllm.registry import BACKENDS

    monkeypatch.delenv(TAIL_BLOCKS_ENV, raising=False)
    backend = BACKENDS["kvarn_k4v2_g64"]
    spec = backend.customize_spec(FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.uint8))
    run = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=backend.preset, num_gpu_blocks=None),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(dtype=torch.float16),
    )
    monkeypatch.setenv(WARMUP_ENV, "maybe")
    with pytest.raises(ValueError, match=r"KVARN_WARMUP must be 0 or 1 \(or unset\), got 'maybe'"):
        backend.get_builder_cls()(spec, ["layer.0"], run, torch.device("cpu"))
    monkeypatch.setenv(WARMUP_ENV, "1")
    builder = backend.get_builder_cls()(spec, ["layer.0"], run, torch.device("cpu"))
    assert builder.planner is not None and not builder._warm_pending  # a pool: nothing to rehearse
