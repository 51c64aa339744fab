"""``benchmarks/timeline_decode.py``'s summary of per-program stamps, and ``decode_timeline``'s checks (no GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.timeline_decode import summarize
from kvarn.kernels.attention import _TIMELINE, decode_timeline


def synthetic_stamps(grid, n_sms, slow_from_round, walk_fast=100.0, walk_slow=110.0, empty_split=None):
    """Stamps (ns) of a launch where programs dispatched in rounds ``>= slow_from_round`` walk slower."""
    blocks, hkv, splits = grid
    n = blocks * hkv * splits
    t = torch.zeros(n, 8, dtype=torch.int64)
    t0 = 1_000_000_000
    for row in range(n):
        split, kvh, block = row % splits, (row // splits) % hkv, row // (splits * hkv)
        dispatch = block + blocks * (kvh + hkv * split)
        r = dispatch // n_sms
        walk = walk_slow if r >= slow_from_round else walk_fast
        entry = t0 + 50 * (dispatch % 3)
        t[row, 0] = entry
        t[row, 1] = entry + 500
        t[row, 7] = dispatch % n_sms
        if split == empty_split:
            continue  # no units: entry and units stamps only
        t[row, 2] = t[row, 1] + int(walk * 1000)
        t[row, 3] = t[row, 2] + 30
        t[row, 4] = t[row, 3] + 700
    return t


def test_summary_sees_slow_rounds():
    grid, sms = (16, 8, 8), 132
    s = summarize(synthetic_stamps(grid, sms, slow_from_round=4), grid, sms)
    assert s["programs"] == s["walked"] == 1024 and s["sms"] == sms
    by_round = {p["round"]: p for p in s["per_round"]}
    assert sorted(by_round) == list(range(8))  # 1024 programs, 132 an SM round: 7 full rounds and part of an 8th
    assert by_round[0]["walk_us"] == pytest.approx(100.0) and by_round[5]["walk_us"] == pytest.approx(110.0)
    assert by_round[7]["programs"] == 1024 - 7 * 132
    assert s["walk_us"][0] == pytest.approx(100.0) and s["walk_us"][-1] == pytest.approx(110.0)
    assert s["units_known_us"] == [0.5] * 5
    # the span: the last entry (0.1 µs) + 0.5 + 110 + 0.03 + 0.7
    assert s["span_us"] == pytest.approx(111.33, abs=0.01)
    assert s["fp_us"] == [0.03] * 5 and s["finish_us"] == [0.7] * 5
    late = s["last"]
    assert len(late) == 8 and all(p["round"] >= 4 and p["walk_us"] == pytest.approx(110.0) for p in late)
    assert [p["done_us"] for p in late] == sorted((p["done_us"] for p in late), reverse=True)
    assert late[0]["done_us"] == s["span_us"]


def test_summary_counts_programs_without_units():
    grid, sms = (2, 2, 4), 4
    s = summarize(synthetic_stamps(grid, sms, slow_from_round=99, empty_split=3), grid, sms)
    assert s["programs"] == 16 and s["walked"] == 12
    assert sum(p["programs"] for p in s["per_round"]) == 12


def test_summary_refuses_unstamped_launches():
    grid = (2, 2, 2)
    t = synthetic_stamps(grid, 4, slow_from_round=1)
    t[5, 0] = 0
    with pytest.raises(ValueError, match="no entry stamp"):
        summarize(t, grid, 4)
    with pytest.raises(ValueError, match="stamp rows"):
        summarize(t[:6], grid, 4)


def test_decode_timeline_checks_its_buffer():
    with pytest.raises(ValueError, match="int64"):
        with decode_timeline(torch.zeros(4, 8, dtype=torch.int32)):
            pass
    with pytest.raises(ValueError, match=r"\[rows, 8\]"):
        with decode_timeline(torch.zeros(4, 7, dtype=torch.int64)):
            pass
    with pytest.raises(ValueError, match="CUDA"):
        with decode_timeline(torch.zeros(4, 8, dtype=torch.int64)):
            pass
    assert _TIMELINE[0] == 0
