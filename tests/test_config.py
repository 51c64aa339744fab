import itertools

import pytest

from kvarn.config import PRESETS, KVarNConfig, Preset, check_preset

# (preset, head_dim) -> record bytes, derived by hand: D*G*(kb+vb)/8 + 2*(3D + 3G).
RECORD_BYTES = {
    ("kvarn_k4v2_g128", 64): 64 * 128 * 6 // 8 + 2 * (3 * 64 + 3 * 128),
    ("kvarn_k4v2_g128", 128): 13824,
    ("kvarn_k4v2_g128", 256): 256 * 128 * 6 // 8 + 2 * (3 * 256 + 3 * 128),
    ("kvarn_k4v2_g64", 64): 64 * 64 * 6 // 8 + 2 * (3 * 64 + 3 * 64),
    ("kvarn_k4v2_g64", 128): 7296,
    ("kvarn_k4v2_g64", 256): 256 * 64 * 6 // 8 + 2 * (3 * 256 + 3 * 64),
    ("kvarn_k4v4_g128", 64): 64 * 128 + 2 * (3 * 64 + 3 * 128),
    ("kvarn_k4v4_g128", 128): 17920,
    ("kvarn_k4v4_g128", 256): 256 * 128 + 2 * (3 * 256 + 3 * 128),
    ("kvarn_k4v4_g64", 64): 64 * 64 + 2 * (3 * 64 + 3 * 64),
    ("kvarn_k4v4_g64", 128): 9344,
    ("kvarn_k4v4_g64", 256): 256 * 64 + 2 * (3 * 256 + 3 * 64),
    ("kvarn_k2v2_g128", 64): 64 * 128 * 4 // 8 + 2 * (3 * 64 + 3 * 128),
    ("kvarn_k2v2_g128", 128): 9728,
    ("kvarn_k2v2_g128", 256): 256 * 128 * 4 // 8 + 2 * (3 * 256 + 3 * 128),
}
# Bytes per token per KV head at D=128, as tabled in docs/internals/cache_layout.md.
BYTES_PER_TOKEN_D128 = {
    "kvarn_k4v2_g128": 108,
    "kvarn_k4v4_g128": 140,
    "kvarn_k4v2_g64": 114,
    "kvarn_k4v4_g64": 146,
    "kvarn_k2v2_g128": 76,
}


@pytest.mark.parametrize(("preset", "head_dim"), sorted(RECORD_BYTES))
def test_record_bytes_table(preset, head_dim):
    cfg = KVarNConfig.from_preset(preset, head_dim=head_dim)
    assert cfg.record_bytes == RECORD_BYTES[preset, head_dim]
    assert cfg.name == preset
    offsets = cfg.offsets
    ends = [*sorted(offsets.values()), cfg.record_bytes]
    assert ends[0] == 0 and all(a < b for a, b in itertools.pairwise(ends))
    assert all(v % 16 == 0 for k, v in offsets.items() if k.endswith("codes") or k == "k_scale")


def test_every_preset_is_pinned():
    assert {p for p, _ in RECORD_BYTES} == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(BYTES_PER_TOKEN_D128))
def test_budget_at_d128(preset):
    cfg = KVarNConfig.from_preset(preset)
    assert cfg.bytes_per_token == BYTES_PER_TOKEN_D128[preset]
    assert cfg.capacity_vs_fp16 == pytest.approx(512 / BYTES_PER_TOKEN_D128[preset])
    assert cfg.capacity_vs_fp8 == pytest.approx(256 / BYTES_PER_TOKEN_D128[preset])
    assert cfg.bits_per_element == pytest.approx(16 / cfg.capacity_vs_fp16)


def test_default_preset_budget():
    cfg = KVarNConfig()
    assert (cfg.record_bytes, cfg.bytes_per_token) == (13824, 108)
    assert round(cfg.capacity_vs_fp16, 2) == 4.74 and round(cfg.capacity_vs_fp8, 2) == 2.37


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="kvarn_k4v2_g128") as e:
        KVarNConfig.from_preset("kvarn_k3v3_g128")
    assert "kvarn_k3v3_g128" in str(e.value)


@pytest.mark.parametrize("head_dim", [96, 48, 0, -64])
def test_head_dim_not_power_of_two(head_dim):
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [32, 512])
def test_head_dim_unsupported(head_dim):
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 256\)"):
        KVarNConfig(head_dim=head_dim)


def test_bad_bits_and_group():
    with pytest.raises(ValueError, match="k_bits"):
        KVarNConfig(k_bits=3)
    with pytest.raises(ValueError, match="group_size"):
        KVarNConfig(group_size=32)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        KVarNConfig(sinkhorn_iters=-1)


