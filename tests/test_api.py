"""kvarn.quantize / kvarn.dequantize: shapes, dtypes, forms, errors and the documented policies."""

import dataclasses

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


def test_cuda_if_available():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    k, v = _kv(256, 2, 128)
    q = kvarn.quantize((k.cuda(), v.cuda()))
    k2, _ = q.dequantize()
    assert k2.device.type == "cuda"
    torch.testing.assert_close(k2.cpu(), kvarn.quantize((k, v)).dequantize()[0], atol=0.05, rtol=0.05)


def test_zero_input_is_exact():
    k = torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16)
    k2, v2 = kvarn.quantize((k, k.clone())).dequantize()
    assert torch.equal(k2, k) and torch.equal(v2, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_input_is_finite_and_close(dtype):
    # Not bit-exact: the rotated frame is rounded to the input dtype and row parameters to fp16
    # (docs/api.md). The error stays within a few units of fp16 rounding of the value.
    for a in (-7.5, 0.25, 300.0):
        k = torch.full((256, 2, 128), a, dtype=dtype)
        k2, v2 = kvarn.quantize((k, k)).dequantize()
        for x in (k2, v2):
            assert torch.all(torch.isfinite(x.float()))
            assert float((x.float() - a).abs().max()) <= abs(a) * 0.1


def test_bf16_beyond_fp16_range_stores_no_inf():
    k, v = _kv(256, 2, 128, dtype=torch.bfloat16)
    k[:, 0, 3] = 1e30
    v[5] = -3e38
    q = kvarn.quantize((k, v))
    _, rest = kvarn.reference.unpack_record(q.records, q.config)
    for t in rest[1:]:
        assert torch.all(torch.isfinite(t.float()))
    k2, v2 = q.dequantize()
    assert torch.all(torch.isfinite(k2.float())) and torch.all(torch.isfinite(v2.float()))
    # saturated at MAX_ABS (2^24), not inf: the huge channel comes back large and of the right sign
    assert float(k2[:, 0, 3].float().min()) > 1e6


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
