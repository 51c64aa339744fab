"""KVarNCache on a model with sliding-window layers (a tiny random Gemma 3): every layer quantized, and the
window layers still see only their window, in the dequantizing and the paged attention mode."""

from __future__ import annotations

import pytest
import torch
from hf_models import prompt_ids

import kvarn
from kvarn.config import KVarNConfig, LayerPolicy

transformers = pytest.importorskip("transformers")
from kvarn.integration.hf import KVarNCache, register_kvarn_attention  # noqa: E402

pytestmark = pytest.mark.hf

PRESET = "kvarn_k4v2_g64"
G = 64
WINDOW = 40
"""Shorter than a tile and not a divisor of it, so a window layer's first visible tile is partly masked."""


@pytest.fixture(scope="module")
def gemma():
    """A 2-layer random Gemma 3 (window layer, then global; 2 query heads, 1 KV head, head_dim 64) in fp32."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=130,
        pad_token_id=128,  # outside prompt_ids' range, so generate sees no padding in a prompt
        eos_token_id=129,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        initializer_range=0.2,  # large enough that the window changes the logits
    )
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def _step_logits(model, ids, prompt: int, cache) -> torch.Tensor:
    """Logits of the prompt's last token, then of each later token fed one at a time: ``[T - prompt + 1, V]``."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[0, -1:]]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out)


def test_the_window_matters_in_this_model(gemma):
    ids = prompt_ids(150)
    with torch.no_grad():
        windowed = gemma(ids).logits
        gemma.config.sliding_window = 4096
        try:
            unwindowed = transformers.Gemma3ForCausalLM(gemma.config).eval()
            unwindowed.load_state_dict(gemma.state_dict())
            unwindowed.set_attn_implementation("sdpa")
            full = unwindowed(ids).logits
        finally:
            gemma.config.sliding_window = WINDOW
    assert (windowed[:, WINDOW:] - full[:, WINDOW:]).abs().max() > 1e-2


def test_unquantized_layers_match_transformers_own_cache(gemma):
    """Every layer kept at full precision: the logits of transformers' DynamicCache (whose window layers keep only
    the last window), step for step, across tile boundaries."""
    ids = prompt_ids(200)
    own = _step_logits(gemma, ids, 100, transformers.DynamicCache(config=gemma.config))
    kept = KVarNCache(PRESET, layer_policy=LayerPolicy(first=2))
    torch.testing.assert_close(_step_logits(gemma, ids, 100, kept), own, atol=1e-5, rtol=1e-5)


def test_the_harness_fp16_method_matches_transformers_own_cache(gemma):
    """The harness's ``fp16`` method (fp16 tiles) on the model in fp16: nothing is rounded, nothing is cut; the
    logits of a DynamicCache of full layers exactly, and of transformers' window-cutting one up to fp16's
    summation order."""
    import copy

    from kvarn.eval.methods import get_method

    half = copy.deepcopy(gemma).half()
    ids = prompt_ids(140)
    cache = get_method("fp16").make_cache(sink=False, dtype=torch.float16)
    got = _step_logits(half, ids, 100, cache)
    torch.testing.assert_close(got, _step_logits(half, ids, 100, transformers.DynamicCache()), atol=0, rtol=0)
    own = _step_logits(half, ids, 100, transformers.DynamicCache(config=half.config))
    torch.testing.assert_close(got, own, atol=3e-2, rtol=0)


def _exact_kv(model, ids):
    """Per layer ``(k, v): [1, Hkv, T, D]`` of every position (a cache of full layers, no window cut)."""
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("paged", [False, True])
def test_every_layer_is_quantized_and_the_window_layer_attends_in_its_window(gemma, paged):
    """Next-token logits after a 128-token prompt (2 tiles committed in both layers) equal those over the reference's
    dequantized K/V with transformers' window mask."""
    ids = prompt_ids(129)
    prompt, nxt = ids[:, :128], ids[:, 128:]
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    exact = _exact_kv(gemma, prompt)
    ref_cache = transformers.DynamicCache()
    for i, (k, v) in enumerate(exact):
        q = kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg)
        ref_cache.update(*(t.transpose(0, 1)[None] for t in q.dequantize()), i)
    cache = KVarNCache(PRESET, paged=paged)
    if paged:
        register_kvarn_attention()
        gemma.set_attn_implementation("kvarn")
    try:
        with torch.no_grad():
            gemma(prompt, past_key_values=cache, use_cache=True)
            got = gemma(nxt, past_key_values=cache, use_cache=True).logits
    finally:
        gemma.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = gemma(nxt, past_key_values=ref_cache, use_cache=True).logits
    for layer, (k, v) in zip(cache.layers, exact, strict=True):
        assert layer.quantized and layer.records.shape == (1, 2, 1, cfg.record_bytes)
        assert torch.equal(layer.records[0], kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg).records)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sink", [False, True])
def test_paged_attention_mode_decodes_what_the_dequantizing_path_does(gemma, sink):
    """Logits of 60 tokens fed one at a time after a 100-token prompt: the window leaves tile 0 (and its sink) at
    position 104 and a tile is committed at 128. (Greedy generation would not tell: this model repeats a token.)"""
    ids = prompt_ids(160)
    plain = _step_logits(gemma, ids, 100, KVarNCache(PRESET, sink=sink))
    register_kvarn_attention()
    gemma.set_attn_implementation("kvarn")
    try:
        cache = KVarNCache(PRESET, sink=sink, paged=True)
        paged = _step_logits(gemma, ids, 100, cache)
    finally:
        gemma.set_attn_implementation("sdpa")
    assert cache.get_seq_length() == 160
    torch.testing.assert_close(paged, plain, atol=1e-4, rtol=1e-4)