def test_preset_of_wrong_type():
    with pytest.raises(TypeError, match="preset must be a preset name or a KVarNConfig, got int"):
        KVarNConfig.from_preset(4)
    cfg = KVarNConfig.from_preset(KVarNConfig.from_preset("kvarn_k2v2_g128"), head_dim=64)
    assert (cfg.k_bits, cfg.head_dim) == (2, 64)


def test_from_preset_keeps_a_configs_head_dim():
    # from_preset(cfg) once reset head_dim to 128
    d64 = KVarNConfig.from_preset("kvarn_k4v4_g64", head_dim=64)
    assert KVarNConfig.from_preset(d64).head_dim == 64
    assert KVarNConfig.from_preset(d64, head_dim=64) == d64
    assert KVarNConfig.from_preset(d64, head_dim=256).head_dim == 256
    assert KVarNConfig.from_preset(d64, sinkhorn_iters=3) == KVarNConfig(4, 4, 64, 64, sinkhorn_iters=3)
    assert KVarNConfig.from_preset("kvarn_k4v4_g64").head_dim == 128


def test_check_preset():
    # KVarNCache(4) was once accepted; constructors validate with check_preset
    check_preset("kvarn_k2v2_g128")
    check_preset(KVarNConfig())
    for bad in (4, None, ("kvarn_k4v2_g128",)):
        with pytest.raises(TypeError, match="preset must be a preset name or a KVarNConfig, got"):
            check_preset(bad)
    with pytest.raises(ValueError, match="unknown KVarN preset 'k4'; valid presets are: kvarn_k4v2_g128"):
        check_preset("k4")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_key_smoothing_preset_names(preset):
    """``<preset>_ks`` is the preset with one smoothing vector per sequence, and its name round-trips."""
    cfg = KVarNConfig.from_preset(preset + "_ks", head_dim=64)
    plain = KVarNConfig.from_preset(preset, head_dim=64)
    assert cfg.seq_smooth and cfg.smooth_keys and cfg.smooth_scope == "sequence"
    assert (cfg.k_bits, cfg.v_bits, cfg.group_size) == (plain.k_bits, plain.v_bits, plain.group_size)
    assert cfg.record_bytes == plain.record_bytes + 64
    assert cfg.name == preset + "_ks" and plain.name == preset
    assert KVarNConfig.from_preset(cfg.name, head_dim=64) == cfg
    check_preset(preset + "_ks")
    # per-tile smoothing has no preset name: it keeps the base name
    assert KVarNConfig.from_preset(preset, smooth_keys=True).name == preset
    for bad in (preset + "_ks_ks", preset + "_sink", "_ks"):
        with pytest.raises(ValueError, match="each also with '_ks'"):
            KVarNConfig.from_preset(bad)


def test_preset_fields_by_name():
    for name, p in PRESETS.items():
        assert isinstance(p, Preset)
        assert name == f"kvarn_k{p.k_bits}v{p.v_bits}_g{p.group_size}"
        assert p[2] == p.group_size  # still a tuple for older readers
        cfg = KVarNConfig.from_preset(name)
        assert (cfg.k_bits, cfg.v_bits, cfg.group_size) == p


def test_layer_policy_kept_layers_and_vllm_skip_list():
    from kvarn.config import LayerPolicy

    assert LayerPolicy(first=1).kept() == (0,) == LayerPolicy(first=1).kept(30)
    assert LayerPolicy(first=2, last=2).kept(30) == (0, 1, 28, 29)
    assert LayerPolicy(first=2, last=2).kept(3) == (0, 1, 2)  # overlapping ends: each layer once
    assert LayerPolicy(layers=(5, -1, 0)).kept(24) == (0, 5, 23)
    assert LayerPolicy(first=1, last=1).skip_layers(24) == ["0", "23"]
    assert LayerPolicy().kept(4) == ()
    with pytest.raises(ValueError, match="needs the model's layer count"):
        LayerPolicy(last=1).kept()
    with pytest.raises(ValueError, match="needs the model's layer count"):
        LayerPolicy(layers=(-1,)).kept()
    with pytest.raises(ValueError, match=r"layers \[30\] are outside a model of 30 layers"):
        LayerPolicy(layers=(30,)).kept(30)
    with pytest.raises(ValueError, match="model dtype only"):
        LayerPolicy(first=1, keep="kvarn_k4v4_g128").skip_layers(30)


def test_layer_policy_counts_are_checked_against_the_model_like_indices():
    from kvarn.config import LayerPolicy

    with pytest.raises(ValueError, match=r"LayerPolicy\.first=5 keeps more layers than the model's 2"):
        LayerPolicy(first=5).kept(2)
    with pytest.raises(ValueError, match=r"LayerPolicy\.last=3 keeps more layers than the model's 2"):
        LayerPolicy(last=3).kept(2)
    assert LayerPolicy(first=2, last=2).kept(2) == (0, 1)  # every layer, named by both ends


