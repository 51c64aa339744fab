"""``kvarn report``'s command line: misuse stops before any model loads; what it prints and draws."""

from __future__ import annotations

import json

import pytest

from kvarn.cli import main
from kvarn.eval import models


@pytest.fixture
def no_model(monkeypatch):
    """Make loading (or converting) a model fail the test: argument errors must come first."""

    def reached(*args, **kwargs):
        raise AssertionError("kvarn report loaded a model before rejecting its arguments")

    monkeypatch.setattr(models, "load_model", reached)
    monkeypatch.setattr(models, "model_dir", reached)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefix", "100"], "--prefix must be a positive multiple of 128 tokens"),
        (["--prefix", "0"], "--prefix must be a positive multiple of 128 tokens"),
        (["--prefix", "-128"], "--prefix must be a positive multiple of 128 tokens"),
        (["--continuation", "0"], "--continuation must be at least 2 tokens"),
        (["--out", "{file}"], "is a file; give a folder"),
        (["--methods", ""], "--methods names no method"),
        (["--regions", ","], "--regions names no region"),
        (["--model", ""], "--model names no model"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--text", "{dir}"], "is a folder; give a UTF-8 text file"),
        (["--greedy", "-1"], "--greedy must be 0 (skip greedy generation) or a positive number"),
    ],
)
def test_misuse_exits_2_with_usage_before_any_model_loads(args, message, tmp_path, capsys, no_model):
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "dir").mkdir()
    args = [a.format(file=tmp_path / "file", dir=tmp_path / "dir") for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["report", *args, "--out", str(tmp_path / "r")] if "--out" not in args else ["report", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: kvarn report" in err and message in err
    assert not (tmp_path / "r").exists()


def test_conversion_message_only_when_one_happens(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "cache"))

    def stop(name, *args, **kwargs):
        raise ValueError(f"stopped before loading {name}")

    monkeypatch.setattr(models, "load_model", stop)
    folder = tmp_path / "hf-folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out = str(tmp_path / "r")
    assert main(["report", "--model", str(folder), "--out", out]) == 2
    said = capsys.readouterr().out
    assert f"kvarn report: {folder}, methods" in said and "(converting it" not in said
    assert main(["report", "--model", "smollm2-135m", "--out", out]) == 2
    assert "kvarn report: smollm2-135m (converting it from GGUF first, once), methods" in capsys.readouterr().out
    done = tmp_path / "cache" / "models" / "smollm2-135m"  # what a finished conversion leaves
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"")
    (done / "kvarn_model.json").write_text(json.dumps({"format_version": models._FORMAT_VERSION}))
    assert main(["report", "--model", "smollm2-135m", "--out", out]) == 2
    assert "(converting it" not in capsys.readouterr().out


def _run(model="smollm2-135m"):
    """A results dict as ``evaluate`` returns it (two layers, three tile positions), with what ``main`` adds."""
    rows = []
    for region in ("tail", "sink"):
        for method, kl in (
            ("fp16", 1e-8),
            ("kvarn_k4v2_g128", 0.01),
            ("kivi_k4v2_g128", 0.02),
            ("hadrtn_k4v2_g128", 0),
        ):
            err = 0.0 if method == "fp16" else kl * 10
            rows.append(
                {
                    "method": method,
                    "family": "f",
                    "region": region,
                    "bits_per_element": 3.5,
                    "capacity_vs_fp16": 4.5,
                    "kl": kl,
                    "ppl": 10.0,
                    "top1": 0.97,
                    "greedy_match": 1.0,
                    "greedy_prefix": 8,
                    "attn_static": [[1e-4, err, err], [1e-4, err, err]],
                    "attn_accum": [[0.0, err, 2 * err], [0.0, err, 2 * err]],
                    "cache_bytes": 100,
                    "fp16_bytes": 400,
                }
            )
    return {"model": model, "prefix": 384, "continuation": 40, "greedy": 8, "reference": {"ppl": 10.0},
            "seconds": 1.0, "results": rows}  # fmt: skip


@pytest.mark.hf
def test_report_md_names_its_sections_not_the_process(tmp_path):
    pytest.importorskip("transformers")
    from kvarn.eval.report import write_markdown

    text = write_markdown([_run()], tmp_path, "kvarn report").read_text()
    assert "\nTargets:\n" in text and "- [sink] KL kvarn_k4v2_g128 / KL kivi_k4v2_g128" in text
    for word in ("issue", "session"):
        assert word not in text.lower()


def test_kl_plot_leaves_fp16_out_of_the_log_axis_with_a_note():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvarn.eval.report import _kl_figure

    fig = _kl_figure(_run())
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == ["kvarn_k4v2_g128", "kivi_k4v2_g128"]
        heights = sorted({round(p.get_height(), 6) for p in ax.patches})
        assert heights == [0.01, 0.02]  # no bar clamped to a floor
        note = ax.get_xlabel().replace("\n", " ")
        assert "Not drawn on the log axis: fp16 (K/V only rounded to the fp16 store): KL 1e-08 [tail]" in note
        assert "hadrtn_k4v2_g128: KL 0 [tail], 0 [sink+tail]" in note
    finally:
        plt.close(fig)


@pytest.mark.parametrize("which", ["kl", "attn"])
def test_plot_legends_sit_outside_the_axes(which):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvarn.eval.report import _attn_figure, _kl_figure

    fig = _kl_figure(_run()) if which == "kl" else _attn_figure(_run(), "tail")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
        box = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer))
    finally:
        plt.close(fig)


def test_attention_plot_leaves_exact_zeros_out_of_the_log_axis():
    pytest.importorskip("matplotlib")
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvarn.eval.report import _attn_figure

    fig = _attn_figure(_run(), "tail")
    try:
        for line in fig.axes[0].get_lines():
            ys = list(line.get_ydata())
            assert all(math.isnan(y) or y > 0 for y in ys)
    finally:
        plt.close(fig)


def test_harness_refuses_a_negative_greedy_count():
    from kvarn.eval.harness import evaluate

    with pytest.raises(ValueError, match="greedy must be 0"):
        evaluate(None, None, ["fp16"], ["tail"], prefix=128, continuation=8, greedy=-1)


def test_kvarn_without_a_command_prints_usage_on_stderr(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "usage: kvarn {demo,report}" in captured.err and captured.out == ""
    assert main(["--help"]) == 0
    assert "usage: kvarn {demo,report}" in capsys.readouterr().out
