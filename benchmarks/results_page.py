"""Write ``benchmarks/RESULTS.md`` from the JSON files in ``benchmarks/results/``.

    python benchmarks/results_page.py > benchmarks/RESULTS.md
    python benchmarks/results_page.py --write              # the same, written in place
    python benchmarks/results_page.py --results DIR        # read another directory

The JSON files were written by the benchmarks over time, alone or nested inside a record of several device
calls, so their schemas differ. The page reads them by the shape of their records, not by file name: a
``bench_decode.py --grid`` run (``env`` beside a ``grid`` list), an ``--eager`` run, a ``bench_store.py`` run,
``bench_vllm.py bench`` records (``model``, ``kv_cache_dtype``, ``kv_tokens``), a ``bench_e2e_generate.py``
run (``meta`` and ``rows``), a ``bench_longctx_feed.py`` run and ``kvarn report --task`` records (its
``command`` beside its ``summary``), wherever they sit in a file. For each area it takes the newest file that holds
that area's records (files sort by the date their name starts with, then by name, numbers as numbers), and
says which file, GPU, versions and commit each table comes from. A file it cannot parse, a record whose values
are not what the benchmark writes (the next older one is shown) and a file with none of these records are listed
at the end, never an error. Standard library only: it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE / "RESULTS.md"

# Variants measured against the code of their day and not merged: never the current figures.
NOT_MERGED = {
    "2026-12-04-h200-store-split-kernels.json": ("calls/0/store_new", "calls/1/store_split"),
}

ENV_KEYS = ("gpu", "torch", "triton", "vllm", "transformers", "date", "commit", "base_commit", "tree", "code")
DECODE_KEYS = {"preset", "d", "batch", "ctx", "kvarn_us", "sdpa_us"}
EAGER_KEYS = {"preset", "d", "batch", "ctx", "eager_host_us", "sdpa_eager_host_us"}
STORE_KEYS = {"preset", "d", "dtype", "store_GBps", "store_us"}
FORCED_KEYS = {"knobs", "forced", "force", "launch", "round"}
TPOT = re.compile(r"tpot_ms_b(\d+)_ctx(\d+)$")
PREFILL = re.compile(r"prefill_(\d+)k_tok_s$")
VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?(?:\+\w+)?")
HEX = re.compile(r"\b[0-9a-f]{7,40}(?:-dirty)?\b")


@dataclass
class Source:
    """One JSON file: its name, date (from the name) and parsed content."""

    name: str
    date: str
    data: object


@dataclass
class Found:
    """A record found in a file: where, and the environment the file states around it."""

    source: Source
    order: int
    path: str
    obj: dict
    env: dict = field(default_factory=dict)


def sort_key(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def load(results: Path) -> tuple[list[Source], list[str]]:
    """Every ``*.json`` under ``results``, oldest first, and a note for each file that could not be read."""
    sources, notes = [], []
    for p in sorted(results.glob("*.json"), key=lambda p: sort_key(p.name)):
        m = re.match(r"(\d{4}-\d{2}-\d{2})", p.name)
        if m is None:
            notes.append(f"`{p.name}`: no date at the start of its name")
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            notes.append(f"`{p.name}`: not JSON ({type(e).__name__})")
            continue
        sources.append(Source(p.name, m.group(1), data))
    return sources, notes


def _merge_env(env: dict, obj: dict) -> dict:
    out = dict(env)
    for holder in (obj.get("env"), obj.get("environment"), obj.get("meta"), obj):
        if isinstance(holder, dict):
            out.update({k: holder[k] for k in ENV_KEYS if isinstance(holder.get(k), str) and holder[k].strip()})
    return out


def walk(sources: list[Source]) -> list[Found]:
    """Every dict in every file (depth first, in file order), with the environment its enclosing dicts state."""
    found: list[Found] = []

    def visit(src: Source, obj: object, path: tuple, env: dict) -> None:
        if isinstance(obj, dict):
            env = _merge_env(env, obj)
            found.append(Found(src, len(found), "/".join(path), obj, env))
            for k, v in obj.items():
                visit(src, v, (*path, str(k)), env)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                visit(src, v, (*path, str(i)), env)

    for src in sources:
        visit(src, src.data, (), {"date": src.date})
    return [f for f in found if not _not_merged(f)]


def _not_merged(f: Found) -> bool:
    return any(f.path == p or f.path.startswith(p + "/") for p in NOT_MERGED.get(f.source.name, ()))


def rows_of(obj: dict, key: str, need: set, forbid: frozenset = frozenset()) -> list[dict] | None:
    """``obj[key]`` if it is a non-empty list of dicts that all hold ``need`` and none of ``forbid``."""
    rows = obj.get(key)
    if not isinstance(rows, list) or not rows:
        return None
    if all(isinstance(r, dict) and need <= r.keys() and not forbid & r.keys() for r in rows):
        return rows
    return None


def version(s: str | None) -> str | None:
    m = VERSION.search(s) if s else None
    return m.group(0) if m else None


def commit_of(env: dict) -> str:
    for k in ("commit", "base_commit"):
        v = env.get(k, "").strip()
        if v and v != "unknown":
            m = HEX.search(v)
            return m.group(0)[:7] + ("-dirty" if m.group(0).endswith("-dirty") else "") if m else v
    for k in ("tree", "code"):  # a sentence that names a commit, not a bare content digest
        v = env.get(k, "")
        m = HEX.search(v)
        if m and " " in v.strip():
            return m.group(0)
    return "not recorded"


def provenance(
    f: Found, *, vllm: bool = False, transformers: bool = False, triton: bool = True, also: list[Found] | None = None
) -> str:
    """Where a table's figures come from: file, date, GPU, versions, commit (of ``f`` and of ``also``'s records)."""
    env = f.env
    gpu = re.sub(r"\s*\(.*\)", "", env.get("gpu", "")).strip()
    if not gpu:
        tag = re.match(r"\d{4}-\d{2}-\d{2}-([a-z]+\d+)-", f.source.name)
        gpu = f"{tag.group(1).upper()} (from the file name)" if tag else "GPU not recorded"
    parts = [gpu, f"torch {version(env.get('torch')) or 'not recorded'}"]
    if triton:
        parts.append(f"triton {version(env.get('triton')) or 'not recorded'}")
    if vllm:
        parts.append(f"vLLM {version(env.get('vllm')) or 'not recorded'}")
    if transformers:
        parts.append(f"transformers {version(env.get('transformers')) or 'not recorded'}")
    commits = sorted({commit_of(g.env) for g in (also or [f])} | {commit_of(env)})
    parts.append(f"commit {', '.join(commits)}")
    date = env.get("date") if re.fullmatch(r"\d{4}-\d{2}-\d{2}", env.get("date", "")) else f.source.date
    return f"[`{f.source.name}`](results/{f.source.name}), {date}: " + ", ".join(parts)


def ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def short(preset: str) -> str:
    return preset.removeprefix("kvarn_")


def num(x: object, digits: int = 1) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def ratio(x: object, base: object) -> str:
    if isinstance(x, int | float) and isinstance(base, int | float) and base and not isinstance(x, bool):
        return f"{x / base:.2f}x"
    return ""


def table(header: list[str], rows: list[list[str]], right: int = 1) -> list[str]:
    align = ["---"] * right + ["---:"] * (len(header) - right)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


UNREADABLE = (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError)


def newest_that_renders(cands: list, render, area: str, notes: list[str]) -> list[str] | None:
    """``render`` of the newest candidate it can read; each one it cannot read (a value of another type than the
    benchmark writes) gets a note, and the next older candidate is tried."""
    for c in reversed(cands):
        try:
            return render(c)
        except UNREADABLE as e:
            f = c[-1] if isinstance(c, list) else c
            where = f"record `{f.path}`" if f.path else "the whole file"
            notes.append(f"`{f.source.name}`, {where}: not read as {area} ({type(e).__name__}: {e})")
    return None


def decode_section(found: list[Found], notes: list[str]) -> list[str] | None:
    grids = [f for f in found if "env" in f.obj and rows_of(f.obj, "grid", DECODE_KEYS, FORCED_KEYS)]
    runs = grids or [f for f in found if "env" in f.obj and rows_of(f.obj, "rows", DECODE_KEYS, FORCED_KEYS)]
    return newest_that_renders(runs, lambda f: _decode(f, "grid" if grids else "rows"), "a decode run", notes)


def _decode(f: Found, key: str) -> list[str]:
    rows = f.obj[key]
    cells = {(r["preset"], r["d"], r["batch"], r["ctx"]): r for r in rows}
    ctxs = sorted({k[3] for k in cells})
    keys = sorted({k[:3] for k in cells}, key=lambda k: (k[0] != "kvarn_k4v2_g128", k[1] != 128, k[0], k[1], k[2]))
    body = []
    for preset, d, batch in keys:
        line = [short(preset), str(d), str(batch)]
        for c in ctxs:
            r = cells.get((preset, d, batch, c))
            line.append(f"{r['kvarn_us']:.1f} µs, {r['sdpa_us'] / r['kvarn_us']:.2f}x" if r else "")
        body.append(line)
    heads = sorted({f"{r.get('hq', '?')} / {r.get('hkv', '?')}" for r in rows})
    dtypes = sorted({str(r.get("dtype", "?")) for r in rows})
    return [
        "## Decode attention kernel against flash SDPA",
        "",
        f"Source: {provenance(f)}.",
        "",
        "`benchmarks/bench_decode.py --grid`: one decode step of `kvarn.ops.paged_attention` over a paged KVarN",
        "cache against `torch` flash SDPA over an fp16 cache of the same tokens, both timed as CUDA-graph replays",
        f"in the same run; query / KV heads {', '.join(heads)}, queries {', '.join(dtypes)}, default launches.",
        "Each cell: kvarn's time per call, then SDPA's time over kvarn's (above 1: kvarn faster).",
        "",
        *table(["preset", "D", "batch", *[f"context {ctx_label(c)}" for c in ctxs]], body, right=3),
    ]


SMOOTH_KEYS = DECODE_KEYS | {"smoothed_us", "seq_smoothed_us"}


def smooth_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [f for f in found if "env" in f.obj and rows_of(f.obj, "rows", SMOOTH_KEYS, FORCED_KEYS)]
    return newest_that_renders(runs, _smooth, "a key-smoothing decode run", notes)


def _shape_cells(r: dict) -> list[str]:
    """A decode row's preset, head dim, batch and context, as the decode tables' first cells."""
    return [short(r["preset"]), str(r["d"]), str(r["batch"]), ctx_label(r["ctx"])]


def _smooth(f: Found) -> list[str]:
    body = [
        [
            *_shape_cells(r),
            num(r["kvarn_us"]),
            f"{num(r['seq_smoothed_us'])} ({ratio(r['seq_smoothed_us'], r['kvarn_us'])})",
            f"{num(r['smoothed_us'])} ({ratio(r['smoothed_us'], r['kvarn_us'])})",
            ratio(r["sdpa_us"], r["kvarn_us"]),
        ]
        for r in f.obj["rows"]
    ]
    return [
        "## Decode with key smoothing",
        "",
        f"Source: {provenance(f)}.",
        "",
        "`benchmarks/bench_decode.py --smooth`: the default decode launch over plain records, over records whose keys",
        "are smoothed with one vector per sequence (the `_ks` presets) and with one per tile, CUDA-graph replays;",
        "query / KV heads 32 / 8, float16. In brackets: the time over plain's.",
        "",
        *table(
            ["preset", "D", "batch", "context", "plain µs", "per sequence µs", "per tile µs", "plain vs SDPA"],
            body,
            right=4,
        ),
    ]


SPEC_ENGINES = {"default": "default engine, no drafts", "v1": "V1 runner, no drafts", "v1_drafts": "V1 runner, drafts"}


def spec_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [
        f
        for f in found
        if isinstance(f.obj.get("engines"), dict)
        and "drafts" in f.obj
        and any(isinstance(e, dict) and "tpot_ms" in e for e in f.obj["engines"].values())
    ]
    return newest_that_renders(runs, _spec, "a speculative-decoding run", notes)


def _spec(f: Found) -> list[str]:
    o, engines = f.obj, f.obj["engines"]
    base = engines.get("default", {}).get("tpot_ms")
    body = []
    for name, label in SPEC_ENGINES.items():
        e = engines.get(name)
        if not isinstance(e, dict) or "tpot_ms" not in e:
            continue
        counts = e.get("spec_counts") or {}
        drafted = counts.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = counts.get("vllm:spec_decode_num_accepted_tokens", 0)
        low, high = e["tpot_range"]
        body.append(
            [
                label,
                f"{e['tpot_ms']:.2f} ({ratio(e['tpot_ms'], base)})" if base else f"{e['tpot_ms']:.2f}",
                f"{low:.2f} - {high:.2f}",
                f"{accepted} of {drafted}" if drafted else "",
            ]
        )
    drafts = o["drafts"]
    return [
        f"## Speculative decoding: time per output token ({o['model']})",
        "",
        f"Source: {provenance(f, vllm=True)}.",
        "",
        f"`benchmarks/bench_vllm.py spec`: `{o['kv_cache_dtype']}`, batch {o['batch']}, {ctx_label(o['ctx'])} context,",
        f"dummy weights; drafts: {drafts.get('method')} with {drafts.get('num_speculative_tokens')} tokens. Median ms",
        "of the pairs, in brackets against the default engine's, then the pairs' range.",
        "",
        *table(["engine", "ms a token", "range", "drafts accepted"], body, right=3),
    ]


def eager_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [f for f in found if "env" in f.obj and rows_of(f.obj, "eager", EAGER_KEYS, FORCED_KEYS)]
    return newest_that_renders(runs, _eager, "an eager run", notes)


def _eager(f: Found) -> list[str]:
    body = [
        [
            *_shape_cells(r),
            num(r["eager_host_us"]),
            num(r["sdpa_eager_host_us"]),
            ratio(r["eager_host_us"], r["sdpa_eager_host_us"]),
        ]
        for r in f.obj["eager"]
    ]
    return [
        "## Host time of an eager decode call",
        "",
        f"Source: {provenance(f)}.",
        "",
        "`benchmarks/bench_decode.py --eager`: host time of one eager call (launch plans replayed), against eager",
        "flash SDPA on the same host in the same run.",
        "",
        *table(["preset", "D", "batch", "context", "kvarn µs", "SDPA µs", "kvarn / SDPA"], body, right=4),
    ]


def store_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [f for f in found if "env" in f.obj and rows_of(f.obj, "rows", STORE_KEYS, FORCED_KEYS)]
    by_file: dict[str, list[Found]] = {}
    for f in runs:
        by_file.setdefault(f.source.name, []).append(f)
    return newest_that_renders(list(by_file.values()), _store, "a store run", notes)


def _store(runs: list[Found]) -> list[str]:
    """The rows of a file's store runs, a later run's row replacing an earlier one of the same case."""
    rows: dict[tuple, tuple[Found, dict]] = {}
    for f in runs:
        for r in f.obj["rows"]:
            rows[(r["preset"], r["d"], r["dtype"], bool(r.get("smooth_keys")))] = (f, r)
    body = [
        [
            short(r["preset"]),
            str(r["d"]),
            str(r["dtype"]),
            "yes" if r.get("smooth_keys") else "no",
            f"{r.get('tiles', '?')} x {r.get('hkv', '?')}",
            num(r["store_GBps"]),
            num(r.get("commit_GBps", "")),
            num(r["store_us"]),
        ]
        for f, r in rows.values()
    ]
    lines = [
        "## Store kernel",
        "",
        f"Source: {provenance(runs[-1], also=[f for f, _ in rows.values()])}.",
        "",
        "`benchmarks/bench_store.py`: model-frame K/V tiles to cache records (`store_tiles`: prepare, then",
        "Sinkhorn, RTN, pack and write), and `commit_tiles` from tiles already in the pool, timed from CUDA graphs",
        "after the records were checked against the reference. GB/s of K and V input.",
        "",
        *table(
            ["preset", "D", "input", "smoothed keys", "tiles x KV heads", "store GB/s", "commit GB/s", "store µs"],
            body,
            right=5,
        ),
    ]
    return lines


@dataclass
class Serving:
    """``bench_vllm.py bench`` records of one model and KV budget, keyed by cache dtype."""

    model: str
    budget: str
    records: dict[str, list[Found]] = field(default_factory=dict)


def dtype_order(dtype: str) -> tuple:
    return (dtype != "auto", dtype != "fp8", dtype)


def dtype_label(dtype: str) -> str:
    return "bf16 (`auto`)" if dtype == "auto" else f"`{dtype}`"


def serving_groups(found: list[Found]) -> tuple[list[Serving], list[str]]:
    groups: dict[tuple[str, str], Serving] = {}
    notes = []
    for f in found:
        o = f.obj
        if not ({"model", "kv_cache_dtype", "kv_tokens"} <= o.keys() and isinstance(o["model"], str)):
            continue
        budget = o.get("kv_budget")
        if not isinstance(budget, str):
            continue
        g = groups.setdefault((o["model"], budget), Serving(o["model"], budget))
        g.records.setdefault(str(o["kv_cache_dtype"]), []).append(f)
    out = []
    for g in groups.values():
        if "auto" in g.records:
            out.append(g)
        else:
            notes.append(f"vLLM records of {g.model} at KV budget {g.budget}: no bf16 run to compare with, not shown")
    return sorted(out, key=lambda g: (g.model, g.budget)), notes


def _latest(records: list[Found], has) -> Found | None:
    hits = [f for f in records if has(f.obj)]
    return hits[-1] if hits else None


def _sources_footer(picked: dict[str, Found]) -> tuple[dict[str, int], list[str]]:
    index: dict[int, int] = {}
    lines = []
    for f in picked.values():
        key = id(f.obj)
        if key not in index:
            index[key] = len(index) + 1
            settings = f.obj.get("env") if isinstance(f.obj.get("env"), str) else None
            extra = f" (`{settings}`)" if settings else ""
            lines.append(f"{index[key]}. {provenance(f, vllm=True)}; record `{f.path or '(the whole file)'}`{extra}.")
    return {d: index[id(f.obj)] for d, f in picked.items()}, lines


def _picked(g: Serving, has) -> dict[str, Found]:
    """Per cache dtype (bf16 first), the newest record of ``g`` for which ``has(record)`` holds."""
    return {d: f for d, fs in sorted(g.records.items(), key=lambda kv: dtype_order(kv[0])) if (f := _latest(fs, has))}


def _cell(picked: dict[str, Found], d: str, key: str, digits: int, with_ratio: bool = True) -> str:
    """Dtype ``d``'s figure ``key``, with its ratio to bf16's (``picked["auto"]``) unless ``d`` is bf16."""
    v = picked[d].obj.get(key)
    if v is None:
        return ""
    r = ratio(v, picked["auto"].obj.get(key)) if with_ratio and d != "auto" else ""
    return num(v, digits) + (f" ({r})" if r else "")


def serving_speed(g: Serving) -> list[str] | None:
    picked = _picked(g, lambda o: any(TPOT.match(k) for k in o))
    if "auto" not in picked:
        return None
    tpot = sorted({(int(m[2]), int(m[1])) for f in picked.values() for k in f.obj if (m := TPOT.match(k))})
    prefill = sorted({int(m[1]) for f in picked.values() for k in f.obj if (m := PREFILL.match(k))})
    idx, footer = _sources_footer(picked)

    body = [["KV cache capacity, tokens", *[_cell(picked, d, "kv_tokens", 0) for d in picked]]]
    body += [
        [f"prefill, one {k}K-token prompt, tokens/s", *[_cell(picked, d, f"prefill_{k}k_tok_s", 0) for d in picked]]
        for k in prefill
    ]
    body += [
        [
            f"time per output token, batch {b}, context {ctx_label(c)}, ms",
            *[_cell(picked, d, f"tpot_ms_b{b}_ctx{c}", 2) for d in picked],
        ]
        for c, b in tpot
    ]
    body.append(["measured (sources below)", *[f"{picked[d].source.date} [{idx[d]}]" for d in picked]])
    return [
        f"### {g.model}: capacity, prefill, time per output token",
        "",
        f"KV budget: {g.budget}. In parentheses: the figure over bf16's (capacity and prefill: higher is better;",
        "time per output token: lower is better).",
        "",
        *table(["", *[dtype_label(d) for d in picked]], body),
        "",
        *footer,
    ]


def serving_capacity_bound(g: Serving) -> list[str] | None:
    picked = _picked(g, lambda o: "cap_out_tok_s" in o or "cap_decode_tok_s" in o)
    if "auto" not in picked:
        return None
    idx, footer = _sources_footer(picked)
    decode = any("cap_decode_tok_s" in f.obj for f in picked.values())  # a run may skip the decode phase
    shapes = sorted({(f.obj.get("cap_prompt"), f.obj.get("cap_out")) for f in picked.values()}, key=str)
    shape = ", ".join(f"{num(p)} + {num(o)}" for p, o in shapes)

    rows = [
        ("requests held at once", "cap_requests", 0, True),
        *(
            [
                ("decode phase, output tokens/s", "cap_decode_tok_s", 0, True),
                ("decode phase, ms a step", "cap_decode_tpot_ms", 2, False),
            ]
            if decode
            else []
        ),
        ("end to end, output tokens/s", "cap_out_tok_s", 0, True),
        ("end to end, seconds", "cap_s", 1, False),
        ("preemptions", "cap_preemptions", 0, False),
    ]
    body = [[label, *[_cell(picked, d, k, dg, wr) for d in picked]] for label, k, dg, wr in rows]
    body.append(["measured (sources below)", *[f"{picked[d].source.date} [{idx[d]}]" for d in picked]])
    return [
        f"### {g.model}: capacity-bound serving",
        "",
        f"KV budget: {g.budget}. As many requests of {shape} (prompt + generated) tokens as the cache holds,",
        "submitted at once"
        + ("; the decode phase runs the same requests again on their prefix-cached prompts." if decode else "."),
        "In parentheses: the figure over bf16's.",
        "",
        *table(["", *[dtype_label(d) for d in picked]], body),
        "",
        *footer,
    ]


HELD = re.compile(r"max_requests_ctx(\d+)$")


def serving_requests_held(g: Serving) -> list[str] | None:
    picked = _picked(g, lambda o: any(HELD.match(k) for k in o))
    if "auto" not in picked:
        return None
    contexts = sorted({int(m[1]) for f in picked.values() for k in f.obj if (m := HELD.match(k))})
    idx, footer = _sources_footer(picked)

    body = [
        [
            f"requests of {ctx_label(c)} tokens held at once",
            *[_cell(picked, d, f"max_requests_ctx{c}", 2) for d in picked],
        ]
        for c in contexts
    ]
    body.append(["measured (sources below)", *[f"{picked[d].source.date} [{idx[d]}]" for d in picked]])
    return [
        f"### {g.model}: requests held at once",
        "",
        f"KV budget: {g.budget}. vLLM's own count of requests of that length its cache holds (its \"maximum",
        "concurrency\": a sliding-window layer's blocks counted by its window, kvarn's tail blocks included; its",
        "step pool is inside the budget).",
        "In parentheses: the figure over bf16's.",
        "",
        *table(["", *[dtype_label(d) for d in picked]], body),
        "",
        *footer,
    ]


def serving_section(found: list[Found]) -> tuple[list[str] | None, list[str]]:
    groups, notes = serving_groups(found)
    parts = []
    for g in groups:
        for make in (serving_speed, serving_capacity_bound, serving_requests_held):
            lines = make(g)
            if lines:
                parts += ["", *lines]
    if not parts:
        return None, notes
    return [
        "## vLLM serving",
        "",
        "`benchmarks/bench_vllm.py bench MODEL CACHE_DTYPE`: stock vLLM with dummy weights of the model's shapes, its",
        "default engine settings and decode CUDA graphs; each cache dtype in an engine of its own. For each dtype",
        "the newest record that has the row's measurements; the row `measured` says from which file.",
        *parts,
    ], notes


def e2e_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [
        f
        for f in found
        if isinstance(f.obj.get("meta"), dict)
        and "transformers" in f.obj["meta"]
        and rows_of(f.obj, "rows", {"cache", "batch", "context", "tokens_per_s"})
    ]
    return newest_that_renders(runs, _e2e, "an end-to-end run", notes)


def _e2e(f: Found) -> list[str]:
    body = [
        [
            str(r.get("case", "")),
            str(r["cache"]),
            str(r["batch"]),
            ctx_label(r["context"]),
            num(r.get("step_ms", ""), 1),
            num(r["tokens_per_s"], 0),
            f"{r['vs_fp16']:.2f}x" if isinstance(r.get("vs_fp16"), int | float) else "",
            num(r.get("kv_gib", ""), 1),
            num(r.get("peak_gib", ""), 1),
        ]
        for r in f.obj["rows"]
    ]
    return [
        "## transformers end to end",
        "",
        f"Source: {provenance(f, transformers=True, triton=False)}.",
        "",
        "`benchmarks/bench_e2e_generate.py`: decode steps of a whole model (the script's shapes, random fp16",
        'weights) with an fp16 `DynamicCache` against `KVarNCache` under `attn_implementation="kvarn"`, at equal',
        "batch and at the largest batch whose KVarN cache fits the fp16 cache's bytes.",
        "",
        *table(
            ["case", "cache", "batch", "context", "ms a step", "tokens/s", "vs fp16", "KV GiB", "peak GiB"],
            body,
            right=2,
        ),
    ]


FEED_KEYS = {"shape", "tokens", "cache", "chunked_prompt_s", "chunked_token_ms"}


def feed_section(found: list[Found], notes: list[str]) -> list[str] | None:
    runs = [f for f in found if f.obj.get("ok") is True and rows_of(f.obj, "rows", FEED_KEYS)]
    return newest_that_renders(runs, _feed, "a long-context feed run", notes)


def _feed(f: Found) -> list[str]:
    body = []
    for r in f.obj["rows"]:
        tile = r.get("tile_prompt_s")
        body.append(
            [
                str(r["shape"]),
                ctx_label(r["tokens"]),
                str(r["cache"]),
                num(tile if tile is not None else "", 2),
                num(r["chunked_prompt_s"], 2) + (f" ({ratio(r['chunked_prompt_s'], tile)})" if tile else ""),
                num(r.get("tile_token_ms", ""), 1),
                num(r["chunked_token_ms"], 1),
                num(r.get("max_abs_dlogp", ""), 4),
            ]
        )
    chunk = f.obj.get("meta", {}).get("chunk", "N")
    return [
        "## Long-context harness: how a prompt is fed",
        "",
        f"Source: {provenance(f, transformers=True)}.",
        "",
        "`benchmarks/bench_longctx_feed.py`: `kvarn report --task ...` feeding a prompt one tile a forward against",
        f"the first tile and then {chunk}-token chunks (`--prefill-chunk`, the KVarN caches through the paged",
        "attention), random fp16 models in the bundled models' shapes; the largest log-probability difference of the",
        "two feeds over 256 teacher-forced positions gates the run.",
        "",
        *table(
            [
                "shape",
                "prompt",
                "cache",
                "prompt s, one tile",
                "prompt s, chunked",
                "ms a token, one tile",
                "ms a token, chunked",
                "max abs dlogp",
            ],
            body,
            right=3,
        ),
    ]


TASK = re.compile(r"^kvarn report --task (passkey|niah|vartrack|drift)\b")
RETRIEVAL_KEYS = {"label", "length", "accuracy", "n"}
DRIFT_KEYS = {"label", "kl_at", "kl_mean", "top1"}
DRIFT_AT = ("64", "256", "512", "1024")
SETTINGS = {
    "retrieval": (("--seed", "0"), ("--filler", "task default")),
    "drift": (("--seed", "0"), ("--prefix", "256"), ("--new-tokens", "1024"), ("--no-repeat-ngram", "4")),
}
"""Options that change what a long-context run measures: runs that differ in one are never merged."""


def _option(command: str, name: str, default: str) -> str:
    m = re.search(rf"(?:^|\s){re.escape(name)}[ =](\S+)", command)
    return m.group(1) if m else default


def _longctx_runs(found: list[Found]) -> dict[tuple, dict[tuple, Found]]:
    """``kvarn report --task`` summary rows by (task, model, settings, samples), each (label, length) cell from the
    newest record that holds it (files oldest first, records in file order). Runs of one seed and sample count
    answer the same samples, so a table's columns compare like with like."""
    groups: dict[tuple, dict[tuple, Found]] = {}
    for f in found:
        command = f.obj.get("command")
        m = TASK.match(command) if isinstance(command, str) else None
        if m is None or "--text " in command:
            continue
        task = m.group(1)
        kind = "drift" if task == "drift" else "retrieval"
        rows = rows_of(f.obj, "summary", DRIFT_KEYS if kind == "drift" else RETRIEVAL_KEYS)
        if rows is None:
            continue
        settings = tuple(f"{k} {_option(command, k, d)}" for k, d in SETTINGS[kind])
        model = _option(command, "--model", "smollm2-135m")
        env = f.env if "--device cuda" in command else {**f.env, "gpu": "CPU"}
        for r in rows:
            n = int(_option(command, "--samples", "1")) if kind == "drift" else r["n"]
            cells = groups.setdefault((task, model, settings, n), {})
            cells[(r["label"], r.get("length"))] = Found(f.source, f.order, f.path, r, env)
    return groups


