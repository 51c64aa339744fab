"""KVarNCache: a transformers cache that stores KVarN records, checked against the reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_models import prompt_ids, tiny_llama

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
    return tiny_llama()


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


SMOOTHING = {"plain": {}, "tile": {"smooth_keys": True}, "sequence": {"smooth_keys": True, "smooth_scope": "sequence"}}


@pytest.mark.parametrize("smoothing", list(SMOOTHING))
def test_records_are_the_reference_bytes(tiny, smoothing):
    """A prompt of 2 full tiles + 22 tokens: uint8 records byte-equal to kvarn.quantize, tail exact."""
    ids = prompt_ids(150)
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64, **SMOOTHING[smoothing])
    cache = KVarNCache(PRESET + "_ks" if smoothing == "sequence" else cfg)  # the _ks name is the sequence scope
    with torch.no_grad():
        tiny(ids, past_key_values=cache, use_cache=True)
    exact = _exact_kv(tiny, ids)
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


@pytest.mark.parametrize("smoothing", ["plain", "sequence"])
def test_token_by_token_gives_the_same_bytes(tiny, smoothing):
    """write_tail + commit_tiles (one token at a time) store the bytes store_tiles stores."""
    ids = prompt_ids(140 if smoothing == "plain" else 300)
    exact = _exact_kv(tiny, ids)
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64, **SMOOTHING[smoothing])
    whole, steps = KVarNCache(cfg), KVarNCache(cfg)
    for i, (k, v) in enumerate(exact):
        whole.update(k, v, i)
        for t in range(k.shape[2]):
            steps.update(k[:, :, t : t + 1], v[:, :, t : t + 1], i)
    for a, b in zip(whole.layers, steps.layers, strict=True):
        assert a.length == b.length == ids.shape[1]
        assert torch.equal(a.records, b.records)
        rem = ids.shape[1] % G
        assert torch.equal(a.tail_k[:, :rem], b.tail_k[:, :rem])


@pytest.mark.parametrize("sink", [False, True])
def test_decode_logits_match_the_reference(tiny, sink):
    """Next-token logits after a 128-token prompt equal those over reference-dequantized K/V."""
    ids = prompt_ids(129)
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


@pytest.mark.parametrize("smoothing", list(SMOOTHING))
def test_paged_attention_mode_matches_dequantize_mode(tiny, smoothing):
    """attn_implementation='kvarn' (kvarn.ops.paged_attention) generates what the dequantizing path does."""
    ids = prompt_ids(100)
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64, **SMOOTHING[smoothing])
    with torch.no_grad():
        plain = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=KVarNCache(cfg, sink=True))
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
        try:
            cache = KVarNCache(cfg, sink=True, paged=True)
            paged = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
        finally:
            tiny.set_attn_implementation("sdpa")
    assert paged.shape == (1, 140)
    assert cache.get_seq_length() == 139
    assert torch.equal(plain, paged)


@pytest.mark.parametrize("paged", [False, True])
def test_a_forward_with_autograd_on_gives_the_logits_of_one_without(tiny, paged):
    """An evaluation that forgets ``torch.no_grad()``: K/V and queries that require grad are stored and attended
    as without it (a reference op writing into a buffer with ``out=`` would refuse them)."""
    ids = prompt_ids(130)

    def next_logits():
        cache = KVarNCache(PRESET, paged=paged)
        tiny(ids[:, :129], past_key_values=cache, use_cache=True)
        return tiny(ids[:, 129:], past_key_values=cache, use_cache=True).logits

    if paged:
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
    try:
        with torch.no_grad():
            want = next_logits()
        got = next_logits()
    finally:
        tiny.set_attn_implementation("sdpa")
    assert got.requires_grad
    assert torch.equal(got.detach(), want)


def test_generate_crosses_tiles_and_reports_memory(tiny):
    ids = prompt_ids(60)
    cache = KVarNCache(PRESET)
    with torch.no_grad():
        out = tiny.generate(ids, min_new_tokens=200, max_new_tokens=200, do_sample=False, past_key_values=cache)
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
    ids = prompt_ids(70)
    with torch.no_grad():
        a = tiny.generate(ids, max_new_tokens=80, do_sample=False, past_key_values=KVarNCache(PRESET))
        cache = KVarNCache(PRESET, keep_decoded=True)
        b = tiny.generate(ids, max_new_tokens=80, do_sample=False, past_key_values=cache)
    assert torch.equal(a, b)
    assert cache.nbytes()["decoded"] > 0


def test_fp16_store_dtype_rounds_before_quantizing(tiny):
    ids = prompt_ids(64)
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_a_store_dtype_the_pool_cannot_hold_is_refused_at_construction(dtype):
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16, torch\.bfloat16 or torch\.float32"):
        KVarNCache(PRESET, dtype=dtype)


def test_a_float64_model_stores_in_a_dtype_it_names():
    """The store dtype defaults to the model's: a float64 model is told to name one, and then works."""
    k = torch.randn(1, 2, 70, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"KVarNCache\(dtype=torch\.float32\)"):
        KVarNCache(PRESET).update(k, k, 0)
    cache = KVarNCache(PRESET, dtype=torch.float32)
    cache.update(k, k, 0)
    hist_k, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert hist_k.dtype == torch.float64 and cache.layers[0].tail_k.dtype == torch.float32
    torch.testing.assert_close(hist_k[:, :, 64:70], k[:, :, 64:], atol=1e-5, rtol=1e-5)  # the tail, stored in fp32


