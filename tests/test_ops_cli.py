"""The dispatch point and the command line."""

import pytest
import torch

from kvarn import ops
from kvarn.cli import main
from kvarn.config import KVarNConfig


def test_ops_reference_matches_reference_module():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    k = torch.randn(2, 64, 64, dtype=torch.float16)
    rec = ops.encode_records(k, k, cfg, impl="reference")
    from kvarn.reference import encode_records

    assert torch.equal(rec, encode_records(k, k, cfg))
    kd, _ = ops.decode_records(rec, cfg, impl="auto")  # CPU tensors: the reference
    assert kd.shape == (2, 64, 64)


def test_ops_rejects_unknown_impl():
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.decode_records(torch.zeros(1, cfg.record_bytes, dtype=torch.uint8), cfg, impl="cuda")


def test_demo_prints_every_preset(capsys):
    assert main(["demo", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    for preset in ("kvarn_k4v2_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g128", "kvarn_k4v4_g64", "kvarn_k2v2_g128"):
        assert preset in out
    assert "108.0" in out and "4.74x" in out


def test_cli_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
