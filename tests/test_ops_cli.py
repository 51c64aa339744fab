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
    assert "  vs rtn      attn " in out and "KVarN lower for every preset" in out


def test_demo_table_bears_out_what_it_prints():
    """The demo's explanation: K errors close to per-channel RTN's, V errors lower, attention error lower than RTN's."""
    from kvarn.demo import run, summary

    rows = run(256, seed=1)  # the printing test below runs seed 0
    by = {(r["preset"], r["method"]): r for r in rows}
    for preset in {r["preset"] for r in rows}:
        kvarn, rtn = by[(preset, "kvarn")], by[(preset, "rtn")]
        assert 0.9 < kvarn["k_err"] / rtn["k_err"] < 1.1, preset
        assert kvarn["v_err"] < 0.9 * rtn["v_err"], preset
        assert kvarn["attn_err"] < rtn["attn_err"], preset
    lines = summary(rows)
    assert lines[3].startswith("  vs rtn      attn") and lines[3].endswith("KVarN lower for every preset")


@pytest.mark.parametrize(
    "args, message",
    [(["--tokens", "0"], "--tokens must be at least 1"), (["--threads", "0"], "--threads must be at least 1")],
)
def test_demo_misuse_exits_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_runs_on_one_thread_unless_told(monkeypatch):
    import kvarn.demo

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(kvarn.demo, "run", lambda tokens, seed: [])
    monkeypatch.setattr(kvarn.demo, "summary", lambda rows: [])
    monkeypatch.setattr(kvarn.demo, "ablation", lambda tokens, seed: [])
    assert main(["demo"]) == 0 and main(["demo", "--threads", "2"]) == 0
    assert threads == [1, 2]


def test_cli_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_auto_picks_triton_only_for_cuda_half_tensors(monkeypatch):
    from types import SimpleNamespace

    sentinel = object()
    monkeypatch.setattr(ops, "_triton_ops", lambda: {"paged_attention": sentinel})

    def like(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)

    assert ops._pick("paged_attention", "auto", like("cuda", torch.float16)) is sentinel
    assert ops._pick("paged_attention", "auto", like("cuda", torch.bfloat16)) is sentinel
    from kvarn import reference

    assert ops._pick("paged_attention", "auto", like("cuda", torch.float32)) is reference.paged_attention
    assert ops._pick("paged_attention", "auto", like("cpu", torch.float16)) is reference.paged_attention
    assert ops._pick("decode_records", "auto", like("cuda", torch.uint8)) is reference.decode_records  # no kernel
    assert ops._pick("paged_attention", "triton", like("cpu", torch.float32)) is sentinel
    with pytest.raises(RuntimeError, match="no Triton kernel"):
        ops._pick("decode_records", "triton", like("cuda", torch.uint8))


def test_paged_attention_into_out_on_the_reference():
    """``out=`` on the reference path: the result is copied into it (a view), and it is returned."""
    cfg = KVarNConfig.from_preset("kvarn_k4v2_g64", head_dim=64)
    g, hkv, hq, d = 64, 2, 4, 64
    k = torch.randn(1, 2 * g, hkv, d)
    cache = torch.zeros(2, hkv, cfg.record_bytes, dtype=torch.uint8)
    ops.store_tiles(k.view(2, g, hkv, d), k.view(2, g, hkv, d), torch.tensor([0, 1]), cache, cfg)
    tail = torch.zeros(1, g, hkv, d)
    args = (torch.randn(1, hq, d), cache, torch.tensor([[0, 1]]), torch.tensor([2 * g]), tail, tail.clone())
    args = (*args, torch.tensor([0]), cfg)
    want = ops.paged_attention(*args)
    buf = torch.full((3, hq, d + 8), float("nan"))
    got = ops.paged_attention(*args, out=buf[1:2, :, :d])
    assert torch.equal(got, want) and torch.equal(buf[1, :, :d], want[0])
    assert buf[[0, 2]].isnan().all() and buf[:, :, d:].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        ops.paged_attention(*args, out=torch.empty(1, hq, d, dtype=torch.float16))
