"""``kvarn report``: run the fidelity harness, print a table, write ``report.md``, ``results.json`` and plots.

Example::

    kvarn report                                   # SmolLM2-135M, default methods, ./report
    kvarn report --model qwen2.5-coder-0.5b --methods all --regions tail,sink --out docs/run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import textwrap
import time

from kvarn.config import key_bias_reason
from kvarn.eval.harness import BLOCK
from kvarn.eval.longctx_report import TASKS
from kvarn.eval.methods import ALL_BASELINES, DEFAULT_METHODS, get_method, served_method, with_served_methods
from kvarn.eval.models import BUNDLED_MODELS, DEFAULT_MODEL, needs_conversion

GOALS = {
    "*": (("kvarn_k4v2_g128", "kivi_k4v2_g128", 1.0), ("kvarn_k2v2_g128", "kivi_k2v2_g128", 1.0)),
    "smollm2-135m": (
        ("kvarn_k4v2_g128", "hadrtn_k4v2_g128", 0.8),
        ("kvarn_k4v2_g128", "kivi_k4v2_g128", 0.4),
        ("kvarn_k2v2_g128", "kivi_k2v2_g128", 0.3),
    ),
    "qwen2.5-coder-0.5b": (("kvarn_k4v2_g128", "kivi_k4v2_g128", 0.6), ("kvarn_k2v2_g128", "kivi_k2v2_g128", 0.5)),
}
"""The targets the report checks, ``(method, baseline, max KL ratio)``: ``"*"`` for every model (never worse
than KIVI-style RTN), then each bundled model's own."""
TOP1_GOALS = {"smollm2-135m": ("kvarn_k4v2_g128", "sink", 0.96)}


