"""KVarNCache: a transformers cache that stores KVarN records, checked against the reference."""

from __future__ import annotations

import pytest
import torch

import kvarn
from kvarn.config import KVarNConfig

transformers = pytest.importorskip("transformers")
from kvarn.integration.hf import KVarNCache, register_kvarn_attention  # noqa: E402

pytestmark = pytest.mark.hf

PRESET = "kvarn_k4v2_g64"
G = 64


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random Llama (GQA 4:2, head_dim 64) in fp32; no download."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=g)


def _exact_kv(model, ids):
    """Per layer ``(k, v): [1, Hkv, T, D]`` (post-RoPE, model frame) from a DynamicCache run."""
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _reference_cache(exact, cfg: KVarNConfig, sink: bool = False):
    """A DynamicCache holding what the reference stores: full tiles through kvarn.quantize, tail exact."""
    dyn = transformers.DynamicCache()
    for i, (k, v) in enumerate(exact):
        q = kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg)
        kh, vh = (t.transpose(0, 1)[None] for t in q.dequantize())
        if sink:
            kh[:, :, :G], vh[:, :, :G] = k[:, :, :G], v[:, :, :G]
        dyn.update(kh, vh, i)
    return dyn


def test_records_are_the_reference_bytes(tiny):
    """A prompt of 2 full tiles + 22 tokens: uint8 records byte-equal to kvarn.quantize, tail exact."""
    ids = _ids(150)
    cache = KVarNCache(PRESET)
    with torch.no_grad():
        tiny(ids, past_key_values=cache, use_cache=True)
    exact = _exact_kv(tiny, ids)
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    for layer, (k, v) in zip(cache.layers, exact, strict=True):
        assert layer.records.dtype == torch.uint8
        assert layer.records.shape == (1, 2, 2, cfg.record_bytes)
        q = kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg)
        assert torch.equal(layer.records[0], q.records)
        hk, hv = layer.history()
        ref_k, ref_v = q.dequantize()
        torch.testing.assert_close(hk[0].transpose(0, 1), ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hv[0].transpose(0, 1), ref_v, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 150


def test_token_by_token_gives_the_same_bytes(tiny):
    """write_tail + commit_tiles (one token at a time) store the bytes store_tiles stores."""
    ids = _ids(140)
    exact = _exact_kv(tiny, ids)
    whole, steps = KVarNCache(PRESET), KVarNCache(PRESET)
    for i, (k, v) in enumerate(exact):
        whole.update(k, v, i)
        for t in range(k.shape[2]):
            steps.update(k[:, :, t : t + 1], v[:, :, t : t + 1], i)
    for a, b in zip(whole.layers, steps.layers, strict=True):
        assert a.length == b.length == 140
        assert torch.equal(a.records, b.records)
        assert torch.equal(a.tail_k[:, :12], b.tail_k[:, :12])


@pytest.mark.parametrize("sink", [False, True])
def test_decode_logits_match_the_reference(tiny, sink):
    """Next-token logits after a 128-token prompt equal those over reference-dequantized K/V."""
    ids = _ids(129)
    prompt, nxt = ids[:, :128], ids[:, 128:]
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    cache = KVarNCache(PRESET, sink=sink)
    with torch.no_grad():
        tiny(prompt, past_key_values=cache, use_cache=True)
        got = tiny(nxt, past_key_values=cache, use_cache=True).logits
        ref = tiny(nxt, past_key_values=_reference_cache(_exact_kv(tiny, prompt), cfg, sink), use_cache=True).logits
        fp = tiny(nxt, past_key_values=_reference_cache(_exact_kv(tiny, prompt), cfg, sink=False)).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    exact_logits = tiny(ids).logits[:, -1:]
    assert (got - exact_logits).abs().max() > 1e-3  # the cache really quantized something
    if sink:
        assert not torch.allclose(got, fp, atol=1e-4)  # and the sink changed what was attended over


def test_paged_attention_mode_matches_dequantize_mode(tiny):
    """attn_implementation='kvarn' (kvarn.ops.paged_attention) generates what the dequantizing path does."""
    ids = _ids(100)
    with torch.no_grad():
        plain = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=KVarNCache(PRESET, sink=True))
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
        try:
            cache = KVarNCache(PRESET, sink=True, paged=True)
            paged = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
        finally:
            tiny.set_attn_implementation("sdpa")
    assert paged.shape == (1, 140)
    assert cache.get_seq_length() == 139
    assert torch.equal(plain, paged)


