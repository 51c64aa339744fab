"""Long-context retrieval with a quantized KV cache, along the path a vLLM request takes.

The measurements behind ``kvarn report --task passkey|niah|vartrack`` and the pieces ``--task drift``
shares (:mod:`kvarn.eval.longctx_report` writes the tables and ``report.md``, :mod:`kvarn.eval.longctx_plots`
the plots).

**The cache path of a request.** The prompt is fed in chunks of one tile (the method's ``G``
tokens, 128 for every default method): each chunk attends over its earlier tiles as the method
stored them and over its own tile exactly (the own-tile rule), then the answer is decoded token by
token, each token seeing the earlier tiles quantized and its own tile from the full-precision tail.
With a longer prompt chunk (:class:`Feed`), the exact model and the KVarN-record methods take the
first tile alone and then that many tokens at a time, the methods through the paged attention a vLLM
request's prompt chunks take (``KVarNCache(paged=True)``), which keeps the own-tile rule for queries
of many tiles: the same answers up to the order of the arithmetic, for far fewer forwards.
Methods are :mod:`kvarn.eval.methods`' caches (:meth:`Method.make_cache`), K/V rounded to fp16
before storing; ``tail`` keeps only the incomplete last tile in full precision, ``sink`` the first
tile as well. A lossless method (``fp16``) is the same in both settings and runs once. The
yardstick ("exact") is the model in its own dtype with an unquantized cache.

**Retrieval** (:mod:`kvarn.eval.tasks`): every method answers every sample greedily (at most the
task's few answer tokens, stopping once the answer is complete or at an end-of-sequence token);
scored by exact match, and by agreement with the exact model's own (normalised) answer.

**Drift** (:mod:`kvarn.eval.drift`) follows the same path along a long generation.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvarn.eval import tasks
from kvarn.eval.harness import BLOCK, attention_backends
from kvarn.eval.methods import DEFAULT_METHODS, Method, get_method, with_served_methods
from kvarn.eval.workers import Workers

DRIFT_PREFIX = 256
DRIFT_TOKENS = 1024
NO_REPEAT_NGRAM = 4
WINDOW = 64
"""Drift's KL is averaged over windows of this many generated positions."""
DRIFT_POSITIONS = (64, 256, 512, 1024)
"""Generated positions whose window (the 64 positions up to it) the drift table shows."""
REGION_LABEL = {"tail": "tail", "sink": "sink+tail"}