def test_layer_policy_formats_and_bits():
    from kvarn.config import LayerPolicy

    base = KVarNConfig.from_preset("kvarn_k2v2_g128", head_dim=64, normalize=False)
    fp = LayerPolicy(first=1, last=1)
    assert fp.config_for(0, 30, base) is None and fp.config_for(29, 30, base) is None
    assert fp.config_for(1, 30, base) is base
    # 28 layers of 2-bit records (64*128*4/8 + 2*(3*64 + 3*128) = 5248 bytes per 2*128*64 elements), 2 in fp16
    k2v2 = 8 * 5248 / (2 * 128 * 64)
    assert fp.bits_per_element(base, 30) == pytest.approx((28 * k2v2 + 2 * 16) / 30)
    hi = LayerPolicy(first=1, keep="kvarn_k4v4_g128")
    kept = hi.config_for(0, 30, base)
    assert (kept.k_bits, kept.v_bits, kept.group_size, kept.head_dim, kept.normalize) == (4, 4, 128, 64, False)
    k4v4 = 8 * (64 * 128 + 2 * (3 * 64 + 3 * 128)) / (2 * 128 * 64)
    assert hi.bits_per_element(base, 30) == pytest.approx((29 * k2v2 + k4v4) / 30)
    with pytest.raises(ValueError, match="shares the tile length"):
        LayerPolicy(first=1, keep="kvarn_k4v4_g64").kept_config(base)
    for bad in ({"first": -1}, {"last": 1.5}, {"layers": ("0",)}, {"keep": "fp16"}):
        with pytest.raises(ValueError, match="LayerPolicy"):
            LayerPolicy(**bad)


def test_key_bias_reason_and_recommended_preset():
    """Models with biased key projections get the ``_ks`` preset recommended, read from their HF config."""
    transformers = pytest.importorskip("transformers")
    from kvarn.config import key_bias_reason, recommended_preset

    qwen2 = transformers.Qwen2Config()
    assert "qwen2" in key_bias_reason(qwen2)
    assert recommended_preset(qwen2) == "kvarn_k4v2_g128_ks"
    assert recommended_preset(qwen2, "kvarn_k2v2_g128") == "kvarn_k2v2_g128_ks"
    assert recommended_preset(qwen2, "kvarn_k2v2_g128_ks") == "kvarn_k2v2_g128_ks"
    llama = transformers.LlamaConfig()
    assert key_bias_reason(llama) is None and recommended_preset(llama) == "kvarn_k4v2_g128"
    assert "attention_bias=True" in key_bias_reason(transformers.LlamaConfig(attention_bias=True))
    assert key_bias_reason(transformers.Qwen3Config()) is None  # Qwen3 dropped the biases
    nested = type("Multimodal", (), {"model_type": "vlm", "text_config": qwen2})()
    assert key_bias_reason(nested) is not None
    with pytest.raises(ValueError, match="unknown KVarN preset"):
        recommended_preset(qwen2, "kvarn_k3v2_g128")
    with pytest.raises(TypeError, match="preset name"):
        recommended_preset(qwen2, KVarNConfig.from_preset("kvarn_k4v2_g128"))


def test_cache_dtype_names_add_ks_then_sink_to_a_preset():
    """vLLM's ``--kv-cache-dtype`` names: a preset, then optionally ``_ks``, then optionally ``_sink``; ``_sink``
    keeps the records of the name without it, ``_ks`` goes before it."""
    from kvarn.config import (
        CACHE_DTYPES,
        cache_dtype_config,
        has_key_smoothing,
        has_sink,
        is_cache_dtype,
        with_key_smoothing,
        without_sink,
    )

    assert len(CACHE_DTYPES) == len(set(CACHE_DTYPES)) == 4 * len(PRESETS)
    for name in CACHE_DTYPES:
        assert is_cache_dtype(name) and has_sink(name) == name.endswith("_sink")
        assert cache_dtype_config(name, 64) == KVarNConfig.from_preset(without_sink(name), head_dim=64)
        smoothed = with_key_smoothing(name)
        assert is_cache_dtype(smoothed) and has_key_smoothing(smoothed) and has_sink(smoothed) == has_sink(name)
        assert with_key_smoothing(smoothed) == smoothed
    assert with_key_smoothing("kvarn_k2v2_g128_sink") == "kvarn_k2v2_g128_ks_sink"
    assert without_sink("kvarn_k4v2_g128_ks_sink") == "kvarn_k4v2_g128_ks" and not has_key_smoothing("kvarn_k4v2_g64")
    for other in ("kvarn_k4v2_g128_sink_ks", "auto", "fp8", None):
        assert not is_cache_dtype(other)
    with pytest.raises(ValueError, match="unknown KVarN cache dtype 'kvarn_k4v2_g128_snk'"):
        cache_dtype_config("kvarn_k4v2_g128_snk")
