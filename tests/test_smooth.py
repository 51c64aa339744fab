"""Key smoothing (``KVarNConfig(smooth_keys=True)``, ``kvarn/reference/smooth.py``): an option of the reference path."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import KINDS, make_tile
from tolerances import ROUNDTRIP_REL

import kvarn
from kvarn import ops
from kvarn import reference as R
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


# One vector per sequence (``smooth_scope="sequence"``)


def _seq_cfg(preset="kvarn_k4v2_g128", head_dim=64):
    return _cfg(preset, head_dim, smooth_scope="sequence")


def test_sequence_scope_needs_smooth_keys_and_a_known_scope():
    with pytest.raises(ValueError, match="smooth_keys"):
        KVarNConfig(smooth_scope="sequence")
    with pytest.raises(ValueError, match="smooth_scope"):
        KVarNConfig(smooth_keys=True, smooth_scope="layer")
    assert _seq_cfg().seq_smooth and not _cfg().seq_smooth
    assert _seq_cfg().record_bytes == _cfg().record_bytes  # same bytes: the vector is in every record


def test_sequence_vector_leaves_out_the_first_token():
    from kvarn.reference.smooth import SEQ_SMOOTH_SKIP, sequence_smoothing_vector

    tile = rotate(_quiet_channel_keys()[:128, 0])
    spiked = tile.clone()
    spiked[0] = rotate(torch.full((64,), 500.0))  # a BOS-like first key
    assert torch.equal(sequence_smoothing_vector(spiked), smoothing_vector(tile[SEQ_SMOOTH_SKIP:]))
    assert not torch.equal(smoothing_vector(spiked), smoothing_vector(tile))


def test_quantize_sequence_scope_stores_the_first_tiles_vector_in_every_record():
    from kvarn.reference.smooth import sequence_smoothing_vector

    cfg = _seq_cfg()
    k = torch.stack([_quiet_channel_keys(384, seed=s) for s in (1, 2)])  # [2 sequences, 384, H, D]
    k[1, 200:] *= torch.linspace(0.1, 3.0, 64)  # later tiles of sequence 1 have other spreads
    v = torch.randn_like(k)
    q = kvarn.quantize((k, v), cfg)
    field = slice(cfg.offsets["k_smooth"], cfg.record_bytes)
    s = q.records[..., field].view(SMOOTH_DTYPE).float()  # [2, 3 tiles, H, D]
    first = prepare(k[:, :128].transpose(1, 2), k.dtype)  # [2, H, G, D]
    assert torch.equal(s, sequence_smoothing_vector(first)[:, None].expand_as(s))
    # the decoder needs nothing new: each record dequantizes with its own (equal) vector
    k2, _ = q.dequantize()
    assert float((k2 - k).norm() / k.norm()) < ROUNDTRIP_REL[cfg.k_bits]
    one = kvarn.quantize(k, cfg, role="key")  # the single-tensor form agrees
    torch.testing.assert_close(one.dequantize(), k2)


def test_store_and_commit_take_the_vector_from_the_source_record():
    """A later tile (own block != smooth_src) is encoded with the vector of its sequence's first record."""
    cfg = _seq_cfg()
    g, h, d = cfg.group_size, 2, 64
    k = torch.stack([_quiet_channel_keys(g, h, d, seed=s) for s in (3, 4)])  # tiles [2, G, H, D]
    k[1] *= torch.linspace(0.2, 2.0, d)
    v = torch.randn_like(k)
    cache = torch.zeros(4, h, cfg.record_bytes, dtype=torch.uint8)
    R.store_tiles(k[:1], v[:1], torch.tensor([2]), cache, cfg, torch.tensor([2]))  # the first tile, block 2
    R.store_tiles(k[1:], v[1:], torch.tensor([0]), cache, cfg, torch.tensor([2]))  # a later tile, block 0
    field = slice(cfg.offsets["k_smooth"], cfg.record_bytes)
    assert torch.equal(cache[0, :, field], cache[2, :, field])
    # both in one call give the same bytes (the first tile publishes its vector before the others read it)
    both = torch.zeros_like(cache)
    R.store_tiles(k.flip(0), v.flip(0), torch.tensor([0, 2]), both, cfg, torch.tensor([2, 2]))
    assert torch.equal(both, cache)
    # commit from the pool: the same bytes as the store
    pool_k = torch.zeros(3, g, h, d)
    pool_v = torch.zeros_like(pool_k)
    mapping = torch.cat([torch.arange(g) + 2 * g, torch.arange(g)])  # tile 0 -> slot 2, tile 1 -> slot 0
    R.write_tail(k.reshape(-1, h, d), v.reshape(-1, h, d), pool_k, pool_v, mapping, cfg)
    committed = torch.zeros_like(cache)
    R.commit_tiles(
        pool_k, pool_v, torch.tensor([0, -1, 2]), torch.tensor([0, 1, 2]), committed, cfg, torch.tensor([2, 2, 2])
    )
    assert torch.equal(committed[[0, 2]], cache[[0, 2]]) and not committed[1].any()


def test_a_given_vector_is_clamped_and_rounded_as_stored():
    """encode_half with smooth_vec divides by, and stores, the same fp8 vector in [SMOOTH_MIN, 1]."""
    from kvarn.reference.smooth import SMOOTH_MIN, stored_smoothing_vector

    raw = torch.tensor([float("nan"), -1.0, 0.0, 1e-3, 0.3, 0.77, 1.0, 7.0, float("inf"), -float("inf")])
    s = stored_smoothing_vector(raw)
    assert s.tolist() == [SMOOTH_MIN, SMOOTH_MIN, SMOOTH_MIN, SMOOTH_MIN, 0.3125, 0.75, 1.0, 1.0, 1.0, SMOOTH_MIN]
    valid = smoothing_vector(rotate(_quiet_channel_keys()[:128, 0]))
    assert torch.equal(stored_smoothing_vector(valid), valid)  # what the store computes passes unchanged
    cfg = _seq_cfg()
    k = rotate(_quiet_channel_keys()[:128, :1].transpose(0, 1))  # [1, G, D]
    given = torch.linspace(0.001, 1.3, 64)  # neither fp8 nor in range
    half = R.encode_half(k, "key", cfg, given)
    assert torch.equal(half.smooth.float(), stored_smoothing_vector(given).expand(1, 64))
    assert torch.equal(R.decode_half(half, "key"), R.decode_half(R.encode_half(k, "key", cfg, half.smooth), "key"))


def test_store_checks_smooth_src():
    cfg = _seq_cfg()
    k = torch.randn(1, cfg.group_size, 1, 64)
    cache = torch.zeros(1, 1, cfg.record_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="smooth_src"):
        R.store_tiles(k, k, torch.tensor([0]), cache, cfg)
    with pytest.raises(ValueError, match="smooth_src"):
        R.store_tiles(k, k, torch.tensor([0]), cache, cfg, torch.tensor([0, 0]))
    plain = _cfg()
    with pytest.raises(ValueError, match="smooth_src"):
        R.store_tiles(
            k, k, torch.tensor([0]), torch.zeros(1, 1, plain.record_bytes, dtype=torch.uint8), plain, torch.tensor([0])
        )