@dataclass(frozen=True)
class Feed:
    """How a run's tokens reach its cache: chunks of one ``group``-token tile, or (``chunk``) the first tile
    alone and then ``chunk`` tokens at a time, each chunk ending on a tile boundary (``chunk`` a multiple of
    ``group``). ``paged``: the chunks attend through ``KVarNCache(paged=True)`` and ``attn_implementation="kvarn"``.
    """

    group: int
    chunk: int | None = None
    paged: bool = False

    def chunks(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """The ``[a, b)`` chunks covering ``start .. stop``."""
        g, a = self.group, start
        while a < stop:
            more = (self.chunk or g) - g if a >= g else 0  # the first tile alone: a multi-tile first chunk is exact
            b = min((a // g + 1) * g + more, stop)
            yield a, b
            a = b

    def count(self, start: int, stop: int) -> int:
        return sum(1 for _ in self.chunks(start, stop))


def feed_of(method: Method | None, chunk: int | None) -> Feed:
    """The :class:`Feed` of the exact model (``method`` None) or of ``method`` for prompt chunks of ``chunk`` tokens.

    A KVarN-record method takes them through the paged attention; a method storing tiles as fp16 / fp8 tensors
    reads its history back whole, which keeps the own-tile rule only one tile at a time.
    """
    if method is None:
        return Feed(BLOCK, chunk)
    if chunk is None or method.config is None:
        return Feed(method.group_size)
    return Feed(method.group_size, chunk, paged=True)


def check_chunk(chunk: int, methods: list[Method]) -> None:
    """Raise ValueError unless ``chunk`` is a multiple of every method's tile (and of the exact model's)."""
    for g in sorted({BLOCK, *(m.group_size for m in methods)}):
        if chunk <= 0 or chunk % g:
            raise ValueError(f"the prompt chunk must be a positive multiple of {g} tokens (a tile), got {chunk}")


def use_attention(model, paged: bool) -> None:
    """Point ``model``'s attention at the paged KVarN path (``"kvarn"``) or at transformers' SDPA."""
    from kvarn.integration.hf import register_kvarn_attention

    name = register_kvarn_attention() if paged else "sdpa"
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def default_methods() -> list[str]:
    """The report's default methods with each KVarN preset's ``_ks`` form right after it."""
    return with_served_methods(list(DEFAULT_METHODS))


@dataclass(frozen=True)
class Run:
    """One method in one full-precision region setting."""

    method: Method
    region: str

    @property
    def label(self) -> str:
        return f"{self.method.name} [{REGION_LABEL[self.region]}]"


def lossless(method: Method) -> bool:
    """Whether ``method`` stores tiles as they are (fp16): the sink then changes nothing."""
    return method.config is None and method.fp8 is None


def plan_runs(methods: list[str], regions: list[str]) -> list[Run]:
    """Every (method, region), a lossless method in the first region only."""
    runs = []
    for name in methods:
        method = get_method(name)
        runs += [Run(method, region) for region in (regions[:1] if lossless(method) else regions)]
    return runs


class _Ticks:
    """Counts one run's progress steps, so that steps it skipped (an answer that stopped early) are ticked too."""

    def __init__(self, bar):
        self.bar, self.n = bar, 0

    def tick(self) -> None:
        self.n += 1
        self.bar.tick()

    def settle(self, planned: int) -> None:
        while self.n < planned:
            self.tick()
        self.n = 0


class PlainProgress:
    """Progress as lines on stderr (used when no progress factory is given)."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.n, self.quiet, self.t0 = total, 0, quiet, time.perf_counter()

    def tick(self) -> None:
        self.n += 1

    def describe(self, label: str) -> None:
        if not self.quiet:
            print(f"  {label} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr)

    def close(self) -> None:
        pass


class RecordLog:
    """A run's finished samples, a JSON line each as it finishes, so that a stopped run loses only the samples it
    was answering and ``kvarn report --resume`` takes up the rest (or more samples) where it stopped.

    The first line holds the settings the records depend on (``config``); resuming with other settings is refused,
    naming the first that differs.
    """

    def __init__(self, path, config: dict, resume: bool = False):
        self.path, self.done = pathlib.Path(path), {}
        if resume and self.path.is_file():
            text = self.path.read_text().splitlines()
            try:
                lines = [json.loads(line) for line in text if line.strip()]
            except json.JSONDecodeError:  # a line cut short by a killed run: drop it, keep the finished ones
                lines = [json.loads(line) for line in text[:-1] if line.strip()]
                self.path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            if not lines or "config" not in lines[0]:
                raise ValueError(f"{self.path} is not a kvarn report record log")
            theirs = lines[0]["config"]
            for key in sorted(set(theirs) | set(config)):
                if theirs.get(key) != config.get(key):
                    raise ValueError(
                        f"{self.path} holds a run with {key} = {theirs.get(key)!r}, not {config.get(key)!r}; "
                        "resume with that run's settings or write to another --out"
                    )
            self.done = {tuple(line["key"]): line["record"] for line in lines[1:]}
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"config": config}) + "\n")

    def add(self, key: tuple, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"key": list(key), "record": record}) + "\n")
        self.done[tuple(key)] = record


def taken_from_log(records_log: RecordLog | None, keys: list[tuple]) -> tuple[list, list[int], str]:
    """Each key's record already in ``records_log`` (None where there is none), the positions still to run, and the
    start line's note on what was taken (``"; N taken from PATH"``, or ``""``)."""
    done = records_log.done if records_log else {}
    records = [done.get(key) for key in keys]
    todo = [i for i, r in enumerate(records) if r is None]
    kept = f"; {len(keys) - len(todo)} taken from {records_log.path}" if len(todo) < len(keys) else ""
    return records, todo, kept


def _forward(model, ids, cache, last_only: bool = False):
    """Logits ``[n, V]`` of the chunk ``ids`` (``[1, V]``, its last position's, with ``last_only``)."""
    import torch

    tokens = torch.as_tensor(ids, device=model.device).view(1, -1)
    # the LM head over a whole prompt chunk costs a tenth of the model's work (a quarter at Qwen's vocabulary)
    with attention_backends():
        out = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
    return out.logits[0].float()


def _prefill(model, ids: list[int], cache, feed: Feed, tick: Callable) -> object:
    """Feed ``ids`` in ``feed``'s chunks; the last position's logits ``[1, V]``."""
    import torch

    logits = None
    tokens = torch.as_tensor(ids, device=model.device)  # one copy: a copy a chunk would wait for the device each time
    for a, b in feed.chunks(0, len(ids)):
        logits = _forward(model, tokens[a:b], cache, last_only=True)
        tick()
    return logits


def _exact_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _method_cache(run: Run, model, scales, feed: Feed):
    """``run``'s fresh cache, with ``model``'s attention set for it."""
    import torch

    use_attention(model, feed.paged)
    return run.method.make_cache(
        sink=run.region == "sink",
        dtype=torch.float16,
        scales=scales,
        keep_decoded=not feed.paged,
        num_layers=model.config.num_hidden_layers,
        paged=feed.paged,
    )


def _amax_scales(cache) -> list[tuple[float, float]]:
    """Per layer (K amax / 448, V amax / 448) of an exact cache: the calibration of ``fp8_e4m3_amax``."""
    return [(float(layer.keys.abs().max()) / 448.0, float(layer.values.abs().max()) / 448.0) for layer in cache.layers]


def _eos_ids(model, tok) -> set[int]:
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tok.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


def _greedy_answer(model, tok, cache, logits, sample: tasks.Sample, eos: set[int], tick: Callable) -> list[int]:
    """Greedy tokens after the prompt until the answer is complete, an end-of-sequence token, or the budget."""
    out: list[int] = []
    for step in range(sample.max_new_tokens):
        nxt = int(logits[-1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
        tick()
        if tasks.answer_done(sample.task, tok.decode(out)) or step == sample.max_new_tokens - 1:
            break
        logits = _forward(model, [nxt], cache)
    return out


def _answer_record(tok, sample: tasks.Sample, tokens: list[int], seconds: float) -> dict:
    text = tok.decode(tokens)
    scored = tasks.score(sample.task, text, sample.answer)
    record = {"output": text, "tokens": tokens, **scored, "seconds": round(seconds, 3)}
    if sample.task == "vartrack":
        record["distractor"] = bool(tasks.variables(text) & set(sample.distractors))
    else:
        record["distractor"] = scored["pred"] in sample.distractors
    return record


def _sample_steps(sample: tasks.Sample, runs: list[Run], chunk: int | None) -> int:
    feeds = [feed_of(None, chunk), *(feed_of(r.method, chunk) for r in runs)]
    return sum(f.count(0, sample.prompt_tokens) for f in feeds) + (len(runs) + 1) * sample.max_new_tokens


def retrieval_sample(model, tok, sample: tasks.Sample, runs: list[Run], chunk: int | None, bar) -> dict:
    """The exact model and every run answering ``sample`` (prompt chunks of ``chunk`` tokens after the first tile,
    or one tile with None: :func:`feed_of`): one JSON-ready record."""
    import torch

    ids = tasks.encode(tok, sample)
    eos = _eos_ids(model, tok)
    record = {
        "length": sample.length,
        "index": sample.index,
        "depth": sample.depth,
        "needle_depths": [n.depth for n in sample.needles if n.role == "answer"],
        "prompt_tokens": sample.prompt_tokens,
        "answer": list(sample.answer),
        "distractors": list(sample.distractors),
        "runs": {},
    }
    ticks = _Ticks(bar)
    t_sample = time.perf_counter()

    with torch.inference_mode():
        t0 = time.perf_counter()
        bar.describe(f"{sample.task} {sample.length} #{sample.index}: exact")
        feed = feed_of(None, chunk)
        use_attention(model, False)
        cache = _exact_cache()
        logits = _prefill(model, ids, cache, feed, ticks.tick)
        scales = _amax_scales(cache)
        tokens = _greedy_answer(model, tok, cache, logits, sample, eos, ticks.tick)
        ticks.settle(feed.count(0, len(ids)) + sample.max_new_tokens)
        exact = record["exact"] = _answer_record(tok, sample, tokens, time.perf_counter() - t0)
        del cache
        for run in runs:
            t0 = time.perf_counter()
            bar.describe(f"{sample.task} {sample.length} #{sample.index}: {run.label}")
            feed = feed_of(run.method, chunk)
            cache = _method_cache(run, model, scales, feed)
            logits = _prefill(model, ids, cache, feed, ticks.tick)
            tokens = _greedy_answer(model, tok, cache, logits, sample, eos, ticks.tick)
            ticks.settle(feed.count(0, len(ids)) + sample.max_new_tokens)
            got = _answer_record(tok, sample, tokens, time.perf_counter() - t0)
            got["same_as_exact"] = got["pred"] == exact["pred"]
            got["same_tokens"] = tokens == exact["tokens"]
            record["runs"][run.label] = got
            del cache
        use_attention(model, False)
    record["seconds"] = round(time.perf_counter() - t_sample, 3)
    return record


def _fmt_minutes(seconds: float) -> str:
    return f"about {max(1, round(seconds / 60))} min" if seconds >= 60 else f"about {seconds:.0f} s"


def retrieval(
    model,
    tok,
    task: str,
    runs: list[Run],
    lengths: list[int],
    samples: int,
    seed: int = 0,
    filler: str | None = None,
    progress_factory: Callable | None = None,
    log: Callable[[str], None] = print,
    workers: Workers | None = None,
    records_log: RecordLog | None = None,
    chunk: int | None = None,
) -> dict:
    """Run ``task`` at every length over ``samples`` samples: per-sample records and a summary per run and length.

    ``workers``: answer the samples on these processes (``model`` is then unused and may be None).
    ``records_log``: append each finished sample there, and take the samples it already holds from it.
    ``chunk``: prompt chunk tokens after the first tile (:func:`feed_of`); None: one tile at a time.
    """
    if chunk is not None:
        check_chunk(chunk, [r.method for r in runs])
    built = [tasks.make_sample(task, tok, n, i, seed, filler) for n in lengths for i in range(samples)]
    records, todo, kept = taken_from_log(records_log, [(s.length, s.index) for s in built])
    where = f" on {workers.count} worker processes" if workers else ""
    log(
        f"{task}: {samples} sample(s) at each of {', '.join(map(str, lengths))} tokens, {len(runs) + 1} runs a sample "
        f"(the exact model and each method){where}{kept}; a time estimate follows the first sample"
    )
    bar = (progress_factory or PlainProgress)(total=sum(_sample_steps(built[i], runs, chunk) for i in todo))
    seconds: dict[int, float] = {}
    t_start = time.perf_counter()

    def finished(i: int, record: dict, took: float) -> None:
        sample = built[i]
        records[i] = record
        if records_log is not None:
            records_log.add((sample.length, sample.index), record)
        if sample.length not in seconds:
            seconds[sample.length] = took
            left = [s.length for j, s in enumerate(built) if records[j] is None]
            rest = sum(_sample_seconds(seconds, n) for n in left) / (workers.count if workers else 1)
            log(
                f"{task}: first sample at {sample.length} tokens took {took:.0f} s ({len(runs) + 1} runs); "
                f"remaining run time {_fmt_minutes(rest)} (extrapolated to longer contexts)"
            )

    try:
        if workers is None:
            for i in todo:
                t0 = time.perf_counter()
                record = retrieval_sample(model, tok, built[i], runs, chunk, bar)
                finished(i, record, time.perf_counter() - t0)
        elif todo:
            bar.describe(f"{task}: {len(todo)} samples")
            for j, record in workers.run(retrieval_sample, [(built[i], runs, chunk) for i in todo]):
                for _ in range(_sample_steps(built[todo[j]], runs, chunk)):
                    bar.tick()
                finished(todo[j], record, record["seconds"])
    finally:
        bar.close()
    config = workers.config if workers else model.config
    return {
        "task": task,
        "lengths": lengths,
        "samples": samples,
        "seed": seed,
        "filler": filler or tasks.DEFAULT_FILLER[task],
        "prefill_chunk": chunk,
        "runs": [_run_info(r, config) for r in runs],
        "records": records,
        "summary": summarize(records, runs, lengths),
        "seconds": time.perf_counter() - t_start,
    }


COST_EXPONENT = 1.3
"""A sample's time grows about as length ** 1.3 on a CPU (every chunk attends over all before it); used to
extrapolate until two lengths are measured, then the measured exponent is."""


def _sample_seconds(seconds: dict[int, float], length: int) -> float:
    """Expected seconds of one sample at ``length`` from the first sample's time at each measured length."""
    if length in seconds:
        return seconds[length]
    known = sorted(seconds)
    exponent = COST_EXPONENT
    if len(known) >= 2:
        a, b = known[-2], known[-1]
        exponent = math.log(seconds[b] / seconds[a]) / math.log(b / a) if seconds[a] > 0 else COST_EXPONENT
    ref = min(known, key=lambda n: (abs(math.log(n / length)), -n))
    return seconds[ref] * (length / ref) ** exponent


def _run_info(run: Run, cfg) -> dict:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "label": run.label,
        "method": run.method.name,
        "family": run.method.family,
        "region": run.region,
        "bits_per_element": run.method.bits_per_element(head_dim, cfg.num_hidden_layers),
    }


def paired_p_value(lost: int, gained: int) -> float:
    """Two-sided exact McNemar test of ``lost`` against ``gained`` samples: the chance of a split at least this uneven
    if each sample that only one of the two answered right were equally likely to fall either way (1.0 for none)."""
    n, k = lost + gained, min(lost, gained)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def summarize(records: list[dict], runs: list[Run], lengths: list[int]) -> list[dict]:
    """Per run (and the exact model) and length: accuracy, agreement with the exact answer, distractor answers.

    A run's entry also counts the samples only the exact model answered right (``lost``) and those only the run did
    (``gained``): the same samples answered twice, so these pairs, not two accuracies' difference, show what
    quantizing changed (their difference is the accuracy gap, in samples); ``p_value`` is
    :func:`paired_p_value` of the two.
    """
    out = []
    for label in ["exact", *(r.label for r in runs)]:
        for n in lengths:
            rows = [r["exact"] if label == "exact" else r["runs"][label] for r in records if r["length"] == n]
            if not rows:
                continue
            exact_rows = [r["exact"] for r in records if r["length"] == n]
            entry = {
                "label": label,
                "length": n,
                "n": len(rows),
                "accuracy": sum(r["correct"] for r in rows) / len(rows),
                "agreement": sum(a["pred"] == e["pred"] for a, e in zip(rows, exact_rows, strict=True)) / len(rows),
                "distractor": sum(r["distractor"] for r in rows) / len(rows),
            }
            if label != "exact":
                entry["lost"] = sum(e["correct"] and not a["correct"] for a, e in zip(rows, exact_rows, strict=True))
                entry["gained"] = sum(a["correct"] and not e["correct"] for a, e in zip(rows, exact_rows, strict=True))
                entry["p_value"] = paired_p_value(entry["lost"], entry["gained"])
            if "recall" in rows[0]:
                entry["recall"] = sum(r["recall"] for r in rows) / len(rows)
            out.append(entry)
    return out