def test_kvarn_attention_without_a_paged_cache_says_so(tiny):
    register_kvarn_attention()
    tiny.set_attn_implementation("kvarn")
    try:
        with pytest.raises(RuntimeError, match="paged=True"), torch.no_grad():
            tiny(prompt_ids(8), past_key_values=transformers.DynamicCache(), use_cache=True)
    finally:
        tiny.set_attn_implementation("sdpa")


def test_kvarn_attention_refuses_learned_sinks_it_would_drop():
    """GPT-OSS passes its per-head sink logits as ``s_aux``; SDPA on the prompt chunk would ignore them."""
    from kvarn.integration.hf.attention import kvarn_attention

    q = torch.zeros(1, 2, 3, 64)
    with pytest.raises(ValueError, match="learned attention sinks"):
        kvarn_attention(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))


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


def test_a_paged_cache_under_another_attention_raises_instead_of_garbage(tiny):
    """paged=True under sdpa attention would read only the newest token: it raises instead."""
    with pytest.raises(RuntimeError, match="attn_implementation='kvarn'"), torch.no_grad():
        tiny.generate(prompt_ids(20), max_new_tokens=4, do_sample=False, past_key_values=KVarNCache(PRESET, paged=True))


def test_bad_preset_types_fail_at_construction():
    with pytest.raises(TypeError, match="preset"):
        KVarNCache(4)


def test_memory_report_separates_the_pool_from_the_records(tiny):
    cache = KVarNCache(PRESET)
    with torch.no_grad():
        tiny(prompt_ids(300), past_key_values=cache, use_cache=True)
    mem = cache.memory_report()
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    assert mem["tail_used"] == 2 * (300 % G) * 2 * 2 * 64 * 4  # layers * tokens * (K, V) * Hkv * D * fp32
    assert mem["records_vs_fp16"] == pytest.approx(cfg.capacity_vs_fp16)
    assert mem["capacity_vs_fp16"] < mem["records_vs_fp16"]


