"""Key smoothing (``KVarNConfig(smooth_keys=True)``, ``kvarn/reference/smooth.py``): an option of the reference path."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import KINDS, make_tile
from tolerances import ROUNDTRIP_REL

import kvarn
from kvarn import ops
from kvarn.config import KVarNConfig
from kvarn.reference import decode_records, encode_records, prepare, rotate, unpack_record
from kvarn.reference.smooth import SMOOTH_DTYPE, SMOOTH_MIN, smooth, smoothing_vector, unsmooth


def _cfg(preset="kvarn_k4v2_g128", head_dim=64, **kw):
    return KVarNConfig.from_preset(preset, head_dim=head_dim, smooth_keys=True, **kw)


def _quiet_channel_keys(t=256, h=2, d=64, seed=0):
    """Keys with one channel of large offset and small spread (where Qwen2.5's queries are large)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g)
    k[..., 5] = 30 + 0.05 * torch.randn(t, h, generator=g)
    return k


@given(st.sampled_from(KINDS), st.sampled_from([64, 128, 256]), st.integers(0, 2**16))
def test_smoothing_vector_is_stored_exactly_and_bounded(kind, d, seed):
    k_rot = make_tile(128, d, kind, seed)  # [G, D]
    s = smoothing_vector(k_rot)
    assert s.shape == (d,)
    assert torch.equal(s, s.to(SMOOTH_DTYPE).float())  # fp8 storage loses nothing
    assert float(s.min()) >= SMOOTH_MIN and float(s.max()) <= 1.0
    if kind in ("constant", "zero"):
        assert torch.all(s == 1)


def test_smooth_and_unsmooth_are_inverse():
    k_rot = rotate(_quiet_channel_keys()[:128, 0])
    s = smoothing_vector(k_rot)
    torch.testing.assert_close(unsmooth(smooth(k_rot, s), s), k_rot, atol=1e-4, rtol=1e-5)
    assert int(s.argmin()) == 5 and float(s[5]) < 0.3  # the quiet channel is the one scaled up (~0.05^0.5)


@pytest.mark.parametrize("preset", ["kvarn_k4v2_g128", "kvarn_k2v2_g128", "kvarn_k4v4_g64"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_record_layout_adds_one_byte_per_channel(preset, head_dim):
    plain = KVarNConfig.from_preset(preset, head_dim=head_dim)
    cfg = _cfg(preset, head_dim)
    assert cfg.record_bytes == plain.record_bytes + head_dim
    assert cfg.offsets["k_smooth"] == plain.record_bytes
    assert {k: v for k, v in cfg.offsets.items() if k != "k_smooth"} == plain.offsets
    k = prepare(torch.randn(3, cfg.group_size, head_dim))
    records = encode_records(k, prepare(torch.randn(3, cfg.group_size, head_dim)), cfg)
    assert records.shape == (3, cfg.record_bytes)
    k_half, _ = unpack_record(records, cfg)
    assert k_half.smooth.dtype == SMOOTH_DTYPE and k_half.smooth.shape == (3, head_dim)
    k2, _ = decode_records(records, cfg)
    assert float((k2 - k.float()).norm() / k.float().norm()) < ROUNDTRIP_REL[cfg.k_bits]


def test_smoothing_cuts_the_error_of_a_quiet_channel():
    """The channel with small spread comes back with a smaller error; the whole tile about as well."""
    k, v = _quiet_channel_keys(), torch.randn(256, 2, 64)
    errs = {}
    for sm in (False, True):
        cfg = KVarNConfig.from_preset("kvarn_k4v2_g128", head_dim=64, smooth_keys=sm)
        k2, _ = kvarn.quantize((k, v), cfg).dequantize()
        errs[sm] = (float((k2[..., 5] - k[..., 5]).abs().mean()), float((k2 - k).norm() / k.norm()))
    assert errs[True][0] < errs[False][0] / 2
    assert errs[True][1] < errs[False][1] * 1.1


def test_quantize_tensor_and_pair_agree_and_round_trip_through_torch_save(tmp_path):
    k, v = _quiet_channel_keys(), torch.randn(256, 2, 64)
    cfg = _cfg()
    pair = kvarn.quantize((k, v), cfg)
    one = kvarn.quantize(k, cfg, role="key")
    assert one.smooth is not None and one.smooth.shape == (2, 2, 64)
    torch.testing.assert_close(one.dequantize(), pair.dequantize()[0])
    assert pair.nbytes == 2 * 2 * cfg.record_bytes
    torch.save(one, tmp_path / "q.pt")
    assert torch.load(tmp_path / "q.pt") == one


def test_auto_picks_the_smoothed_kernels_that_exist(monkeypatch):
    """``auto`` and ``triton`` pick the smoothed kernels where they exist; elsewhere the reference, or an error."""
    from types import SimpleNamespace

    from kvarn import reference

    kernels = {name: object() for name in ("encode_records", "decode_records", "paged_attention", "write_tail")}
    monkeypatch.setattr(ops, "_triton_ops", lambda: kernels)
    cuda_half = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16)
    for name in ("encode_records", "decode_records", "paged_attention"):
        assert ops._pick(name, "auto", cuda_half) is kernels[name]
        assert ops._pick(name, "auto", cuda_half, smoothed=True) is kernels[name]
        assert ops._pick(name, "triton", cuda_half, smoothed=True) is kernels[name]
    for name in ("encode_half", "decode_half", "scale_half", "scale_records"):
        assert ops._pick(name, "auto", cuda_half, smoothed=True) is getattr(reference, name)
        with pytest.raises(ValueError, match="smooth_keys"):
            ops._pick(name, "triton", cuda_half, smoothed=True)
    cfg = _cfg()
    k = prepare(torch.randn(1, 128, 64))
    half = ops.encode_half(k, "key", cfg)  # auto: the reference
    with pytest.raises(ValueError, match="smooth_keys"):
        ops.decode_half(half, "key", impl="triton")
    assert ops.encode_records(k, k, cfg).shape[-1] == cfg.record_bytes


def test_smoothing_needs_the_rotation():
    with pytest.raises(ValueError, match="rotate"):
        KVarNConfig(smooth_keys=True, rotate=False)
