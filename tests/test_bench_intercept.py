"""``benchmarks/bench_decode.py --intercept``'s fit of a launch's time against the units a split walks (no GPU)."""

from __future__ import annotations

import sys

import pytest

from benchmarks.bench_decode import INTERCEPT_STEPS, fit_units, main


def test_fit_recovers_a_line():
    a, b = fit_units([(u, 21.0 + 4.05 * u) for u in (9, 17, 33)])
    assert a == pytest.approx(21.0) and b == pytest.approx(4.05)


def test_fit_is_least_squares():
    # three measured runs: 9, 17, 33 units
    a, b = fit_units([(9, 57.44), (17, 89.92), (33, 154.40)])
    assert b == pytest.approx(4.0386, abs=1e-4) and a == pytest.approx(21.16, abs=0.01)
    pts = [(9, 57.44), (17, 89.92), (33, 154.40)]
    sse = sum((t - a - b * u) ** 2 for u, t in pts)
    assert all(
        sse <= sum((t - a2 - b2 * u) ** 2 for u, t in pts) for a2, b2 in ((a + 0.1, b), (a, b + 0.01), (a - 0.1, b))
    )


def test_fit_needs_two_unit_counts():
    with pytest.raises(ValueError, match="two or more distinct"):
        fit_units([(9, 57.0), (9, 58.0)])
    with pytest.raises(ValueError):
        fit_units([(9, 57.0)])


def test_steps_give_distinct_units():
    assert len(set(INTERCEPT_STEPS)) == len(INTERCEPT_STEPS) >= 2


@pytest.mark.parametrize(
    "argv",
    [["--intercept", "kvarn_k4v2_g128", "16", "eight", "1"], ["--intercept", "kvarn_k4v2_g128", "16", "0", "1"],
     ["--grid", "--rules"], ["--intercept", "kvarn_k4v2_g128", "16", "8", "1", "--eager"]],
)  # fmt: skip
def test_bad_modes_are_refused_before_any_gpu_work(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "error" in capsys.readouterr().err
