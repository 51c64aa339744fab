"""kvarn.quantize / kvarn.dequantize: shapes, dtypes, forms, errors and the documented policies."""

import ast
import dataclasses
import io
import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tolerances import ROUNDTRIP_REL

import kvarn
from kvarn.config import KVarNConfig


def _kv(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(dtype) for _ in range(2))


@given(
    lead=st.lists(st.integers(1, 2), max_size=2),
    t=st.integers(0, 300),
    h=st.integers(1, 3),
    d=st.sampled_from([64, 128, 256]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    preset=st.sampled_from(list(kvarn.PRESETS)),
)
def test_roundtrip_shape_dtype_and_error(lead, t, h, d, dtype, preset):
    k, v = _kv(*lead, t, h, d, dtype=dtype, seed=t)
    q = kvarn.quantize((k, v), preset)
    k2, v2 = kvarn.dequantize(q)
    assert k2.shape == k.shape and k2.dtype == dtype and v2.shape == v.shape and v2.dtype == dtype
    cfg = q.config
    n = t // cfg.group_size
    assert q.records.shape == (*lead, n, h, cfg.record_bytes)
    rest = t - n * cfg.group_size
    assert torch.equal(k2[..., n * cfg.group_size :, :, :], k[..., n * cfg.group_size :, :, :])  # tail exact
    assert q.nbytes == q.records.numel() + 2 * rest * h * d * k.element_size() * max(1, int(torch.tensor(lead).prod()))
    if n:
        full = n * cfg.group_size
        for x, x2, bits in ((k, k2, cfg.k_bits), (v, v2, cfg.v_bits)):
            a, b = x2[..., :full, :, :].float(), x[..., :full, :, :].float()
            assert float((a - b).norm() / b.norm()) < ROUNDTRIP_REL[bits]


def test_stacked_form_returns_stacked():
    k, v = _kv(256, 2, 128)
    q = kvarn.quantize(torch.stack([k, v]))
    out = q.dequantize()
    assert isinstance(out, torch.Tensor) and out.shape == (2, 256, 2, 128)
    pair = kvarn.quantize((k, v)).dequantize()
    assert torch.equal(out[0], pair[0]) and torch.equal(out[1], pair[1])


def test_capacity_and_bits_of_full_tiles():
    k, v = _kv(4, 256, 8, 128)
    q = kvarn.quantize((k, v), "kvarn_k4v2_g128")
    assert q.nbytes == 4 * 2 * 8 * 13824
    assert q.capacity_vs_fp16 == pytest.approx(512 / 108)
    assert q.bits_per_element == pytest.approx(108 * 8 / 256)


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("bits", [2, 4])
def test_single_tensor_form(role, bits):
    k, _ = _kv(300, 2, 64, dtype=torch.bfloat16)
    q = kvarn.quantize(k, "kvarn_k4v2_g64", role=role, bits=bits)
    assert isinstance(q, kvarn.QuantizedTensor) and q.bits == bits
    k2 = q.dequantize()
    assert k2.shape == k.shape and k2.dtype == k.dtype
    a, b = k2[:256].float(), k[:256].float()
    assert float((a - b).norm() / b.norm()) < ROUNDTRIP_REL[bits]
    assert torch.equal(k2[256:], k[256:])
    # the key form is the K half of a record, the value form the V half: same reconstruction
    pair = kvarn.quantize(
        (k, k), dataclasses.replace(KVarNConfig.from_preset("kvarn_k4v2_g64", 64), k_bits=bits, v_bits=bits)
    )
    assert torch.equal(k2, pair.dequantize()[0 if role == "key" else 1])
    per_elem = bits + 16 * (3 * 64 + 3 * 64) / (2 * 64 * 64)  # K or V half: codes + 3 vectors of 2 bytes
    assert q.nbytes == 4 * 2 * 64 * 64 * per_elem / 8 + 44 * 2 * 64 * 2


def test_zero_input_is_exact():
    k = torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16)
    k2, v2 = kvarn.quantize((k, k.clone())).dequantize()
    assert torch.equal(k2, k) and torch.equal(v2, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_input_is_finite_and_close(dtype):
    # Not bit-exact: the rotated frame is rounded to the input dtype and row parameters to fp16
    # (docs/guide/api.md). The error stays within a few units of fp16 rounding of the value.
    for a in (-7.5, 0.25, 300.0):
        k = torch.full((256, 2, 128), a, dtype=dtype)
        k2, v2 = kvarn.quantize((k, k)).dequantize()
        for x in (k2, v2):
            assert torch.all(torch.isfinite(x.float()))
            assert float((x.float() - a).abs().max()) <= abs(a) * 0.1


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()  # fp64: norms of 1e-30 or 1e20 values leave fp32's range
    return float((a - b).norm() / b.norm())


def _errors(k, v, preset="kvarn_k4v2_g128"):
    """Round-trip relative errors ``(k, v)`` of one pair (no warning allowed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k2, v2 = kvarn.quantize((k, v), preset).dequantize()
    for x in (k2, v2):
        assert torch.isfinite(x.float()).all()
    return _rel(k2, k), _rel(v2, v)


UNIT = torch.randn(256, 2, 128, generator=torch.Generator().manual_seed(5))
"""Unit-scale data: the error every other scale is held to (at most 2x)."""


def _unit_errors(dtype):
    return _errors(UNIT.to(dtype), UNIT.to(dtype))


def test_records_are_the_cache_bytes():
    # kvarn.quantize stores through ops.store_tiles: the records are what a cache stores.
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k, v = _kv(2, 200, 3, 64, dtype=torch.bfloat16, seed=4)
    q = kvarn.quantize((k, v), cfg)
    cache = torch.zeros(6, 3, cfg.record_bytes, dtype=torch.uint8)

    def tiles(x):
        return x[:, :192].reshape(6, 64, 3, 64)

    kvarn.ops.store_tiles(tiles(k), tiles(v), torch.arange(6, dtype=torch.int32), cache, cfg, impl="reference")
    assert torch.equal(q.records.reshape(6, 3, -1), cache)


def test_fp16_rotation_past_fp16_range_is_not_clipped():
    # fp16 values whose rotation leaves fp16's range were saturated (error 0.707).
    # The caches' fp16 pool form holds them (rotated values times 2^-POOL_EXP): kvarn.quantize
    # stores them as a cache does, and no tile of them needs rescaling.
    g = torch.Generator().manual_seed(0)
    k = (20000 + 2000 * torch.randn(256, 2, 128, generator=g)).half()
    ek, ev = _errors(k, k)
    fk, fv = _errors(k.float(), k.float())  # the same values in fp32, where nothing clips
    assert ek < 1.1 * fk and ev < 1.1 * fv
    assert ek < 0.02  # was 0.707
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=128)
    cache = torch.zeros(2, 2, cfg.record_bytes, dtype=torch.uint8)
    tiles = k.view(2, 128, 2, 128)
    kvarn.ops.store_tiles(tiles, tiles, torch.arange(2, dtype=torch.int32), cache, cfg, impl="reference")
    assert torch.equal(kvarn.quantize((k, k)).records, cache)
    mixed = UNIT.half().clone()
    mixed[:128, 1] = k[:128, 1]  # one (tile, head) out of range
    q, q_unit = kvarn.quantize((mixed, mixed)), kvarn.quantize((UNIT.half(), UNIT.half()))
    assert torch.equal(q.records[:, 0], q_unit.records[:, 0]) and torch.equal(q.records[1], q_unit.records[1])
    assert _rel(q.dequantize()[0][:128, 1], k[:128, 1]) < 0.02
    near_max = (UNIT * 15000).clamp(-65504, 65504).half()  # reconstructions past 65504 saturate, not inf
    ek, ev = _errors(near_max, near_max)
    uk, uv = _unit_errors(torch.float16)
    assert ek < 2 * uk and ev < 2 * uv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e8, 1e10, 1e20, 1e29])
def test_values_past_2_to_24_are_scaled_not_clipped(dtype, scale):
    # fp32/bf16 values past 2^24 were clipped silently (randn * 1e10: error 0.9987)
    x = (UNIT * scale).to(dtype)
    ek, ev = _errors(x, x)
    uk, uv = _unit_errors(dtype)
    assert ek < 2 * uk and ev < 2 * uv


def test_outlier_past_2_to_24_keeps_its_size_and_stores_finite_scales():
    k, v = _kv(256, 2, 128, dtype=torch.bfloat16)
    k[:, 0, 3] = 1e29
    v[5] = -1e28
    q = kvarn.quantize((k, v))
    for half in kvarn.ops.decode_records(q.records, q.config):
        assert torch.isfinite(half).all()
    k2, v2 = q.dequantize()
    assert _rel(k2[:, 0, 3], k[:, 0, 3]) < 0.05 and _rel(v2[5], v[5]) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_past_2_to_100_are_refused(dtype):
    k, v = _kv(128, 1, 64, dtype=dtype)
    v[5, 0, 0] = -3e38
    with pytest.raises(ValueError, match=r"v holds values up to 3e\+38; kvarn.quantize takes \|values\| up to 2\^100"):
        kvarn.quantize((k, v))
    k[0, 0, 0] = 2.0**100  # the limit itself is taken
    assert torch.isfinite(kvarn.quantize(k, role="key").dequantize().float()).all()


@pytest.mark.parametrize(
    "dtype,scale",
    [(torch.float32, s) for s in (1e-10, 1e-20, 1e-30, 1e-35)]
    + [(torch.bfloat16, s) for s in (1e-10, 1e-20, 1e-30)]
    + [(torch.float16, s) for s in (1e-5, 1e-6)],
)
def test_tiny_values_keep_their_precision(dtype, scale):
    # randn * 1e-20 came back as zeros, randn * 1e-10 with 3x the unit-scale error.
    x = (UNIT * scale).to(dtype)
    ek, ev = _errors(x, x)
    uk, uv = _unit_errors(dtype)
    assert ek < 2 * uk and ev < 2 * uv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_below_2_to_minus_120_warn(dtype):
    x = (UNIT * 1e-38).to(dtype)
    with pytest.warns(RuntimeWarning, match=r"tile\(s\) have no value above 2\^-120"):
        k2, _ = kvarn.quantize((x, x)).dequantize()
    assert torch.isfinite(k2.float()).all()


def test_empty_input():
    # T = 0 raised ZeroDivisionError in bits_per_element / capacity_vs_fp16
    k, v = _kv(0, 2, 128)
    q = kvarn.quantize((k, v))
    assert q.records.shape == (0, 2, 13824) and q.nbytes == 0
    assert math.isnan(q.bits_per_element) and math.isnan(q.capacity_vs_fp16)
    k2, v2 = q.dequantize()
    assert k2.shape == (0, 2, 128) and v2.dtype == torch.float16
    one = kvarn.quantize(k, role="value")
    assert math.isnan(one.capacity_vs_fp16) and one.dequantize().shape == (0, 2, 128)
    q3 = kvarn.quantize(_kv(3, 0, 2, 64, dtype=torch.bfloat16))  # empty leading dim
    assert q3.records.shape == (3, 0, 2, q3.config.record_bytes) and q3.dequantize()[0].shape == (3, 0, 2, 64)


def test_empty_key_with_key_smoothing():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64, smooth_keys=True)
    t = kvarn.quantize(torch.randn(3, 0, 2, 64), cfg, role="key")
    assert t.smooth.shape == (3, 0, 2, 64) and t.dequantize().shape == (3, 0, 2, 64)


def test_equality_copies_and_devices():
    # == raised on equal copies
    k, v = _kv(200, 2, 64)
    q = kvarn.quantize((k, v))
    same = kvarn.quantize((k.clone(), v.clone()))
    assert q == same and not (q != same)
    assert q != kvarn.quantize((k, v), "kvarn_k4v4_g128") and q != "q"
    moved = q.to("cpu")
    assert moved == q and moved.records.device.type == "cpu"
    t = kvarn.quantize(k, role="key")
    assert t == kvarn.quantize(k.clone(), role="key") and t != kvarn.quantize(k, role="value")
    assert t.to("cpu") == t
    with pytest.raises(TypeError, match="unhashable"):
        hash(q)


def test_torch_load_weights_only():
    # torch.load's default weights_only=True refused a saved QuantizedKV
    k, v = _kv(150, 2, 64, dtype=torch.bfloat16)
    for obj in (
        kvarn.quantize((k, v), "kvarn_k2v2_g128"),
        kvarn.quantize(torch.stack([k, v])),
        kvarn.quantize(v, role="value"),
    ):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert loaded == obj


def test_impl_argument():
    k, v = _kv(128, 1, 64)
    q = kvarn.quantize((k, v), impl="reference")
    assert q == kvarn.quantize((k, v))
    assert torch.equal(q.dequantize(impl="reference")[0], kvarn.dequantize(q)[0])
    with pytest.raises(ValueError, match="impl must be one of"):
        kvarn.quantize((k, v), impl="cuda")


def test_api_reaches_the_reference_only_through_ops():
    tree = ast.parse(Path(kvarn.api.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert "kvarn.ops" in names or "kvarn" in names
    assert not [n for n in names if n.startswith("kvarn.reference") or n.startswith("kvarn.kernels")]


# --- bad input ----------------------------------------------------------------------------------


def test_rejects_non_float_tensors():
    with pytest.raises(TypeError, match=r"k must be float16, bfloat16 or float32, got torch.int64"):
        kvarn.quantize((torch.zeros(128, 1, 64, dtype=torch.long), torch.zeros(128, 1, 64)))


def test_rejects_non_tensor():
    with pytest.raises(TypeError, match=r"v must be a torch\.Tensor, got list"):
        kvarn.quantize((torch.zeros(128, 1, 64), [1, 2]))
    with pytest.raises(TypeError, match="kv must be a"):
        kvarn.quantize("kv")


def test_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"k must have shape \[..., T, H, D\]"):
        kvarn.quantize((torch.zeros(128, 64), torch.zeros(128, 64)))
    with pytest.raises(ValueError, match=r"stacked kv must have shape \[2, ..., T, H, D\]"):
        kvarn.quantize(torch.zeros(3, 128, 1, 64))


def test_rejects_mismatched_kv():
    with pytest.raises(ValueError, match="k and v must match"):
        kvarn.quantize((torch.zeros(128, 2, 64), torch.zeros(128, 1, 64)))
    with pytest.raises(ValueError, match="k and v must match"):
        kvarn.quantize((torch.zeros(128, 2, 64), torch.zeros(128, 2, 64, dtype=torch.float16)))


def test_rejects_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim must be a power of two for the Hadamard stage, got 96"):
        kvarn.quantize(_kv(128, 1, 96))


def test_rejects_unknown_preset():
    with pytest.raises(ValueError, match="unknown KVarN preset 'int4'; valid presets are: kvarn_k4v2_g128"):
        kvarn.quantize(_kv(128, 1, 64), "int4")


def test_rejects_nonfinite_values():
    k, v = _kv(128, 1, 64)
    k[3, 0, 1] = float("nan")
    v[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="k holds 1 NaN/inf values"):
        kvarn.quantize((k, v))


def test_rejects_bad_role_and_bits():
    with pytest.raises(ValueError, match="role must be 'key' or 'value'"):
        kvarn.quantize(torch.zeros(128, 1, 64), role="query")
    with pytest.raises(ValueError, match="bits= applies to the single-tensor form"):
        kvarn.quantize(_kv(128, 1, 64), bits=2)
    with pytest.raises(ValueError, match="k_bits must be one of"):
        kvarn.quantize(torch.zeros(128, 1, 64), role="key", bits=3)
    with pytest.raises(TypeError, match="preset must be a preset name or a KVarNConfig, got int"):
        kvarn.quantize(_kv(128, 1, 64), 4)


def test_refuses_inputs_that_require_grad():
    """Rounding has no useful gradient: an input needing one is refused, not given zeros for every quantized token."""
    k, v = (x.float().requires_grad_() for x in _kv(300, 2, 64))
    with pytest.raises(ValueError, match=r"k requires grad.*k\.detach\(\).*torch\.no_grad\(\)"):
        kvarn.quantize((k, v))
    with pytest.raises(ValueError, match=r"kv requires grad"):
        kvarn.quantize(torch.stack([k, v]))
    with pytest.raises(ValueError, match=r"kv requires grad"):
        kvarn.quantize(k, role="key")
    with torch.no_grad():
        q = kvarn.quantize((k, v))
    assert not q.dequantize()[0].requires_grad
    assert kvarn.quantize((k.detach(), v.detach())) == q


def test_rejects_meta_tensors():
    k = torch.empty(256, 2, 64, device="meta")
    with pytest.raises(ValueError, match=r"k is a meta tensor.*no values to quantize"):
        kvarn.quantize((k, k))


def test_impl_triton_on_cpu_tensors_says_what_to_change(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k, v = _kv(256, 2, 64)
    with pytest.raises(ValueError, match=r"impl='triton' runs the Triton kernels on CUDA tensors.*cpu.*impl='auto'"):
        kvarn.quantize((k, v), impl="triton")
    q = kvarn.quantize((k, v))
    with pytest.raises(ValueError, match=r"impl='triton' runs the Triton kernels on CUDA tensors"):
        q.dequantize(impl="triton")


def test_head_dim_error_names_the_supported_head_dims():
    for d in (96, 32, 512):
        with pytest.raises(ValueError, match=rf"head_dim must be .*got {d} \(the last dim of k\)") as e:
            kvarn.quantize(_kv(128, 1, d))
        assert "64, 128 or 256" in str(e.value)


def test_a_single_unstacked_tensor_says_what_to_pass():
    with pytest.raises(ValueError, match=r"a single tensor must be a stacked \[2, T, H, D\] K/V pair.*\(k, v\) tuple"):
        kvarn.quantize(torch.zeros(256, 2, 64))


def test_to_a_dtype_fails_at_once():
    q = kvarn.quantize(_kv(256, 2, 64))
    t = kvarn.quantize(_kv(256, 2, 64)[0], role="key")
    for obj in (q, t):
        with pytest.raises(TypeError, match=r"\.to\(\) moves .* between devices only.*dequantize\(\)"):
            obj.to(torch.float16)
        with pytest.raises(ValueError, match="not a device"):
            obj.to("float16")


@pytest.mark.parametrize("field", ["shape", "records", "k_rest", "dtype"])
def test_fields_that_disagree_are_refused_when_built_and_loaded(field):
    k, v = _kv(300, 2, 64)
    q = kvarn.quantize((k, v))
    bad = {
        "shape": torch.Size([100, 2, 64]),
        "records": q.records[:1],
        "k_rest": q.k_rest[:3],
        "dtype": torch.float32,
    }[field]
    with pytest.raises(ValueError, match="QuantizedKV fields disagree"):
        dataclasses.replace(q, **{field: bad})
    edited = object.__new__(kvarn.QuantizedKV)
    edited.__dict__.update({**q.__dict__, field: bad})
    buf = io.BytesIO()
    torch.save(edited, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="QuantizedKV fields disagree"):
        torch.load(buf, weights_only=True)


@pytest.mark.parametrize("field", ["shape", "packed", "scale", "col", "rest"])
def test_tensor_fields_that_disagree_are_refused_when_built_and_loaded(field):
    t = kvarn.quantize(_kv(300, 2, 64)[0], role="key")
    bad = {
        "shape": torch.Size([100, 2, 64]),
        "packed": t.packed[..., :-1],
        "scale": t.scale.float(),
        "col": t.col[:1],
        "rest": t.rest[:3],
    }[field]
    with pytest.raises(ValueError, match="QuantizedTensor fields disagree"):
        dataclasses.replace(t, **{field: bad})
    edited = object.__new__(kvarn.QuantizedTensor)
    edited.__dict__.update({**t.__dict__, field: bad})
    buf = io.BytesIO()
    torch.save(edited, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="QuantizedTensor fields disagree"):
        torch.load(buf, weights_only=True)


def test_dequantize_rejects_other_objects():
    with pytest.raises(TypeError, match=r"dequantize takes what kvarn\.quantize returned"):
        kvarn.dequantize(torch.zeros(3))


def test_import_kvarn_needs_no_triton_or_vllm():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['vllm'] = None; sys.modules['transformers'] = None\n"
        "import kvarn, torch\n"
        "q = kvarn.quantize(torch.randn(2, 128, 1, 64))\n"
        "from kvarn import ops\n"
        "print(ops.triton_available())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- on the GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("preset,d", [("kvarn_k4v2_g128", 128), ("kvarn_k4v2_g64", 64), ("kvarn_k2v2_g128", 256)])
def test_cuda_quantize_is_the_kernels_bytes(preset, d, dtype):
    """On CUDA, kvarn.quantize stores with the Triton kernels: byte for byte ops.encode_records of the
    tiles the kernels' own prepare wrote (the tail path: ops.write_tail, then ops.encode_records)."""
    from kvarn.kernels import store

    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    g, h, n = cfg.group_size, 4, 3
    k, v = (x.cuda() for x in _kv(2, n * g + 5, h, d, dtype=dtype, seed=d))
    q = kvarn.quantize((k, v), preset)
    assert q.records.device.type == "cuda" and q.records.shape == (2, n, h, cfg.record_bytes)

    def tiles(x):
        return x[:, : n * g].reshape(2 * n * g, h, d)

    pool_k = torch.full((2 * n, g, h, d), float("nan"), dtype=dtype, device="cuda")
    pool_v = pool_k.clone()
    kvarn.ops.write_tail(tiles(k), tiles(v), pool_k, pool_v, torch.arange(2 * n * g, device="cuda"), cfg)
    want = kvarn.ops.encode_records(pool_k.transpose(1, 2), pool_v.transpose(1, 2), cfg)
    assert kvarn.ops._pick("encode_records", "auto", pool_k) is store.encode_records
    assert torch.equal(q.records.reshape(2 * n, h, -1), want)
    k2, v2 = q.dequantize()
    assert k2.device.type == "cuda" and torch.equal(k2[:, n * g :], k[:, n * g :])
    ref = kvarn.quantize((k.cpu(), v.cpu()), preset).dequantize()
    for a, b, x in ((k2, ref[0], k), (v2, ref[1], v)):
        assert abs(_rel(a[:, : n * g].cpu(), x[:, : n * g].cpu()) - _rel(b[:, : n * g], x[:, : n * g].cpu())) < 0.01
    assert q.to("cpu").to("cuda") == q


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_out_of_range_tiles():
    """The scaled paths on the kernels: fp16 rotation overflow, tiny fp16 and bf16 tiles."""
    g = torch.Generator().manual_seed(1)
    big = (20000 + 2000 * torch.randn(256, 2, 128, generator=g)).half().cuda()
    ek, _ = _errors(big, big)
    assert ek < 0.02
    for dtype, scale in ((torch.float16, 1e-6), (torch.bfloat16, 1e-20), (torch.bfloat16, 1e20)):
        x = (UNIT * scale).to(dtype)
        uk, uv = _unit_errors(dtype)
        ek, ev = _errors(x.cuda(), x.cuda())
        assert ek < 2 * uk and ev < 2 * uv, (dtype, scale, ek, ev)