@pytest.mark.parametrize("paged", [False, True])
def test_fp16_values_whose_rotation_leaves_fp16_range_are_stored_whole(paged):
    """20000 + noise in fp16 rotates to ~1.6e5, past fp16's range; the fp16 pool holds it.

    No warning, nothing non-finite stored, and the history and attention match a cache that stores
    the same values in fp32 (only fp16 rounding of the rotated values differs).
    """
    gen = torch.Generator().manual_seed(0)
    k = (20000 + 2000 * torch.randn(1, 2, 101, 64, generator=gen)).half()
    v = (-20000 + 2000 * torch.randn(1, 2, 101, 64, generator=gen)).half()
    q = (torch.randn(1, 4, 1, 64, generator=gen) * 1e-3).half()
    got = {}
    for dtype in (torch.float16, torch.float32):
        cache = KVarNCache(PRESET, dtype=dtype, paged=paged)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cache.update(k[:, :, :100], v[:, :, :100], 0)  # one tile and 36 tail tokens
            layer = cache.layers[0]
            layer.saw_kvarn_attention = True  # what the kvarn attention function sets
            hist_k, hist_v = cache.update(k[:, :, 100:], v[:, :, 100:], 0)
        assert torch.isfinite(kvarn.ops.from_pool(layer.tail_k)).all()
        assert float(kvarn.ops.from_pool(layer.tail_k).abs().max()) > 65504
        if paged:
            got[dtype] = layer.attend(q, 0.125).float()
        else:
            assert torch.isfinite(hist_k).all() and torch.isfinite(hist_v).all()
            tail = slice(64, 101)  # read back from the pool: the input up to fp16 rounding
            assert float(((hist_k[:, :, tail].float() - k[:, :, tail].float()).abs() / 20000).max()) < 2e-3
            got[dtype] = torch.nn.functional.scaled_dot_product_attention(q, hist_k, hist_v, enable_gqa=True).float()
    want = got[torch.float32]
    assert float((got[torch.float16] - want).norm() / want.norm()) < 5e-3