def _pct(x: object, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%" if isinstance(x, int | float) and not isinstance(x, bool) else "-"


def longctx_section(found: list[Found], notes: list[str]) -> list[str] | None:
    groups = _longctx_runs(found)
    if not groups:
        return None
    out = [
        "## Long-context accuracy and drift",
        "",
        "`kvarn report --task passkey|niah|vartrack|drift` runs (`docs/guide/fidelity.md` reads them), a table for",
        "each task, model, sample count and setting (seed, filler, drift's lengths), so that a table's figures come",
        "from the same samples; a cell is the newest record's figure for its method and length. Retrieval cells:",
        "exact-match accuracy (vartrack: recall, the share of the chain's variables the answer names). Drift: KL of",
        "each method against the exact model at generated positions, mean KL and top-1 over the generation.",
    ]
    for (task, model, settings, n), cells in sorted(groups.items()):
        try:
            if task == "drift":
                body = _drift_rows(cells)
                header = ["method", *(f"KL@{p}" for p in DRIFT_AT), "mean KL", "top-1"]
            else:
                lengths = sorted({length for _, length in cells if isinstance(length, int)})
                body = _retrieval_rows(task, cells, lengths)
                header = ["method", *(ctx_label(length) for length in lengths)]
        except UNREADABLE as e:
            notes.append(f"{task} on {model}: not read as a long-context run ({type(e).__name__}: {e})")
            continue
        count = f"{n} prefixes" if task == "drift" else f"{n} samples a length"
        out += ["", f"### {task}, {model}, {count} ({', '.join(settings)})", "", *table(header, body), ""]
        files = sorted({f.source.name: f for f in cells.values()}.values(), key=lambda f: sort_key(f.source.name))
        out += [f"- {provenance(f, transformers=True, triton=False)}" for f in files]
    return out


def _retrieval_rows(task: str, cells: dict[tuple, Found], lengths: list[int]) -> list[list[str]]:
    labels = sorted(dict.fromkeys(label for label, _ in cells), key=lambda x: x != "exact")
    key = "recall" if task == "vartrack" else "accuracy"
    rows = []
    for label in labels:
        row = [label]
        for n in lengths:
            f = cells.get((label, n))
            # a tenth of a point where one sample is less than a point, or the score is a mean recall
            digits = 1 if task == "vartrack" or (f is not None and f.obj["n"] > 100) else 0
            row.append("-" if f is None else _pct(f.obj.get(key), digits))
        rows.append(row)
    return rows


def _drift_rows(cells: dict[tuple, Found]) -> list[list[str]]:
    rows = []
    for (label, _), f in cells.items():
        kl = f.obj["kl_at"]
        at = [f"{kl[p]:.1e}" if p in kl else "-" for p in DRIFT_AT]
        rows.append([label, *at, f"{f.obj['kl_mean']:.1e}", _pct(f.obj["top1"])])
    return rows


def render(results: Path) -> str:
    sources, notes = load(results)
    found = walk(sources)
    serving, serving_notes = serving_section(found)
    notes += serving_notes
    sections = [decode_section(found, notes), smooth_section(found, notes), eager_section(found, notes)]
    sections += [store_section(found, notes), serving, spec_section(found, notes), e2e_section(found, notes)]
    sections += [feed_section(found, notes), longctx_section(found, notes)]
    used = {f.source.name for f in found if _recognised(f)}
    unread = [s.name for s in sources if s.name not in used]
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/results_page.py --write` from `benchmarks/results/*.json`; do not edit by",
        "hand (`tests/test_results_page.py` fails when this page and the JSON files disagree). Each table is the",
        "newest measurement of its area, with the file, GPU, versions and commit it comes from. Older measurements",
        "and how the figures got here are in the JSON files and in git history.",
    ]
    for s in sections:
        if s:
            lines += ["", *s]
    if unread:
        notes.append("no records this page reads: " + ", ".join(f"`{n}`" for n in unread))
    if notes:
        lines += ["", "## Files not shown", "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def _recognised(f: Found) -> bool:
    o = f.obj
    return bool(
        ("env" in o and any(rows_of(o, k, DECODE_KEYS) for k in ("grid", "rows")))
        or ("env" in o and rows_of(o, "eager", EAGER_KEYS))
        or ("env" in o and rows_of(o, "rows", STORE_KEYS))
        or {"model", "kv_cache_dtype", "kv_tokens"} <= o.keys()
        or (isinstance(o.get("engines"), dict) and "drafts" in o)
        or (isinstance(o.get("meta"), dict) and rows_of(o, "rows", {"cache", "tokens_per_s"}))
        or (o.get("ok") is True and rows_of(o, "rows", FEED_KEYS))
        or bool(_longctx_runs([f]))
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="directory of result JSON files")
    ap.add_argument("--write", action="store_true", help=f"write the page to {PAGE.name} beside this script")
    args = ap.parse_args(argv)
    page = render(args.results)
    if args.write:
        PAGE.write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
