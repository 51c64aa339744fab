"""``kvarn report --task passkey|niah|vartrack|drift``: arguments, tables, ``report.md``, ``results.json``, plots.

The measurements are :mod:`kvarn.eval.longctx`'s; ``--task kl`` (the default) is
:mod:`kvarn.eval.report`'s teacher-forced protocol, which hands every other task to :func:`main`.

Examples::

    kvarn report --task niah                                  # SmolLM2-135M, 1024 and 2048 tokens, ./report
    kvarn report --task passkey --lengths 1024,4096,8192 --samples 50 --device cuda --workers 8 --prefill-chunk 2048
    kvarn report --task drift --prefix 256 --new-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable

from kvarn.eval import tasks
from kvarn.eval.drift import drift, drift_prefixes
from kvarn.eval.harness import BLOCK
from kvarn.eval.longctx import (
    DRIFT_POSITIONS,
    DRIFT_PREFIX,
    DRIFT_TOKENS,
    NO_REPEAT_NGRAM,
    REGION_LABEL,
    WINDOW,
    PlainProgress,
    RecordLog,
    check_chunk,
    default_methods,
    plan_runs,
    retrieval,
)
from kvarn.eval.longctx_plots import plot_drift, plot_retrieval
from kvarn.eval.methods import ALL_BASELINES, get_method, with_served_methods
from kvarn.eval.workers import Workers

TASKS = ("kl", *tasks.TASKS, "drift")
DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_SAMPLES = 1
"""Sized so that ``kvarn report --task niah`` (20 runs a sample) finishes within half an hour on a small
CPU; a GPU run takes ``--samples 50`` and every length the model supports."""
DRIFT_SAMPLES = 1
MIN_LENGTH = 256
MAX_CONTEXT = {"smollm2-135m": 8192, "qwen2.5-coder-0.5b": 32768, "gemma3-270m": 32768}
"""Context length of each bundled model (``max_position_embeddings``), checked before it loads."""


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def retrieval_table(result: dict) -> str:
    """Accuracy (agreement with the exact model's answer) per run and context length, as markdown; a task scored
    with recall (vartrack) gets a second table of it."""
    lengths = result["lengths"]
    by = {(e["label"], e["length"]): e for e in result["summary"]}
    head = "| method | family | bits/elem | regions | " + " | ".join(f"{n} tokens" for n in lengths) + " | mean |"
    lines = [head, "|" + "---|" * (5 + len(lengths))]
    infos = [{"label": "exact", "method": "exact", "family": "model dtype, unquantized", "region": None}]
    for info in [*infos, *result["runs"]]:
        cells, accs = [], []
        for n in lengths:
            e = by.get((info["label"], n))
            if e is None:
                cells.append("-")
                continue
            accs.append(e["accuracy"])
            cell = f"{100 * e['accuracy']:.0f}%"
            if info["label"] != "exact":
                cell += f" ({100 * e['agreement']:.0f}%; -{e['lost']} +{e['gained']}"
                if e["lost"] + e["gained"]:
                    p = e["p_value"]
                    cell += f", p={p:.2f}" if p >= 0.01 else ", p<0.01"
                cell += ")"
            cells.append(cell)
        bits = "-" if info["label"] == "exact" else f"{info['bits_per_element']:.2f}"
        region = "-" if info["region"] is None else REGION_LABEL[info["region"]]
        mean = f"{100 * sum(accs) / len(accs):.0f}%" if accs else "-"
        lines.append(
            f"| {info['method']} | {info['family']} | {bits} | {region} | " + " | ".join(cells) + f" | {mean} |"
        )
    if any("recall" in e for e in result["summary"]):
        lines += ["", _recall_table(result, by, infos)]
    return "\n".join(lines)


def _recall_table(result: dict, by: dict, infos: list[dict]) -> str:
    """Mean recall per run and length (vartrack: the share of the chain's variables the answer names), as markdown.

    Small models rarely name the exact set, so exact-match accuracy can be 0% for every method; recall still shows
    what each kept of the exact model's tracking.
    """
    lengths = result["lengths"]
    lines = ["| method | regions | " + " | ".join(f"recall, {n} tokens" for n in lengths) + " |"]
    lines.append("|" + "---|" * (2 + len(lengths)))
    for info in [*infos, *result["runs"]]:
        cells = ["-" if (e := by.get((info["label"], n))) is None else f"{100 * e['recall']:.0f}%" for n in lengths]
        region = "-" if info["region"] is None else REGION_LABEL[info["region"]]
        lines.append(f"| {info['method']} | {region} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sample_table(result: dict) -> str:
    """One row per sample: where the needle was, the answer, the exact model's, and which runs answered otherwise."""
    lines = [
        "| length | sample | depth | answer | exact | runs answering otherwise (their answer) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        wrong = [
            f"{label} ({got['pred'] or '-'}{', a distractor' if got['distractor'] else ''})"
            for label, got in r["runs"].items()
            if not got["same_as_exact"]
        ]
        exact = r["exact"]["pred"] or "-"
        mark = "" if r["exact"]["correct"] else " (wrong)"
        answer = ",".join(r["answer"])
        row = [str(r["length"]), str(r["index"]), f"{r['depth']:.2f}", answer, exact + mark, "; ".join(wrong) or "none"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def drift_table(result: dict) -> str:
    """KL at the drift positions, mean KL, teacher-forced top-1 and first greedy divergence per run, as markdown."""
    n = result["new_tokens"]
    head = " | ".join(f"KL @{p}" for p in DRIFT_POSITIONS)
    lines = [
        f"| method | family | bits/elem | regions | {head} | mean KL | top-1 | first divergence (of {n}) |",
        "|" + "---|" * (7 + len(DRIFT_POSITIONS)),
    ]
    info = {r["label"]: r for r in result["runs"]}
    for e in result["summary"]:
        i = info[e["label"]]
        kl = " | ".join(_fmt(e["kl_at"][str(p)], ".2e") for p in DRIFT_POSITIONS)
        firsts = e["first_divergence"]
        first = str(firsts[0]) if len(firsts) == 1 else f"{e['first_divergence_median']:g} (median of {len(firsts)})"
        lines.append(
            f"| {i['method']} | {i['family']} | {i['bits_per_element']:.2f} | {REGION_LABEL[i['region']]} | {kl} | "
            f"{e['kl_mean']:.2e} | {100 * e['top1']:.1f}% | {first} |"
        )
    return "\n".join(lines)


PROTOCOL = {
    "retrieval": (
        "Each prompt is fed the way a vLLM request is: {feeding}, then the answer decoded greedily token by "
        "token (at most {max_new} tokens, stopping once the answer is complete). K/V are rounded to fp16 before "
        "storing; 'tail' keeps the incomplete last tile in full precision, 'sink+tail' the first tile too (fp16 is "
        "the same in both and runs once). The exact model runs in its own dtype with an unquantized cache. Cells: "
        "accuracy (exact match of the normalised answer), in parentheses the share of samples where the method gave "
        "the exact model's answer, then -L +W: L samples only the exact model answered right, W only the method "
        "(the accuracy gap is W - L samples), and p, the two-sided exact McNemar test of L against W (the chance "
        "of a split at least that uneven if each such sample were as likely to fall either way: above about 0.05 the "
        "gap is within what this many samples can tell). Context length = prompt plus answer budget. Needle "
        "depths follow a seeded golden-ratio sequence, the same at every length."
    ),
    "drift": (
        "From a {prefix}-token prefix of the text, the exact model (own dtype, unquantized cache) generates "
        "{new} tokens greedily (no end-of-sequence token{ngram}). Each method is teacher-forced on that text "
        "the way a vLLM request is fed ({feeding}): KL(exact || method) at position p is the mean over the 64 "
        "positions up to p; top-1 is agreement with the exact next-token argmax over all positions. First "
        "divergence: the first position where the method's own greedy run (same rule) picks another token than "
        "the exact run ({new} = none)."
    ),
}


def _feeding(chunk: int | None) -> str:
    """How the report's prompts were fed, for its protocol paragraph."""
    if chunk is None:
        return (
            "in chunks of one tile (128 tokens; 64 for the _g64 presets), each chunk attending over the earlier "
            "tiles as the method stored them and over its own tile exactly"
        )
    return (
        f"the first tile alone, then chunks of {chunk} tokens (the exact model, and the KVarN-record methods through "
        "the paged attention of a vLLM prompt chunk; methods storing fp16 / fp8 tiles one tile a chunk), each "
        "query attending over the tiles before its own as the method stored them and over its own tile exactly"
    )


def _workers_note(res: dict) -> str:
    workers = res.get("workers", 1)
    return f" in each of {workers} worker processes" if workers > 1 else ""


def write_markdown(results: list[dict], out: pathlib.Path, command: str, commit: str) -> pathlib.Path:
    import torch
    import transformers

    task = results[0]["task"]
    lines = [
        f"# kvarn long-context report: {task}",
        "",
        f"Command: `{command}` ({commit})",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()} "
        f"{platform.system()}, {torch.get_num_threads()} thread(s){_workers_note(results[0])}, device "
        f"{results[0].get('device', 'cpu')}.",
        "",
    ]
    for res in results:
        lines += [f"## {res['model']}", "", f"Model: {res['model_source']}.", ""]
        if task == "drift":
            distinct = ", ".join(f"{r['distinct_4grams']:.2f}" for r in res["records"])
            ngram = f", no repeated {res['no_repeat_ngram']}-gram" if res["no_repeat_ngram"] else ""
            lines += [
                PROTOCOL["drift"].format(
                    prefix=res["prefix"], new=res["new_tokens"], ngram=ngram, feeding=_feeding(res.get("prefill_chunk"))
                ),
                "",
                f"Samples (prefixes): {res['samples']}, seed {res['seed']}; share of distinct 4-grams in the "
                f"exact generation: {distinct}; wall time {res['seconds']:.0f} s.",
                "",
                drift_table(res),
                "",
            ]
        else:
            max_new = tasks.MAX_NEW_TOKENS[task]
            lines += [
                PROTOCOL["retrieval"].format(max_new=max_new, feeding=_feeding(res.get("prefill_chunk"))),
                "",
                f"Task {task}, filler {res['filler']}, {res['samples']} samples per length, seed {res['seed']}; "
                f"wall time {res['seconds']:.0f} s.",
                "",
                retrieval_table(res),
                "",
                "Per sample:",
                "",
                sample_table(res),
                "",
            ]
        lines += [f"![{f}]({f})" for f in res.get("plots", [])]
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    from kvarn.eval.models import BUNDLED_MODELS, DEFAULT_MODEL

    p = argparse.ArgumentParser(
        prog="kvarn report",
        description="Long-context retrieval (passkey, niah, vartrack) and generation drift (drift) of quantized "
        "KV caches, fed the way a vLLM request is.",
    )
    p.add_argument("--task", choices=TASKS, required=True, help="the task (kl: the teacher-forced report)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model(s), comma-separated: bundled names ({', '.join(BUNDLED_MODELS)}) or 'all', local Hugging Face "
        f"folders, or GGUF files; default {DEFAULT_MODEL}",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (see kvarn report --help) or 'all' (the report's, each kvarn_* preset also "
        "as _ks); default: the report's default methods, each kvarn_* preset followed by its _ks form",
    )
    p.add_argument("--regions", default="tail,sink", help="'tail' and/or 'sink', comma-separated; default both")
    p.add_argument(
        "--lengths",
        default=None,
        help="context lengths in tokens, comma-separated (retrieval tasks; default "
        f"{','.join(map(str, DEFAULT_LENGTHS))}; at most the model's context length)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"samples per length (retrieval; default {DEFAULT_SAMPLES}, sized for a CPU: take 50 on a GPU) or "
        f"prefixes (drift; default {DRIFT_SAMPLES})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated samples (default 0)")
    p.add_argument(
        "--filler",
        choices=tasks.FILLERS,
        default=None,
        help="filler text of the retrieval tasks: neutral sentences (noise) or the bundled prose (prose); default "
        + ", ".join(f"{k} for {t}" for t, k in tasks.DEFAULT_FILLER.items()),
    )
    p.add_argument(
        "--prefix", type=int, default=None, help=f"drift: prefix tokens, a multiple of 128 (default {DRIFT_PREFIX})"
    )
    p.add_argument(
        "--new-tokens", type=int, default=None, help=f"drift: tokens the exact model generates (default {DRIFT_TOKENS})"
    )
    p.add_argument(
        "--no-repeat-ngram",
        type=int,
        default=None,
        help=f"drift: greedy runs never repeat an n-gram of this size, 0 for plain greedy (default {NO_REPEAT_NGRAM})",
    )
    p.add_argument("--text", default=None, help="drift: a UTF-8 text file to take the prefixes from (default bundled)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; cuda runs the Triton kernels)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="feed prompts as the first tile, then chunks of TOKENS tokens (a multiple of 128), the KVarN-record "
        "methods through the paged attention of a vLLM prompt chunk: the same rule, for far fewer forwards (on a GPU, "
        "2048); default one tile a chunk",
    )
    p.add_argument("--out", default="report", help="output folder (default ./report)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; per worker)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes answering samples at once, each with its own copy of the model (default 1; on a GPU, "
        "where one process leaves the device mostly idle, 8 for a small model)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="take the samples already in --out's record log (NAME_TASK.records.jsonl, written as samples finish) "
        "instead of running them again: a stopped run goes on, or a finished one gains samples or lengths",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    drift_only = {"--prefix": args.prefix, "--new-tokens": args.new_tokens, "--no-repeat-ngram": args.no_repeat_ngram}
    drift_only["--text"] = args.text
    if args.task == "kl":
        p.error("--task kl is kvarn report's default protocol; run it without the long-context options")
    if args.task == "drift":
        for flag, value in (("--lengths", args.lengths), ("--filler", args.filler)):
            if value is not None:
                p.error(f"{flag} applies to the retrieval tasks (passkey, niah, vartrack), not to --task drift")
        args.prefix = DRIFT_PREFIX if args.prefix is None else args.prefix
        args.new_tokens = DRIFT_TOKENS if args.new_tokens is None else args.new_tokens
        args.no_repeat_ngram = NO_REPEAT_NGRAM if args.no_repeat_ngram is None else args.no_repeat_ngram
        args.samples = DRIFT_SAMPLES if args.samples is None else args.samples
        if args.prefix <= 0 or args.prefix % BLOCK:
            p.error(f"--prefix must be a positive multiple of {BLOCK} tokens, got {args.prefix}")
        if args.new_tokens < WINDOW:
            p.error(f"--new-tokens must be at least {WINDOW} (one KL window), got {args.new_tokens}")
        if args.no_repeat_ngram < 0 or args.no_repeat_ngram == 1:
            p.error(f"--no-repeat-ngram must be 0 (off) or at least 2, got {args.no_repeat_ngram}")
        if args.text is not None and not pathlib.Path(args.text).is_file():
            p.error(f"--text {args.text!r}: no such file")
        args.length_list = [args.prefix + args.new_tokens]
    else:
        for flag, value in drift_only.items():
            if value is not None:
                p.error(f"{flag} applies to --task drift, not to --task {args.task}")
        args.samples = DEFAULT_SAMPLES if args.samples is None else args.samples
        try:
            args.length_list = [int(x) for x in (args.lengths or ",".join(map(str, DEFAULT_LENGTHS))).split(",")]
        except ValueError:
            p.error(f"--lengths takes comma-separated token counts such as 1024,2048, got {args.lengths!r}")
        for n in args.length_list:
            if n < MIN_LENGTH:
                p.error(f"--lengths: every length must be at least {MIN_LENGTH} tokens, got {n}")
        if len(set(args.length_list)) != len(args.length_list):
            p.error(f"--lengths lists a length twice: {args.lengths}")
        args.length_list.sort()
    if args.samples < 1:
        p.error(f"--samples must be at least 1, got {args.samples}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    args.models = list(BUNDLED_MODELS) if args.model == "all" else [m.strip() for m in args.model.split(",")]
    for m in args.models:
        if m not in BUNDLED_MODELS and not pathlib.Path(m).expanduser().exists():
            p.error(
                f"unknown model {m!r}: give a bundled name ({', '.join(BUNDLED_MODELS)}), a local Hugging Face "
                "folder or a GGUF file"
            )
        limit = _context_length(m)
        if limit is not None and max(args.length_list) > limit:
            what = "--prefix + --new-tokens" if args.task == "drift" else "--lengths"
            p.error(f"{what}: {max(args.length_list)} tokens exceed {m}'s context length of {limit} tokens")
    if args.methods is None:
        args.method_list = default_methods()
    elif args.methods == "all":
        args.method_list = with_served_methods([*ALL_BASELINES, "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64"])
    else:
        args.method_list = [m.strip() for m in args.methods.split(",")]
    args.method_list = [m for m in args.method_list if m]
    if not args.method_list:
        p.error("--methods lists no method")
    for m in args.method_list:
        try:
            get_method(m)
        except ValueError as e:
            p.error(str(e))
    args.region_list = [r.strip() for r in args.regions.split(",") if r.strip()]
    if not args.region_list or any(r not in REGION_LABEL for r in args.region_list):
        p.error(f"--regions takes 'tail' and/or 'sink', got {args.regions!r}")
    args.region_list = list(dict.fromkeys(args.region_list))
    if args.prefill_chunk is not None:
        try:
            check_chunk(args.prefill_chunk, [get_method(m) for m in args.method_list])
        except ValueError as e:
            p.error(f"--prefill-chunk: {e}")
    return args


def _context_length(model: str) -> int | None:
    """The model's context length where it is known without loading (bundled, or a folder's config.json)."""
    if model in MAX_CONTEXT:
        return MAX_CONTEXT[model]
    config = pathlib.Path(model).expanduser() / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text()).get("max_position_embeddings")
        except ValueError:
            return None
    return None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in pathlib.Path(name).name or name)


def main(argv: list[str], progress_factory: Callable | None = None, commit: Callable[[], str] | None = None) -> int:
    """``kvarn report --task passkey|niah|vartrack|drift ...``; returns the exit status.

    ``progress_factory(total=N, quiet=...)`` makes the progress bar (``tick``, ``describe``, ``close``);
    ``commit()`` names the kvarn version in the report.
    """
    args = _parse(argv)
    try:
        import torch

        from kvarn.eval.models import BUNDLED_MODELS, load_model, model_dir
    except ImportError as e:
        print(f"kvarn report needs transformers, gguf and accelerate: pip install 'kvarn[hf]' ({e})", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    version = commit() if commit else "kvarn"  # read now: a long run's checkout may move on before it ends
    text = None
    if args.text is not None:
        try:
            text = pathlib.Path(args.text).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            print(
                f"kvarn report: --text {args.text}: not a UTF-8 text file ({e.reason} at byte {e.start})",
                file=sys.stderr,
            )
            return 2
    factory = progress_factory or PlainProgress
    out = pathlib.Path(args.out)
    results = []
    for name in args.models:
        t0 = time.perf_counter()
        try:
            path = model_dir(name)
            limit = _context_length(str(path))
            if limit is not None and max(args.length_list) > limit:
                raise ValueError(f"{max(args.length_list)} tokens exceed {name}'s context length of {limit} tokens")
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            if args.task == "drift":
                from kvarn.eval.harness import bundled_text

                drift_prefixes(tok, bundled_text() if text is None else text, args.prefix, args.samples, args.seed)
            else:
                tasks.make_sample(args.task, tok, args.length_list[0], 0, args.seed, args.filler)
        except (ModuleNotFoundError, ImportError, ValueError, FileNotFoundError, OSError) as e:
            print(f"kvarn report: {name}: {e}", file=sys.stderr)
            return 2
        runs = plan_runs(args.method_list, args.region_list)
        what = f"{args.task}, {len(runs)} runs ({', '.join(r.label for r in runs)})"
        print(f"kvarn report: {name}: {what}")
        settings = {"task": args.task, "model": name, "runs": [r.label for r in runs], "seed": args.seed}
        settings["device"] = args.device
        if args.task == "drift":
            settings |= {"prefix": args.prefix, "new_tokens": args.new_tokens, "no_repeat_ngram": args.no_repeat_ngram}
            settings["text"] = args.text or "bundled"
        else:
            settings["filler"] = args.filler or tasks.DEFAULT_FILLER[args.task]
        if args.prefill_chunk is not None:  # logs of one-tile runs, written before this setting, have no entry
            settings["prefill_chunk"] = args.prefill_chunk
        try:
            records_log = RecordLog(out / f"{_slug(name)}_{args.task}.records.jsonl", settings, args.resume)
        except ValueError as e:
            print(f"kvarn report: {e}", file=sys.stderr)
            return 2
        model = workers = None
        try:
            if args.workers > 1:
                workers = Workers(name, args.device, args.workers, args.threads)
                config = workers.config
            else:
                model, tok = load_model(name, device=args.device)
                config = model.config
            for m in args.method_list:
                policy = get_method(m).policy
                if policy is not None:
                    policy.kept(config.num_hidden_layers)
        except (ModuleNotFoundError, ImportError, ValueError, FileNotFoundError, RuntimeError) as e:
            if workers is not None:
                workers.close(wait=False)
            print(f"kvarn report: {e}", file=sys.stderr)
            return 2

        def bar(total: int):
            return factory(total=total, quiet=args.quiet)

        try:
            if args.task == "drift":
                res = drift(
                    model,
                    tok,
                    runs,
                    args.prefix,
                    args.new_tokens,
                    args.samples,
                    args.seed,
                    text,
                    args.no_repeat_ngram,
                    bar,
                    workers=workers,
                    records_log=records_log,
                    chunk=args.prefill_chunk,
                )
            else:
                res = retrieval(
                    model,
                    tok,
                    args.task,
                    runs,
                    args.length_list,
                    args.samples,
                    args.seed,
                    args.filler,
                    bar,
                    workers=workers,
                    records_log=records_log,
                    chunk=args.prefill_chunk,
                )
        except BaseException:
            if workers is not None:
                workers.close(wait=False)  # an interrupted report stops its workers at once
            raise
        if workers is not None:
            workers.close()
        res["model"] = name
        res["model_source"] = (
            f"{name} (bundled: {BUNDLED_MODELS[name].description})"
            if name in BUNDLED_MODELS
            else f"{pathlib.Path(name).expanduser().resolve()} (local)"
        )
        res["device"] = args.device
        res["workers"] = args.workers
        res["commit"] = version
        res["seconds"] = time.perf_counter() - t0
        out.mkdir(parents=True, exist_ok=True)
        plot = plot_drift if args.task == "drift" else plot_retrieval
        res["plots"] = plot(res, out, _slug(name))
        results.append(res)
        print()
        print(f"{name}: {args.task}")
        print(drift_table(res) if args.task == "drift" else retrieval_table(res))
        del model
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    command = "kvarn report " + " ".join(argv)
    path = write_markdown(results, out, command.strip(), results[0]["commit"])
    print(f"\nwrote {path}, {out / 'results.json'} and {sum(len(r['plots']) for r in results)} plots")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main(sys.argv[1:]))
