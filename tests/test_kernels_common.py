"""The kernels' shared helpers (``kvarn.kernels._common``: constants, record layout, fp8) and their
argument checks, under the Triton interpreter (``interpreted.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreted import INTERPRETER_MARKS, _common, attention, dequant, hadamard, store
from kernel_oracle import attention_args, build_cache, expect_math_constants

from kvarn import reference
from kvarn.config import PRESETS, SUPPORTED_HEAD_DIMS, KVarNConfig

pytestmark = INTERPRETER_MARKS


def test_constants_match_reference():
    expect_math_constants(_common)


def test_kernels_reject_bad_input():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k = torch.zeros(1, 64, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        store.encode_records(k, k, cfg)
    with pytest.raises(ValueError, match="records must be uint8"):
        dequant.decode_records(torch.zeros(1, 7, dtype=torch.uint8), cfg)
    with pytest.raises(ValueError, match="cache must be uint8"):
        store.store_tiles(k[None].half(), k[None].half(), torch.zeros(1), torch.zeros(1, 1, 3, dtype=torch.uint8), cfg)
    state = build_cache(cfg, [70], 1, torch.float16, seed=0)
    args = attention_args(state, torch.zeros(1, 2, 64, dtype=torch.float16), cfg)
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            attention.paged_attention(*args, num_splits=bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_rotate_is_the_references_bit_for_bit(d, dtype):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(3, 7, 2 * d, generator=gen) * torch.logspace(-3, 3, 2 * d)).to(dtype)
    x = x[..., ::2]  # strided, and 21 rows: a partial program
    x[0, 0, :3] = torch.tensor([65504.0, -1e-7, 0.0]).to(dtype)
    got = hadamard.rotate(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, reference.rotate(x))
    assert hadamard.rotate(x[:0]).shape == (0, 7, d)


def test_rotate_rejects_what_it_cannot_rotate():
    with pytest.raises(ValueError, match="power of two"):
        hadamard.rotate(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        hadamard.rotate(torch.zeros(2, 64, dtype=torch.float64))


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_record_layout_is_the_configs(preset, d, smooth):
    cfg = KVarNConfig.from_preset(preset, head_dim=d, smooth_keys=smooth)
    layout = _common.record_layout(cfg)
    assert (layout.D, layout.G, layout.K_BITS, layout.V_BITS) == (d, cfg.group_size, cfg.k_bits, cfg.v_bits)
    assert (layout.K_PER_BYTE, layout.V_PER_BYTE) == (8 // cfg.k_bits, 8 // cfg.v_bits)
    offsets = {name.lower(): getattr(layout, name) for name in layout._fields[6:]}
    assert offsets.pop("seq_smooth") is False
    assert offsets.pop("k_smooth") == cfg.offsets.get("k_smooth", -1)
    assert offsets == {k: v for k, v in cfg.offsets.items() if k != "k_smooth"}


def test_fp8_helpers_match_torch():
    """fp8 e4m3 rounding, bits and decoding in integer arithmetic equal torch's ``float8_e4m3fn`` casts."""
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_roundtrip(x_ptr, r_ptr, b_ptr, d_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        r = _common.fp8e4m3_round(tl.load(x_ptr + i))
        tl.store(r_ptr + i, r)
        tl.store(b_ptr + i, _common.fp8e4m3_bits(r))
        tl.store(d_ptr + i, _common.fp8e4m3_to_f32(tl.load(b_ptr + 256 + i)))

    gen = torch.Generator().manual_seed(0)
    x = torch.exp2(torch.empty(256).uniform_(-6, 0, generator=gen))  # the smoothing factors' range
    grid = torch.arange(1, 9) / 8 * 2.0**-6  # exact values and midpoints (ties to even) at the low end
    x[:16] = torch.cat([2.0**-6 + grid / 16, 1 - grid / 16])
    x[-1] = 1.0
    r = torch.empty_like(x)
    b = torch.zeros(512, dtype=torch.uint8)
    b[256:] = torch.arange(256, dtype=torch.uint8)
    b[256 + 0x7F] = b[256 + 0xFF] = 0  # NaN bytes: not decoded
    out = torch.empty(256)
    _fp8_roundtrip[(1,)](x, r, b, out, N=256)
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(r, want.float())
    assert torch.equal(b[:256], want.view(torch.uint8))
    assert torch.equal(out, b[256:].view(torch.float8_e4m3fn).float())
