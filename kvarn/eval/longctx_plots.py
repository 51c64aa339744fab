"""The plots of ``kvarn report --task``: accuracy against context length, divergence against generated position.

One panel per region setting (tail, sink+tail) and one color per method, the same in every panel.
"""

from __future__ import annotations

import math
import pathlib

from kvarn.eval.longctx import REGION_LABEL, WINDOW, lossless
from kvarn.eval.methods import get_method


def _figure_regions(result: dict) -> list[str]:
    return list(dict.fromkeys(r["region"] for r in result["runs"]))


def _figure(result: dict, title: str):
    """One panel per region setting and one color per method (the same in every panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regions = _figure_regions(result)
    fig, axes = plt.subplots(1, len(regions), figsize=(5.5 * len(regions), 4.2), squeeze=False, sharey=True)
    methods = list(dict.fromkeys(r["method"] for r in result["runs"]))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    markers = {m: "os^vD<>ph*"[i // 10 % 10] for i, m in enumerate(methods)}
    fig.suptitle(title)
    return plt, fig, list(zip(axes[0], regions, strict=True)), colors, markers


def _finish(plt, fig, out: pathlib.Path, name: str) -> list[str]:
    handles = {}
    for ax in fig.axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.93))
    fig.savefig(out / name, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return [name]


def plot_retrieval(result: dict, out: pathlib.Path, stem: str) -> list[str]:
    """Accuracy vs context length per method, one panel per region setting (the exact model dashed black).

    Methods are dodged sideways (a few percent of the length, the same offset per method) so that
    equal accuracies stay visible; the values are not moved."""
    lengths = result["lengths"]
    by = {(e["label"], e["length"]): e["accuracy"] for e in result["summary"]}
    n = result["samples"]
    title = f"{result['model']}: {result['task']}, {n} sample{'s' if n != 1 else ''} per length"
    plt, fig, panels, colors, markers = _figure(result, title)
    methods = list(colors)
    for ax, region in panels:
        ax.plot(lengths, [100 * by[("exact", n)] for n in lengths], "k--", marker="o", label="exact", zorder=5)
        for r in _panel_rows(result, region):
            m = r["method"]
            dodge = 2 ** (0.12 * (methods.index(m) - (len(methods) - 1) / 2) / max(len(methods) - 1, 1))
            ys = [100 * by[(r["label"], n)] for n in lengths]
            ax.plot([x * dodge for x in lengths], ys, marker=markers[m], markersize=4, color=colors[m], label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.set(xlabel="context length (tokens)", ylim=(-5, 105), title=REGION_LABEL[region])
        ax.grid(alpha=0.3)
    panels[0][0].set_ylabel("accuracy (%)")
    return _finish(plt, fig, out, f"{stem}_{result['task']}_accuracy.png")


def _panel_rows(result: dict, region: str) -> list[dict]:
    """The runs of one region setting, and the lossless runs (made once, the same in every setting)."""
    return [r for r in result["runs"] if r["region"] == region or (_lossless(r) and r["region"] != region)]


def plot_drift(result: dict, out: pathlib.Path, stem: str) -> list[str]:
    """Mean KL per 64-position window vs generated position per method (log y), one panel per region setting;
    an x marks where the method's own greedy run first differs from the exact run's.

    The exact run is the yardstick (KL 0) and is not drawn; windows with KL <= 0 are left out of the
    log axis rather than drawn at a made-up floor."""
    by = {e["label"]: e for e in result["summary"]}
    title = f"{result['model']}: KL along the exact model's own {result['new_tokens']}-token generation"
    plt, fig, panels, colors, markers = _figure(result, title)
    diverged = False
    for ax, region in panels:
        for r in _panel_rows(result, region):
            e, m = by[r["label"]], r["method"]
            xs = [j * WINDOW + min(WINDOW, result["new_tokens"] - j * WINDOW) / 2 for j in range(len(e["kl_windows"]))]
            ys = [v if v > 0 else float("nan") for v in e["kl_windows"]]
            ax.plot(xs, ys, marker=markers[m], markersize=3, color=colors[m], label=m)
            first = e["first_divergence_median"]
            if first < result["new_tokens"]:
                on_line = [(x, y) for x, y in zip(xs, ys, strict=True) if y == y]  # the marker sits on the line
                if on_line:
                    y = math.exp(_interp(first, [x for x, _ in on_line], [math.log(y) for _, y in on_line]))
                    ax.plot([first], [y], "x", color=colors[m], markersize=8, mew=2)
                    diverged = True
        ax.set_yscale("log")
        ax.set(xlabel="generated position (means over 64-token windows)", title=REGION_LABEL[region])
        ax.set_xlim(0, result["new_tokens"])
        ax.grid(alpha=0.3, which="both")
    if diverged:  # a legend entry for the markers
        panels[0][0].plot([], [], "x", color="k", markersize=8, mew=2, label="first greedy divergence")
    panels[0][0].set_ylabel("KL(exact || method), window mean (nats)")
    return _finish(plt, fig, out, f"{stem}_drift.png")


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear ``y`` at ``x`` (held constant outside ``xs``, which ascend)."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _lossless(info: dict) -> bool:
    return lossless(get_method(info["method"]))
