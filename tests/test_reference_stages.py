"""One test group per reference stage: Hadamard, normalization, RTN, packing, dequantization."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import make_tile, tiles
from tolerances import ROTATE_ROUNDTRIP, ROUNDTRIP_REL

from kvarn.config import KEY_CLIP, VALUE_CLIP, KVarNConfig
from kvarn.reference import (
    choose_qparams,
    clip_shrinks,
    decode_half,
    decode_records,
    dequantize_half,
    dequantize_rows,
    encode_half,
    encode_records,
    from_pool,
    hadamard_matrix,
    imbalance,
    input_exponent,
    merge_tiles,
    pack_codes,
    pool_exponent,
    prepare,
    quantize_half,
    quantize_rows,
    rotate,
    scale_records,
    sinkhorn,
    split_tiles,
    unpack_codes,
    unpack_record,
)
from kvarn.reference.normalize import LOG_SCALE_MAX, LOG_SCALE_MIN
from kvarn.reference.quantize import MAX_ABS, ROW_PARAM_RANGE, range_exponent, tiny_exponent

# --- tiling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0, 1, 63, 64, 65, 200])
def test_tiling_roundtrip_and_layout(t):
    x = torch.randn(3, t, 2, 8)
    tiles_, rest = split_tiles(x, 64)
    assert tiles_.shape == (3, t // 64, 2, 64, 8) and rest.shape == (3, t % 64, 2, 8)
    if t >= 64:  # tile n, head h is tokens n*G .. n*G+G-1 of head h
        assert torch.equal(tiles_[:, 0, 1], x[:, :64, 1])
    assert torch.equal(merge_tiles(tiles_, rest), x)


# --- Hadamard -----------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_orthonormal_symmetric_self_inverse(d):
    h = hadamard_matrix(d).double()
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.all(h.abs() == h[0, 0]) and h[0, 0] == pytest.approx(d**-0.5)
    assert torch.all(h[0] > 0) and torch.all(h[:, 0] > 0)  # Sylvester: no random signs


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_sylvester_recursion(d):
    h = hadamard_matrix(d) * d**0.5
    half = hadamard_matrix(d // 2) * (d // 2) ** 0.5 if d > 64 else None
    n = d // 2
    assert torch.equal(h[:n, :n], h[:n, n:]) and torch.equal(h[n:, :n], -h[n:, n:])
    assert torch.equal(h[:n, :n], h[n:, :n])
    if half is not None:
        torch.testing.assert_close(h[:n, :n], half)


def test_rotation_preserves_dot_products_and_inverts():
    x, y = torch.randn(2, 50, 128).unbind(0)
    torch.testing.assert_close(rotate(rotate(x)), x, atol=ROTATE_ROUNDTRIP * 10, rtol=ROTATE_ROUNDTRIP)
    torch.testing.assert_close((rotate(x) * rotate(y)).sum(-1), (x * y).sum(-1), atol=1e-4, rtol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    x = torch.zeros(128)
    x[7] = 100.0
    assert rotate(x).abs().max() == pytest.approx(100 / 128**0.5, rel=1e-6)


# --- normalization ------------------------------------------------------------------------------


def test_imbalance_of_a_balanced_tile_is_two():
    x = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    assert float(imbalance(x)) == pytest.approx(2.0)


@given(tiles())
@example((make_tile(128, 128, "outlier_channel", 1), "outlier_channel"))
def test_normalization_never_worse_than_identity(tile_kind):
    m, _ = tile_kind
    r, c = sinkhorn(m, 8)
    balanced = m / (r[:, None] * c[None, :])
    assert float(imbalance(balanced)) <= float(imbalance(m)) * (1 + 1e-5)
    # the clamps: every accumulated log-scale stays in [LOG_SCALE_MIN, LOG_SCALE_MAX]
    for s in (r, c):
        assert torch.all(s.log() >= LOG_SCALE_MIN - 1e-5) and torch.all(s.log() <= LOG_SCALE_MAX + 1e-5)


@given(tiles(kinds=("gaussian", "outlier_channel", "heavy_tokens")))
def test_best_iterate_is_monotone_in_iterations(tile_kind):
    m, _ = tile_kind
    prev = float(imbalance(m))
    for iters in range(1, 6):
        r, c = sinkhorn(m, iters)
        cur = float(imbalance(m / (r[:, None] * c[None, :])))
        assert cur <= prev * (1 + 1e-5)
        prev = cur


def test_zero_iterations_is_identity():
    r, c = sinkhorn(torch.randn(64, 128), 0)
    assert torch.equal(r, torch.ones(64)) and torch.equal(c, torch.ones(128))


def test_normalization_balances_a_rank_one_scaled_tile():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(128, 128, generator=g) * torch.logspace(-1, 1, 128)[:, None] * torch.logspace(0, 1.5, 128)
    r, c = sinkhorn(m, 8)
    assert float(imbalance(m / (r[:, None] * c[None, :]))) < 0.2 * float(imbalance(m))


def test_batched_normalization_equals_per_tile():
    m = torch.stack([make_tile(64, 64, k, 3) for k in ("gaussian", "outlier_channel", "zero")])
    r, c = sinkhorn(m, 8)
    for i in range(3):
        ri, ci = sinkhorn(m[i], 8)
        assert torch.equal(r[i], ri) and torch.equal(c[i], ci)


# --- RTN ----------------------------------------------------------------------------------------


def test_qparams_formula():
    b = torch.tensor([[0.0, 1.0, 3.0], [-2.0, -2.0, -2.0]])
    lo, step = choose_qparams(b, 2)
    assert lo.tolist() == [0.0, -2.0]
    assert step[0] == pytest.approx(1.0) and step[1] == pytest.approx(1e-10)


def test_rounding_is_half_to_even_and_clamped():
    lo = torch.zeros(1)
    step = torch.ones(1)
    b = torch.tensor([[0.5, 1.5, 2.5, 3.49, 14.5, 20.0, -3.0]])
    assert quantize_rows(b, lo, step, 4).tolist() == [[0, 2, 2, 3, 14, 15, 0]]


def _row_error(b, lo, step, bits):
    codes = quantize_rows(b, lo, step, bits).float()
    return (codes * step[..., None] + lo[..., None] - b).square().sum(-1)


@given(tiles(), st.sampled_from([2, 4]), st.sampled_from([KEY_CLIP, VALUE_CLIP, (7, 3)]))
def test_clipped_range_never_rounds_worse(tile_kind, bits, clip):
    b, _ = tile_kind
    b = b.float()
    lo0, step0 = choose_qparams(b, bits)
    lo, step = choose_qparams(b, bits, clip)
    assert torch.isfinite(lo).all() and (step >= 1e-10).all()
    assert (_row_error(b, lo, step, bits) <= _row_error(b, lo0, step0, bits)).all()
    # each row's range is the min/max range shrunk by one of the grid's fractions, half at each end
    width = b.amax(-1) - b.amin(-1)
    shrinks = torch.tensor(clip_shrinks(clip))
    got = (lo - lo0) * 2 / width.clamp_min(1e-30)
    near = (got[..., None] - shrinks).abs().amin(-1)
    assert bool(((near <= 1e-4) | (width < 1e-20)).all())


def test_clip_grid_is_checked():
    assert clip_shrinks(None) == (0.0,)
    assert clip_shrinks((20, 10))[-1] == 0.45
    for bad in ((0, 1), (4, 0), (4, 5)):
        with pytest.raises(ValueError, match="clip must be"):
            clip_shrinks(bad)


def test_clipped_range_keeps_min_max_on_ties_and_shrinks_gaussian_rows():
    # a row the min/max range rounds exactly keeps it (shrink 0 comes first)
    b = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-2.0, -2.0, -2.0, -2.0]])
    plain = [t.tolist() for t in choose_qparams(b, 2)]
    assert [t.tolist() for t in choose_qparams(b, 2, KEY_CLIP)] == plain
    # Gaussian rows of 128 at 2 bits: the min/max range spans ~5 std, four levels do best with ~3;
    # the key grid (up to 45%) about halves the squared error, the value grid (up to 20%) less
    g = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    before = _row_error(g, *choose_qparams(g, 2), 2).sum()
    after_k = _row_error(g, *choose_qparams(g, 2, KEY_CLIP), 2).sum()
    after_v = _row_error(g, *choose_qparams(g, 2, VALUE_CLIP), 2).sum()
    assert after_k < 0.6 * before and after_k < after_v < 0.85 * before


@pytest.mark.parametrize("preset", ["kvarn_k2v2_g128", "kvarn_k4v2_g128", "kvarn_k4v4_g64"])
def test_only_two_bit_halves_clip(preset):
    cfg = KVarNConfig.from_preset(preset, head_dim=64)
    assert cfg.k_clip == (KEY_CLIP if cfg.k_bits == 2 else None)
    assert cfg.v_clip == (VALUE_CLIP if cfg.v_bits == 2 else None)
    plain = KVarNConfig.from_preset(cfg, clip=False)
    assert plain.k_clip is None and plain.v_clip is None
    gen = torch.Generator().manual_seed(1)
    tiles_ = torch.randn(3, cfg.group_size, 64, generator=gen)
    tiles_[..., 5] += 40 * torch.randn(3, cfg.group_size, generator=gen)
    prepared = prepare(tiles_, torch.float32)
    for role, bits in (("key", cfg.k_bits), ("value", cfg.v_bits)):
        same = torch.equal(encode_half(prepared, role, cfg).codes, encode_half(prepared, role, plain).codes)
        assert same == (bits == 4), role


@given(tiles(), st.sampled_from([2, 4]))
def test_codes_in_range(tile_kind, bits):
    m, _ = tile_kind
    codes = quantize_half(m, bits).codes
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1


# --- packing ------------------------------------------------------------------------------------


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 64, 128]), st.integers(1, 9), st.integers(0, 2**16))
def test_pack_unpack_bijective(bits, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (2, rows, cols), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, rows * bits // 8, cols) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    # and bytes -> codes -> bytes: every byte value is a valid packing
    raw = torch.randint(0, 256, (rows * bits // 8, cols), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_codes(unpack_codes(raw, bits), bits), raw)


def test_packing_is_planar_low_bits_first():
    codes = torch.arange(4, dtype=torch.uint8)[:, None]  # rows 0..3, one column
    assert pack_codes(codes, 4)[:, 0].tolist() == [0 | (2 << 4), 1 | (3 << 4)]
    assert pack_codes(codes, 2)[:, 0].tolist() == [0 | (1 << 2) | (2 << 4) | (3 << 6)]


def test_pack_rejects_bad_rows():
    with pytest.raises(ValueError, match="rows"):
        pack_codes(torch.zeros(3, 4, dtype=torch.uint8), 4)


# --- dequantization and the tile-half round trip ------------------------------------------------


def test_dequantize_formula():
    codes = torch.tensor([[0, 3], [1, 2]], dtype=torch.uint8)
    scale = torch.tensor([2.0, 0.5], dtype=torch.float16)
    zero = torch.tensor([-1.0, 1.0], dtype=torch.float16)
    col = torch.tensor([1.0, 4.0], dtype=torch.bfloat16)
    expected = torch.tensor([[(0 * 2 - 1) * 1.0, (3 * 2 - 1) * 4.0], [(1 * 0.5 + 1) * 1.0, (2 * 0.5 + 1) * 4.0]])
    assert torch.equal(dequantize_rows(codes, scale, zero, col), expected)


@given(tiles(kinds=("gaussian", "heavy_tokens", "tiny", "huge")), st.sampled_from([2, 4]))
def test_roundtrip_error_bounded(tile_kind, bits):
    m, _ = tile_kind
    rec = dequantize_half(quantize_half(m, bits))
    assert float((rec - m).norm() / m.norm()) < ROUNDTRIP_REL[bits]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("outlier", [10.0, 30.0])
def test_normalization_helps_on_outlier_columns(bits, outlier):
    # An outlier column (a V channel) inflates every row's range; the column scales absorb it.
    # Measured crossover (docs/internals/algorithm.md): from ~100x at 2 bits the tile's Frobenius error is
    # mostly the outlier column's own, which the normalization scales up with the column.
    m = make_tile(128, 128, "gaussian", int(outlier))
    m[:, 5] *= outlier
    err = {}
    for norm in (True, False):
        rec = dequantize_half(quantize_half(m, bits, normalize=norm))
        err[norm] = float((rec - m).norm() / m.norm())
    assert err[True] < 0.7 * err[False]


@given(tiles(kinds=("zero",)), st.sampled_from([2, 4]))
def test_zero_tile_is_exact(tile_kind, bits):
    m, _ = tile_kind
    half = quantize_half(m, bits)
    assert torch.equal(dequantize_half(half), m)


def test_constant_tile_error_is_fp16_rounding():
    # Codes are exact here; what is left is the fp16 rounding of the stored row parameters.
    for a in (-11.26, 0.37, 3.0, 1e4):
        m = torch.full((128, 64), a)
        rec = dequantize_half(quantize_half(m, 2))
        assert torch.all(torch.isfinite(rec))
        assert float((rec - m).abs().max()) <= abs(a) * 2**-10


@given(tiles(), st.sampled_from([2, 4]))
def test_stored_parameters_are_finite_and_in_range(tile_kind, bits):
    m, _ = tile_kind
    half = quantize_half(m, bits)
    for t in (half.scale, half.zero, half.col):
        assert torch.all(torch.isfinite(t.float()))
    amax = torch.maximum(half.scale.float().abs().max(), half.zero.float().abs().max())
    assert amax < 2.0 ** ROW_PARAM_RANGE[1]
    assert torch.all(half.col.float() > 0)


def test_range_guard_moves_a_power_of_two():
    big = torch.randn(64, 64) * 1e12  # past what the clamped Sinkhorn scales (<= e^20) absorb
    half = quantize_half(big, 4)
    assert float(half.scale.float().abs().max()) < 1.0  # brought to [0.5, 1)
    ordinary = torch.randn(64, 64)
    s = torch.rand(64) + 0.1
    assert int(range_exponent(s, -s).max()) == 0  # ordinary tiles are stored as the method states
    assert float((dequantize_half(half) - big).norm() / big.norm()) < ROUNDTRIP_REL[4]
    half_ord = quantize_half(ordinary, 4)
    _, c = sinkhorn(ordinary, 8)
    torch.testing.assert_close(half_ord.col.float(), c.to(torch.bfloat16).float())


# --- range handling: tiny tiles, kvarn.quantize's input exponent, folding powers of two ---------


def _unit_amax(m: torch.Tensor) -> torch.Tensor:
    """``m`` scaled by a power of two so its largest |value| lies in [1, 2) (an ordinary tile)."""
    _, e = torch.frexp(m.abs().amax())
    return torch.ldexp(m, 1 - e.float())


@pytest.mark.parametrize("kind", ["gaussian", "outlier_channel", "heavy_tokens"])
@pytest.mark.parametrize("exp", [-30, -60, -100])
@pytest.mark.parametrize("bits", [2, 4])
def test_tiny_tile_is_the_unit_tile_rescaled(kind, exp, bits):
    # A tile half whose largest |value| is under 2^-24 is divided by a power of two first and the
    # power goes into its column scales: the same codes and row parameters as the tile at unit
    # range, column scales exactly 2^exp smaller. (Before: the RTN step floor 1e-10 made a tile of
    # randn * 1e-20 all zeros and cost 3x the error at 1e-10.)
    m = _unit_amax(make_tile(128, 64, kind, 3))
    tiny = torch.ldexp(m, torch.tensor(float(exp)))
    unit, small = quantize_half(m, bits), quantize_half(tiny, bits)
    assert torch.equal(small.codes, unit.codes)
    assert torch.equal(small.scale, unit.scale) and torch.equal(small.zero, unit.zero)
    assert torch.equal(small.col, torch.ldexp(unit.col.float(), torch.tensor(float(exp))).to(torch.bfloat16))
    rec, tiny = dequantize_half(small).double(), tiny.double()  # fp64: squares of 1e-30 underflow fp32
    assert float((rec - tiny).norm() / tiny.norm()) < ROUNDTRIP_REL[bits]


def test_tiny_exponent_leaves_ordinary_tiles_alone():
    m = make_tile(64, 64, "gaussian", 0)
    for scale in (2.0**-24, 1.0, 1e-6, 1e5):  # largest |value| >= 2^-24: stored as the method states
        assert int(tiny_exponent(m * scale / m.abs().amax()).abs().max()) == 0
    assert int(tiny_exponent(torch.zeros(64, 64))) == 0
    p = tiny_exponent(torch.full((64, 64), 2.0**-25))
    assert int(p) == -25  # brought to [1, 2)
    sub = torch.full((64, 64), 2.0**-140)  # an fp32 subnormal tile: the power stays a normal number
    assert int(tiny_exponent(sub)) == -126


def test_input_exponent_is_zero_wherever_prepare_stores_the_tile_as_is():
    x = torch.randn(3, 128, 128)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert int(input_exponent(x.to(dtype)).abs().max()) == 0
    near = (torch.randn(2, 128, 128) * 300).half()  # rotated values under 65504: no scaling
    assert float(rotate(near.float()).abs().max()) < 65504 and int(input_exponent(near).abs().max()) == 0


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_fp16_pool_form_holds_every_rotation_of_fp16_values(d):
    """A large common offset rotates into one channel, past 65504; the pool form stores it."""
    assert (
        pool_exponent(torch.float16, d) == {64: 3, 128: 4, 256: 4}[d] and 2 ** pool_exponent(torch.float16, d) >= d**0.5
    )
    assert pool_exponent(torch.bfloat16, d) == 0 and pool_exponent(torch.float32, d) == 0
    g = torch.Generator().manual_seed(d)
    x = (20000 + 2000 * torch.randn(2, 128, d, generator=g)).half()
    worst = torch.full((1, 1, d), 65504.0).half()  # the largest rotation an fp16 vector has
    for t in (x, worst):
        y = rotate(t.float())
        assert float(y.abs().max()) > 65504
        assert int(input_exponent(t).abs().max()) == 0  # kvarn.quantize stores it as the caches do
        back = from_pool(prepare(t))
        assert torch.isfinite(back).all()
        # fp16 rounding of y, with fp16's exponent range widened by 2^POOL_EXP
        assert float(((back - y).abs() / y.abs().clamp_min(2.0**-10)).max()) <= 2.0**-11
    assert int(input_exponent(x, rotate_=False).abs().max()) == 0


def test_the_fp16_pool_form_is_fp16_rounding_above_its_subnormals():
    """Ordinary tiles keep their bytes: for |y| >= 2^(POOL_EXP - 14) the pool form rounds like fp16."""
    x = torch.randn(4, 64, 128)
    y = rotate(x)  # what prepare rotates to, before rounding
    back = from_pool(prepare(x, torch.float16))
    normal = y.abs() >= 2.0 ** (pool_exponent(torch.float16, 128) - 14)
    want = y.half().float()
    assert 0 < int((~normal).sum()) and torch.equal(back[normal], want[normal])
    assert float((back - want).abs().max()) <= 2.0 ** (pool_exponent(torch.float16, 128) - 25)  # the subnormal end


def test_input_exponent_scales_values_wider_than_the_pool_form():
    # fp32 values stored through an fp16 pool whose rotation exceeds 2^POOL_EXP * 65504
    x = 1e5 + 100 * torch.randn(2, 128, 128)
    assert float(rotate(x).abs().max()) > 16 * 65504
    s = input_exponent(x, torch.float16)
    assert bool((s > 0).all())
    assert float(rotate(torch.ldexp(x, -s[:, None, None].float())).abs().max()) <= 16 * 65504


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_exponent_past_max_abs(dtype):
    x = (torch.randn(2, 64, 64) * torch.tensor([1e10, 10.0])[:, None, None]).to(dtype)
    s = input_exponent(x)
    assert int(s[1]) == 0 and int(s[0]) > 0
    assert float(torch.ldexp(x[0].float(), -s[0].float()).abs().max()) <= MAX_ABS


def test_input_exponent_fp16_subnormal_tiles():
    x = (torch.randn(2, 64, 64) * torch.tensor([1e-6, 1.0])[:, None, None]).half()
    s = input_exponent(x)
    assert int(s[1]) == 0 and int(s[0]) < 0
    amax = float(torch.ldexp(x[0].float(), -s[0].float()).abs().max())
    assert 1.0 <= amax < 2.0


def test_scale_records_is_exact():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k, v = (prepare(torch.randn(3, 64, 64)) for _ in range(2))
    rec = encode_records(k, v, cfg)
    ke, ve = torch.tensor([0, 20, -30]), torch.tensor([5, 0, -7])
    k2, v2 = decode_records(scale_records(rec, ke, ve, cfg), cfg)
    k1, v1 = decode_records(rec, cfg)
    assert torch.equal(k2, torch.ldexp(k1, ke[:, None, None].float()))
    assert torch.equal(v2, torch.ldexp(v1, ve[:, None, None].float()))


def _same(a, b):
    """Equal tensors, or both ``None`` (the smoothing vector of a V half or of an unsmoothed K half)."""
    return a is None and b is None if a is None or b is None else torch.equal(a, b)


@pytest.mark.parametrize("smooth_keys", [False, True])
def test_encode_half_is_the_record_orientation(smooth_keys):
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64, smooth_keys=smooth_keys)
    k, v = (prepare(torch.randn(2, 64, 64)) for _ in range(2))
    k_half, v_half = unpack_record(encode_records(k, v, cfg), cfg)
    for role, want, x in (("key", k_half, k), ("value", v_half, v)):
        got = encode_half(x, role, cfg)
        assert all(_same(a, b) for a, b in zip(got, want, strict=True))
    wk, wv = decode_records(encode_records(k, v, cfg), cfg)
    assert torch.equal(decode_half(k_half, "key"), wk) and torch.equal(decode_half(v_half, "value"), wv)
    assert encode_half(k, "key", cfg).codes.shape == (2, 64, 64)
    with pytest.raises(ValueError, match="role must be 'key' or 'value', got 'query'"):
        encode_half(k, "query", cfg)