def test_values_past_an_fp16_store_dtype_warn():
    """fp32 K/V stored through an fp16 pool (KVarNCache(dtype=torch.float16)) can saturate it: say so."""
    gen = torch.Generator().manual_seed(0)
    big = 70000 + 100 * torch.randn(1, 2, 70, 64, generator=gen)
    with pytest.warns(UserWarning, match="saturated"):
        KVarNCache(PRESET, dtype=torch.float16).update(big, big, 0)
    for ok in (torch.randn(1, 2, 70, 64, generator=gen) * 100, (20000 + 2000 * torch.randn(1, 2, 70, 64)).half()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            KVarNCache(PRESET, dtype=torch.float16).update(ok, ok, 0)


def test_layer_policy_keeps_layer_0_exact_and_quantizes_the_rest(tiny):
    """LayerPolicy(first=1): layer 0 holds the store-dtype K/V, layer 1 the reference records; the logits match."""
    from kvarn.config import LayerPolicy
    from kvarn.integration.hf import FullPrecisionLayer

    ids = prompt_ids(150)
    prompt, nxt = ids[:, :149], ids[:, 149:]
    cfg = KVarNConfig.from_preset(PRESET, head_dim=64)
    cache = KVarNCache(PRESET, layer_policy=LayerPolicy(first=1), dtype=torch.float16)
    with torch.no_grad():
        tiny(prompt, past_key_values=cache, use_cache=True)
        got = tiny(nxt, past_key_values=cache, use_cache=True).logits
    exact = _exact_kv(tiny, prompt)
    fp, quantized = cache.layers
    assert isinstance(fp, FullPrecisionLayer) and not isinstance(quantized, FullPrecisionLayer)
    assert fp.keys.shape[2] == 150  # the prompt and the decoded token
    assert torch.equal(fp.keys[:, :, :149], exact[0][0].half())
    assert torch.equal(fp.values[:, :, :149], exact[0][1].half())
    k, v = exact[1]
    q = kvarn.quantize((k[0].transpose(0, 1).half(), v[0].transpose(0, 1).half()), cfg)
    assert torch.equal(quantized.records[0], q.records)
    dyn = transformers.DynamicCache()
    dyn.update(exact[0][0].half().float(), exact[0][1].half().float(), 0)
    kh, vh = (t.transpose(0, 1)[None].float() for t in q.dequantize())
    tail = slice(2 * G, 149)
    kh[:, :, tail], vh[:, :, tail] = k[:, :, tail].half().float(), v[:, :, tail].half().float()
    dyn.update(kh, vh, 1)
    with torch.no_grad():
        ref = tiny(nxt, past_key_values=dyn, use_cache=True).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    mem = cache.nbytes()
    assert mem["full_precision"] == 2 * 2 * 150 * 64 * 2  # (K, V) * Hkv * tokens * D * fp16
    assert mem["records"] == 2 * 2 * cfg.record_bytes  # one layer: 2 tiles * Hkv
    assert mem["total"] == mem["records"] + mem["tail"] + mem["full_precision"]
    assert cache.memory_report()["records_vs_fp16"] == pytest.approx(cfg.capacity_vs_fp16)


def test_layer_policy_at_a_higher_preset_stores_that_presets_records(tiny):
    from kvarn.config import LayerPolicy

    ids = prompt_ids(130)
    policy = LayerPolicy(last=1, keep="kvarn_k4v4_g64")
    cache = KVarNCache(PRESET, layer_policy=policy, num_layers=2)
    with torch.no_grad():
        tiny(ids, past_key_values=cache, use_cache=True)
    for layer, (k, v), preset in zip(cache.layers, _exact_kv(tiny, ids), (PRESET, "kvarn_k4v4_g64"), strict=True):
        cfg = KVarNConfig.from_preset(preset, head_dim=64)
        assert layer.cfg == cfg
        assert torch.equal(layer.records[0], kvarn.quantize((k[0].transpose(0, 1), v[0].transpose(0, 1)), cfg).records)


@pytest.mark.parametrize("keep", [None, "kvarn_k4v4_g64"])
def test_layer_policy_paged_mode_generates_what_the_dequantizing_path_does(tiny, keep):
    from kvarn.config import LayerPolicy

    ids = prompt_ids(100)
    policy = LayerPolicy(first=1, keep=keep)
    with torch.no_grad():
        plain = tiny.generate(
            ids, max_new_tokens=40, do_sample=False, past_key_values=KVarNCache(PRESET, sink=True, layer_policy=policy)
        )
        kept_all = KVarNCache(PRESET, sink=True, layer_policy=LayerPolicy(first=2))
        everything = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=kept_all)
        exact = tiny.generate(ids, max_new_tokens=40, do_sample=False)
        register_kvarn_attention()
        tiny.set_attn_implementation("kvarn")
        try:
            cache = KVarNCache(PRESET, sink=True, paged=True, layer_policy=policy)
            paged = tiny.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
        finally:
            tiny.set_attn_implementation("sdpa")
    assert torch.equal(plain, paged)
    assert torch.equal(everything, exact)  # every layer kept: the model's own cache, token for token
    mem = kept_all.memory_report()
    assert mem["fp16_bytes"] == 2 * 2 * 2 * 2 * 64 * 139  # layers * (K, V) * Hkv * 2 bytes * D * tokens
    assert mem["full_precision"] == mem["total"] == 2 * mem["fp16_bytes"]  # held in the fp32 model dtype


def test_layer_policy_bad_arguments():
    from kvarn.config import LayerPolicy

    with pytest.raises(ValueError, match=r"num_layers=model\.config\.num_hidden_layers"):
        KVarNCache(PRESET, layer_policy=LayerPolicy(last=1))
    with pytest.raises(ValueError, match="shares the tile length"):
        KVarNCache(PRESET, layer_policy=LayerPolicy(first=1, keep="kvarn_k4v4_g128"))
    with pytest.raises(TypeError, match="LayerPolicy"):
        KVarNCache(PRESET, layer_policy={"first": 1})
    cache = KVarNCache(PRESET, layer_policy=LayerPolicy(first=1), num_layers=1)
    k = torch.randn(1, 2, 8, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"num_layers=1\) got an update for layer 1"):
        cache.update(k, k, 1)
