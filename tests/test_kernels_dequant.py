"""The dequantization kernel (``kvarn.kernels.dequant``) against the reference, under the Triton
interpreter (``interpreted.py``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpreted import INTERPRETER_MARKS, dequant, smooth_cfg
from kernel_oracle import make_kv, poisoned_empty

from kvarn import reference as R
from kvarn.config import PRESETS, KVarNConfig

pytestmark = INTERPRETER_MARKS


@pytest.mark.parametrize("preset,d", [(p, 64) for p in PRESETS] + [("kvarn_k4v2_g128", 128)])
def test_decode_records_is_exact(preset, d):
    cfg = KVarNConfig.from_preset(preset, head_dim=d)
    k, v = make_kv(2, cfg.group_size, 1, d, torch.float16, seed=11)
    rec = R.encode_records(R.prepare(k[:, :, 0]), R.prepare(v[:, :, 0]), cfg)
    gk, gv = dequant.decode_records(rec, cfg, empty=poisoned_empty)
    wk, wv = R.decode_records(rec, cfg)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


@pytest.mark.parametrize(
    "preset,d", [("kvarn_k4v2_g64", 64), ("kvarn_k2v2_g128", 64), ("kvarn_k4v4_g64", 128), ("kvarn_k4v2_g64", 256)]
)
def test_decode_records_smooth_is_exact(preset, d):
    cfg = smooth_cfg(preset, d)
    k, v = make_kv(2, cfg.group_size, 1, d, torch.bfloat16, seed=17)
    rec = R.encode_records(R.prepare(k[:, :, 0]), R.prepare(v[:, :, 0]), cfg)
    s = R.unpack_record(rec, cfg)[0].smooth.float()
    assert float(s.min()) < 0.5, "the test tiles should smooth some channel"
    gk, gv = dequant.decode_records(rec, cfg, empty=poisoned_empty)
    wk, wv = R.decode_records(rec, cfg)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)