class _Progress:
    """tqdm when installed, plain lines on stderr otherwise."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.n, self.quiet, self.label = total, 0, quiet, ""
        self.bar = None
        self.t0 = time.perf_counter()
        if not quiet:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def tick(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif not self.quiet and (self.n % 50 == 0 or self.n == self.total):
            print(
                f"  {self.label}: step {self.n}/{self.total} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr
            )

    def describe(self, label: str) -> None:
        self.label = label
        if self.bar is not None:
            self.bar.set_description(label)
        elif not self.quiet:
            print(f"  running {label}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvarn report",
        description="Measure KVarN against fp16, fp8 and RTN baselines on a real model and real text.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model(s), comma-separated: bundled names ({', '.join(BUNDLED_MODELS)}) or 'all', local Hugging Face "
        f"folders, or GGUF files; default {DEFAULT_MODEL}",
    )
    p.add_argument(
        "--text",
        default=None,
        help="a UTF-8 text file to evaluate on (default: the bundled Pride and Prejudice chapters 1-4)",
    )
    p.add_argument(
        "--methods",
        "--presets",
        dest="methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated methods (kvarn_k4v2_g128, kivi_k4v2_g128, hadrtn_..., hadclip_..., sinkhorn_..., "
        "smooth_..., seqsmooth_..., fp16, fp8_e4m3, fp8_e4m3_amax) or 'all'; a KVarN-record method may take "
        "_ks (per-sequence key smoothing: kvarn_k4v2_g128_ks) and end in a layer policy: "
        "+first<N>, +last<M>, +layer<i> keep those layers in fp16, and @k<K>v<V> at that preset instead "
        "(kvarn_k2v2_g128+first1+last1, kvarn_k2v2_g128+first1@k4v4). The default list also runs, on a model "
        "with biased key projections, each kvarn_* preset's _ks form (what kvarn's vLLM plugin serves there)",
    )
    p.add_argument(
        "--regions",
        default="sink",
        help="full-precision regions, comma-separated: 'tail' (last incomplete tile only) and/or 'sink' "
        "(first tile too); default sink",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default="kl",
        help="kl (default): this teacher-forced protocol; passkey, niah, vartrack: long-context retrieval; drift: "
        "error along a long generation (kvarn report --task niah --help lists their options)",
    )
    p.add_argument(
        "--prefix", type=int, default=1024, help=f"prefix tokens, a positive multiple of {BLOCK} (default 1024)"
    )
    p.add_argument(
        "--continuation", type=int, default=256, help="teacher-forced tokens after it, 2 or more (default 256)"
    )
    p.add_argument("--greedy", type=int, default=64, help="greedy tokens to compare, 0 to skip (default 64)")
    p.add_argument("--out", default="report", help="output folder, created if missing (default ./report)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, 1 or more (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    # every check here runs before a model loads, so a typo costs no conversion or evaluation
    if args.prefix <= 0 or args.prefix % BLOCK:
        p.error(
            f"--prefix must be a positive multiple of {BLOCK} tokens (the prefix is fed and stored in whole "
            f"{BLOCK}-token tiles), got {args.prefix}"
        )
    if args.continuation < 2:
        p.error(
            f"--continuation must be at least 2 tokens (the next-token distributions compared), got {args.continuation}"
        )
    if args.greedy < 0:
        p.error(f"--greedy must be 0 (skip greedy generation) or a positive number of tokens, got {args.greedy}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    out = pathlib.Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out!r} is a file; give a folder for report.md, results.json and the plots")
    args.models = list(BUNDLED_MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    if not any(args.models):
        p.error(f"--model names no model: give a bundled name ({', '.join(BUNDLED_MODELS)}), 'all', a folder or a file")
    for m in args.models:
        if not m:
            p.error(f"--model {args.model!r} has an empty name between its commas")
        if m not in BUNDLED_MODELS and not pathlib.Path(m).expanduser().exists():
            p.error(
                f"unknown model {m!r}: give a bundled name ({', '.join(BUNDLED_MODELS)}), a local Hugging Face "
                "folder or a GGUF file"
            )
    if args.text is not None:
        text = pathlib.Path(args.text).expanduser()
        if text.is_dir():
            p.error(f"--text {args.text!r} is a folder; give a UTF-8 text file")
        if not text.is_file():
            p.error(f"--text {args.text!r}: no such file")
    if args.methods == "all":
        extra = ("kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
        args.method_list = [*ALL_BASELINES, *extra]
    else:
        args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.method_list:
        p.error("--methods names no method: give a comma-separated list (e.g. fp16,kvarn_k4v2_g128) or 'all'")
    for m in args.method_list:
        try:
            get_method(m)
        except ValueError as e:
            p.error(str(e))
    args.region_list = [r.strip() for r in args.regions.split(",") if r.strip()]
    if not args.region_list:
        p.error("--regions names no region: give 'tail', 'sink' or 'tail,sink'")
    for r in args.region_list:
        if r not in ("tail", "sink"):
            p.error(f"--regions takes 'tail' and/or 'sink', got {r!r}")
    return args


def _task(argv: list[str]) -> str:
    """The ``--task`` of ``argv`` (default ``kl``); exits with status 2 on an unknown task."""
    p = argparse.ArgumentParser(prog="kvarn report", add_help=False)
    p.add_argument("--task", choices=TASKS, default="kl")
    return p.parse_known_args(argv)[0].task


def _slug(name: str) -> str:
    """A file-name-safe form of a model name or path."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in pathlib.Path(name).name or name)