def test_generate_crosses_tiles_and_reports_memory(tiny):
    ids = _ids(60)
    cache = KVarNCache(PRESET)
    with torch.no_grad():
        out = tiny.generate(ids, max_new_tokens=200, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 260)
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    length = 259
    assert all(layer.length == length for layer in cache.layers)
    mem = cache.memory_report()
    assert mem["records"] == 2 * (length // G) * 2 * cfg.record_bytes  # layers * tiles * Hkv * bytes
    assert mem["tail"] == 2 * 2 * G * 2 * 64 * 4  # layers * (K, V) * G * Hkv * D * fp32
    assert mem["decoded"] == 0
    assert mem["fp16_bytes"] == 2 * 2 * 2 * 2 * 64 * length
    assert mem["total"] == mem["records"] + mem["tail"]


def test_keep_decoded_changes_nothing_but_memory(tiny):
    ids = _ids(70)
    with torch.no_grad():
        a = tiny.generate(ids, max_new_tokens=80, do_sample=False, past_key_values=KVarNCache(PRESET))
        cache = KVarNCache(PRESET, keep_decoded=True)
        b = tiny.generate(ids, max_new_tokens=80, do_sample=False, past_key_values=cache)
    assert torch.equal(a, b)
    assert cache.nbytes()["decoded"] > 0


def test_fp16_store_dtype_rounds_before_quantizing(tiny):
    ids = _ids(64)
    cache = KVarNCache(PRESET, dtype=torch.float16)
    with torch.no_grad():
        tiny(ids, past_key_values=cache, use_cache=True)
    (k, v), layer = _exact_kv(tiny, ids)[0], cache.layers[0]
    q = kvarn.quantize((k[0].transpose(0, 1).half(), v[0].transpose(0, 1).half()), PRESET)
    assert layer.tail_k.dtype == torch.float16
    assert torch.equal(layer.records[0], q.records)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown KVarN preset"):
        KVarNCache("kvarn_k3v3_g128")
    with pytest.raises(ValueError, match="impl"):
        KVarNCache(impl="cuda")
    cache = KVarNCache(PRESET)
    k = torch.randn(1, 2, 8, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="key_states"):
        cache.update(torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), 0)
    with pytest.raises(NotImplementedError, match="cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="head_dim"):
        KVarNCache(PRESET).update(torch.randn(1, 2, 8, 96), torch.randn(1, 2, 8, 96), 0)


def test_kvarn_attention_without_a_paged_cache_says_so(tiny):
    register_kvarn_attention()
    tiny.set_attn_implementation("kvarn")
    try:
        with pytest.raises(RuntimeError, match="paged=True"), torch.no_grad():
            tiny(_ids(8), past_key_values=transformers.DynamicCache(), use_cache=True)
    finally:
        tiny.set_attn_implementation("sdpa")


@pytest.mark.slow
def test_smollm2_decode_matches_the_reference():
    """The real model: decode logits over KVarNCache equal those over reference-dequantized K/V."""
    from kvarn.eval.harness import bundled_text
    from kvarn.eval.models import load_model

    model, tok = load_model("smollm2-135m")
    ids = tok(bundled_text(), return_tensors="pt").input_ids[:, :129]
    prompt, nxt = ids[:, :128], ids[:, 128:]
    preset = "kvarn_k4v2_g128"
    cfg = KVarNConfig.from_preset(preset, head_dim=64)
    cache = KVarNCache(preset)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        got = model(nxt, past_key_values=cache, use_cache=True).logits[0, -1]
        dyn = transformers.DynamicCache()
        for i, (k, v) in enumerate(_exact_kv(model, prompt)):
            kh, vh = kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg).dequantize()
            dyn.update(kh.transpose(0, 1)[None], vh.transpose(0, 1)[None], i)
        ref = model(nxt, past_key_values=dyn, use_cache=True).logits[0, -1]
        exact = model(ids).logits[0, -1]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="sum")
    assert 0 < float(kl) < 0.5
    mem = cache.memory_report()
    assert mem["records"] == 30 * 1 * 3 * cfg.record_bytes