def _commit() -> str:
    """The kvarn version this report ran on: ``kvarn 0.1.0, git c43abbc`` (``git describe``), or the version alone."""
    import kvarn

    here = pathlib.Path(__file__).resolve().parents[2]
    try:
        found = subprocess.run(
            ["git", "-C", str(here), "describe", "--tags", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        found = None
    if found is not None and found.returncode == 0 and found.stdout.strip():
        return f"kvarn {kvarn.__version__}, git {found.stdout.strip()}"
    return f"kvarn {kvarn.__version__}"


def text_label(path: str | None, text: str) -> str:
    """How the report names the text: its path (or the bundled file), a short hash and its length."""
    import hashlib

    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    where = path if path is not None else "bundled kvarn/data/pride_and_prejudice.txt (Pride and Prejudice, ch. 1-4)"
    return f"{where} (sha256 {digest}, {len(text)} characters)"


def read_text(path: str) -> str:
    """The UTF-8 text of ``path``; ValueError saying so when it is not UTF-8 text."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _mean_tail(rows: list, skip_first: bool = True) -> float:
    vals = [v for row in rows for v in (row[1:] if skip_first and len(row) > 1 else row)]
    return sum(vals) / len(vals) if vals else float("nan")


def table(run: dict) -> str:
    """The results of one model as a markdown table."""
    lines = [
        "| method | family | bits/elem | capacity vs fp16 | regions | KL vs exact | ppl | top-1 | greedy match | "
        "greedy common prefix | attn err static | attn err accumulated | cache MiB (fp16 MiB) |",
        "|" + "---|" * 13,
    ]
    g = run["greedy"]
    for r in run["results"]:
        regions = _region_label(r["region"])
        lines.append(
            f"| {r['method']} | {r['family']} | {r['bits_per_element']:.2f} | {r['capacity_vs_fp16']:.2f}x | "
            f"{regions} | {r['kl']:.4f} | {r['ppl']:.3f} | {100 * r['top1']:.1f}% | "
            f"{_fmt(None if r['greedy_match'] is None else 100 * r['greedy_match'], '.1f')}% | "
            f"{_fmt(r['greedy_prefix'], 'd')}/{g} | {_mean_tail(r['attn_static']):.4f} | "
            f"{_mean_tail(r['attn_accum']):.4f} | {r['cache_bytes'] / 2**20:.2f} ({r['fp16_bytes'] / 2**20:.2f}) |"
        )
    return "\n".join(lines)


def goals(run: dict) -> list[str]:
    """The targets (:data:`GOALS`, :data:`TOP1_GOALS`) checked against one model's results (where both methods ran)."""
    by = {(r["method"], r["region"]): r for r in run["results"]}
    pairs = [*GOALS["*"], *GOALS.get(run.get("model"), ())]
    if run.get("key_bias"):  # the same goals for the presets as vLLM serves this model
        pairs += [(served_method(num), den, limit) for num, den, limit in pairs if served_method(num) != num]
    out = []
    for region in sorted({r["region"] for r in run["results"]}):
        for num, den, limit in pairs:
            if (num, region) in by and (den, region) in by:
                a, b = by[(num, region)]["kl"], by[(den, region)]["kl"]
                ratio = a / b if b > 0 else float("inf")
                verdict = "met" if ratio <= limit else "MISSED"
                out.append(
                    f"- [{region}] KL {num} / KL {den} = {a:.4f} / {b:.4f} = {ratio:.2f} (goal <= {limit}): {verdict}"
                )
    name, region, limit = TOP1_GOALS.get(run.get("model"), (None, None, None))
    if (name, region) in by:
        t = by[(name, region)]["top1"]
        verdict = "met" if t >= limit else "MISSED"
        out.append(f"- [{region}] top-1 agreement of {name} = {100 * t:.1f}% (goal >= {100 * limit:.0f}%): {verdict}")
    return out


def _region_label(region: str) -> str:
    """What a region setting keeps in full precision: ``sink+tail`` or ``tail``."""
    return "sink+tail" if region == "sink" else "tail"


def _attn_figure(run: dict, region: str):
    """Attention-output error vs tile position and vs layer (solid accumulated, dashed static), legend outside."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    rs = [r for r in run["results"] if r["region"] == region and r["method"] != "fp16"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    handles = []
    for i, r in enumerate(rs):
        color = f"C{i % 10}"
        for key, style in (("attn_accum", "-"), ("attn_static", "--")):
            rows = r[key]
            by_pos = [sum(row[j] for row in rows) / len(rows) for j in range(len(rows[0]))]
            by_layer = [sum(row[1:]) / max(len(row) - 1, 1) for row in rows]
            # an exact 0 (tile 0 of the accumulated run) has no place on a log axis: a gap, not a plunge
            by_pos, by_layer = ([e if e > 0 else math.nan for e in xs] for xs in (by_pos, by_layer))
            axes[0].plot(range(len(by_pos)), by_pos, style, color=color, marker=".")
            axes[1].plot(range(len(by_layer)), by_layer, style, color=color)
        handles.append(Line2D([], [], color=color, label=r["method"]))
    handles += [
        Line2D([], [], color="0.3", linestyle="-", label="accumulated"),
        Line2D([], [], color="0.3", linestyle="--", label="static"),
    ]
    axes[0].set(xlabel=f"tile position ({BLOCK} tokens)", ylabel="relative attention-output error", yscale="log")
    axes[1].set(xlabel="layer", ylabel="relative attention-output error", yscale="log")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title("vs position: solid accumulated, dashed static", fontsize=10)
    axes[1].set_title("vs layer (tiles 1..): solid accumulated, dashed static", fontsize=10)
    fig.legend(handles=handles, loc="outside right upper", fontsize=7)
    fig.suptitle(f"{run['model']} [{_region_label(region)}]")
    return fig


def _kl_figure(run: dict):
    """Next-token KL per method and region on a log axis, legend outside; fp16 (K/V rounded to the store
    dtype, nothing quantized) and any KL that is not positive are left out of the log axis and named in a note."""
    import matplotlib.pyplot as plt

    results = run["results"]
    regions = sorted({r["region"] for r in results})
    left_out = [r for r in results if r["method"] == "fp16" or not r["kl"] > 0]
    drawn = [r for r in results if r not in left_out]
    methods = list(dict.fromkeys(r["method"] for r in drawn))
    fig, ax = plt.subplots(figsize=(10, 4.2), layout="constrained")
    width = 0.8 / max(len(regions), 1)
    for j, region in enumerate(regions):
        kl = {r["method"]: r["kl"] for r in drawn if r["region"] == region}
        xs = [i + j * width for i in range(len(methods))]
        ax.bar(xs, [kl.get(m, float("nan")) for m in methods], width, label=_region_label(region))
    ax.set_xticks([i + width * (len(regions) - 1) / 2 for i in range(len(methods))])
    ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="KL vs exact (nats/token)", yscale="log", title=f"{run['model']}: next-token KL")
    fig.legend(loc="outside right upper", fontsize=8, title="full precision")
    if left_out:
        parts = []
        for method in dict.fromkeys(r["method"] for r in left_out):
            what = " (K/V only rounded to the fp16 store)" if method == "fp16" else ""
            kls = ", ".join(f"{r['kl']:.2g} [{_region_label(r['region'])}]" for r in left_out if r["method"] == method)
            parts.append(f"{method}{what}: KL {kls}")
        ax.set_xlabel(textwrap.fill(f"Not drawn on the log axis: {'; '.join(parts)}", 140), fontsize=7, loc="left")
    return fig


def plots(run: dict, out: pathlib.Path, stem: str) -> list[str]:
    """Error vs tile position and per layer (static vs accumulated), and KL per method. Returns file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for region in sorted({r["region"] for r in run["results"]}):
        fig = _attn_figure(run, region)
        name = f"{stem}_attn_error_{region}.png"
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        files.append(name)
    fig = _kl_figure(run)
    name = f"{stem}_kl.png"
    fig.savefig(out / name, dpi=80)
    plt.close(fig)
    files.append(name)
    return files


def write_markdown(runs: list[dict], out: pathlib.Path, command: str) -> pathlib.Path:
    import torch
    import transformers

    lines = [
        "# kvarn fidelity report",
        "",
        f"Command: `{command}` ({runs[0].get('commit') if runs else _commit()})",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()} "
        f"{platform.system()}, {torch.get_num_threads()} thread(s).",
        "",
        "KL, top-1 and perplexity are over the teacher-forced continuation against the exact run (model dtype, "
        "unquantized cache); every method stores K/V in fp16 before quantizing. Attention errors are mean "
        "relative L2 errors of the attention output over tile positions 1.. (tile 0 has no quantized history).",
    ]
    for run in runs:
        lines += [
            "",
            f"## {run['model']}",
            "",
            f"Model: {run.get('model_source', run['model'])}.",
            "",
            f"Text: {run.get('text_label', run.get('text', 'bundled'))}.",
            "",
            f"Prefix {run['prefix']} tokens tile by tile, {run['continuation']} teacher-forced tokens, "
            f"{run['greedy']} greedy tokens; exact-run perplexity {run['reference']['ppl']:.3f}; "
            f"wall time {run['seconds']:.0f} s.",
            "",
            table(run),
            "",
            "Targets:",
            "",
            *(goals(run) or ["- (the methods the targets compare were not run)"]),
            "",
        ]
        if run.get("key_bias"):
            lines += [
                f"Key biases: {run['key_bias']}: the `_ks` presets are meant for it, and kvarn's vLLM plugin "
                "serves them for such a model by itself (`docs/guide/fidelity.md`, `docs/guide/vllm.md`).",
                "",
            ]
        lines += [f"![{f}]({f})" for f in run.get("plots", [])]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvarn report ARGS...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _task(argv) != "kl":
        from kvarn.eval.longctx_report import main as run_task

        return run_task(argv, progress_factory=_Progress, commit=_commit)
    args = _parse(argv)
    try:
        import torch

        from kvarn.eval.harness import evaluate
        from kvarn.eval.models import load_model
    except ImportError as e:
        print(f"kvarn report needs transformers, gguf and accelerate: pip install 'kvarn[hf]' ({e})", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from kvarn.eval.harness import bundled_text, prepare_ids

    try:
        text = bundled_text() if args.text is None else read_text(args.text)
    except ValueError as e:
        print(f"kvarn report: {e}", file=sys.stderr)
        return 2
    label = text_label(args.text, text)
    commit = _commit()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    default_methods = args.methods == ",".join(DEFAULT_METHODS)
    for name in args.models:
        t0 = time.perf_counter()
        converting = " (converting it from GGUF first, once)" if needs_conversion(name) else ""
        print(f"kvarn report: {name}{converting}, methods {', '.join(args.method_list)}")
        try:
            model, tok = load_model(name)
        except (ModuleNotFoundError, ImportError, ValueError, FileNotFoundError) as e:
            print(f"kvarn report: {e}", file=sys.stderr)
            return 2
        key_bias = key_bias_reason(model.config)
        methods = args.method_list
        if key_bias is not None and default_methods:  # what vLLM serves for this model, beside the plain presets
            methods = with_served_methods(methods)
            added = [m for m in methods if m not in args.method_list]
            print(f"kvarn report: {name}: {key_bias}: adding {', '.join(added)} (kvarn's vLLM plugin serves these)")
        try:
            prepare_ids(tok, args.prefix, args.continuation, text, name=args.text or "the bundled text")
            for m in methods:
                policy = get_method(m).policy
                if policy is not None:
                    policy.kept(model.config.num_hidden_layers)
        except ValueError as e:
            print(f"kvarn report: {e}", file=sys.stderr)
            return 2
        run = evaluate(
            model,
            tok,
            methods,
            args.region_list,
            prefix=args.prefix,
            continuation=args.continuation,
            greedy=args.greedy,
            progress_factory=lambda total: _Progress(total, args.quiet),
            text=text,
        )
        run["model"] = name
        run["model_source"] = (
            f"{name} (bundled: {BUNDLED_MODELS[name].description})"
            if name in BUNDLED_MODELS
            else f"{pathlib.Path(name).expanduser().resolve()} (local)"
        )
        run["key_bias"] = key_bias
        run["text"] = args.text or "bundled"
        run["text_label"] = label
        run["commit"] = commit
        run["seconds"] = time.perf_counter() - t0
        run["plots"] = plots(run, out, _slug(name))
        runs.append(run)
        print()
        print(f"{name}: exact-run perplexity {run['reference']['ppl']:.3f}")
        print(table(run))
        for line in goals(run):
            print(line)
        if run["key_bias"] is not None:
            print(
                f"{name}: {run['key_bias']}: the _ks presets are meant for it (kvarn.recommended_preset; "
                "kvarn's vLLM plugin serves them by itself; docs/guide/fidelity.md)"
            )
        del model
    (out / "results.json").write_text(json.dumps(runs, indent=1) + "\n")
    command = "kvarn report " + " ".join(argv)
    path = write_markdown(runs, out, command.strip())
    print(f"\nwrote {path}, {out / 'results.json'} and {sum(len(r['plots']) for r in runs)} plots")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
