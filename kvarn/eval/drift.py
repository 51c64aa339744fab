"""Error accumulation along a free-running generation: ``kvarn report --task drift``.

From a prefix of the text, the exact model generates ``new_tokens`` tokens greedily (an end-of-sequence
token is never picked, and by default no 4-gram of the generation repeats: a small model's plain greedy
run falls into a loop within a hundred tokens, which would make every later position trivially
predictable). Each method is then teacher-forced on that text (prefix, then the generated tokens in
tile-aligned chunks): KL(exact || method) of the next-token distributions at every generated position,
averaged over windows of 64 positions, and top-1 agreement with the exact run's distributions. Each
method also decodes its own greedy run from the prefix (same rule) until its first token that differs
from the exact run's. The cache path and the runs are :mod:`kvarn.eval.longctx`'s.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable

from kvarn.eval.longctx import (
    DRIFT_POSITIONS,
    DRIFT_PREFIX,
    DRIFT_TOKENS,
    NO_REPEAT_NGRAM,
    WINDOW,
    Feed,
    PlainProgress,
    RecordLog,
    Run,
    _amax_scales,
    _eos_ids,
    _exact_cache,
    _fmt_minutes,
    _forward,
    _method_cache,
    _prefill,
    _run_info,
    _Ticks,
    check_chunk,
    feed_of,
    taken_from_log,
    use_attention,
)
from kvarn.eval.workers import Workers


def _kl_rows(ref_logprobs, logprobs):
    """``[n]`` KL(exact || method) of each position's next-token distribution."""
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1)


def _pick(logits, eos: set[int], banned: set[int]) -> int:
    """The greedy token, never an end-of-sequence token or a banned one."""
    row = logits.clone()
    for t in eos | banned:
        row[t] = float("-inf")
    return int(row.argmax())


class _NgramGuard:
    """The tokens that would complete an ``n``-gram already generated (none when ``n`` is 0)."""

    def __init__(self, n: int):
        self.n, self.tokens, self.seen = n, [], {}

    def push(self, token: int) -> None:
        self.tokens.append(token)
        if self.n > 0 and len(self.tokens) >= self.n:
            gram = tuple(self.tokens[-self.n :])
            self.seen.setdefault(gram[:-1], set()).add(gram[-1])

    def banned(self) -> set[int]:
        if self.n <= 0 or len(self.tokens) < self.n - 1:
            return set()
        return self.seen.get(tuple(self.tokens[len(self.tokens) - self.n + 1 :]), set())


def _free_run(model, cache, logits, n: int, eos: set[int], ngram: int, stop_at: list[int] | None, tick) -> list[int]:
    """Greedy decoding of up to ``n`` tokens from ``logits`` (the prefix's last row); with ``stop_at``, stop
    after the first token that differs from it."""
    guard, out = _NgramGuard(ngram), []
    row = logits[-1]
    for i in range(n):
        nxt = _pick(row, eos, guard.banned())
        out.append(nxt)
        guard.push(nxt)
        tick()
        if (stop_at is not None and nxt != stop_at[i]) or i == n - 1:
            break
        row = _forward(model, [nxt], cache)[-1]
    return out


def _teacher_forced(model, cache, logits, generated: list[int], feed: Feed, prefix: int, tick) -> object:
    """``[N, V]`` log-probabilities of each generated position: the prefix's last row, then the generated
    tokens fed in ``feed``'s chunks (positions counted from the start of the sequence)."""
    import torch

    rows = [torch.log_softmax(logits[-1:], -1)]
    tokens = torch.as_tensor(generated, device=model.device)  # one copy, not one a chunk (each waits for the device)
    for a, b in feed.chunks(prefix, prefix + len(generated) - 1):
        rows.append(torch.log_softmax(_forward(model, tokens[a - prefix : b - prefix], cache), -1))
        tick()
    return torch.cat(rows)


def drift_prefixes(tok, text: str, prefix: int, samples: int, seed: int) -> list[list[int]]:
    """``samples`` prefixes of ``prefix`` tokens, each from a seeded paragraph start of ``text``."""
    import random

    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2] not in ("", "\n")]
    rng = random.Random(f"drift/{seed}")
    out = []
    order = rng.sample(starts, len(starts))
    for start in order:
        ids = tok(text[start:]).input_ids
        if len(ids) >= prefix:
            out.append(ids[:prefix])
        if len(out) == samples:
            return out
    raise ValueError(
        f"the text has fewer than {samples} paragraph starts followed by {prefix} tokens; give a longer text or "
        "a shorter --prefix"
    )


def _drift_steps(prefix: int, new_tokens: int, feed: Feed) -> int:
    """Progress steps of one drift run: prefix chunks, generation or free run, teacher-forced chunks."""
    return feed.count(0, prefix) + new_tokens + feed.count(prefix, prefix + new_tokens - 1)


def drift_sample(
    model,
    tok,
    index: int,
    ids: list[int],
    runs: list[Run],
    new_tokens: int,
    ngram: int,
    chunk: int | None,
    bar,
    first_run: Callable[[float, float], None] | None = None,
) -> dict:
    """The exact model's generation from the prefix ``ids`` and every run along it: one JSON-ready record.

    ``chunk``: chunk tokens after the first tile (:func:`~kvarn.eval.longctx.feed_of`), None for one tile.
    ``first_run(exact seconds, first run's seconds)`` is called once the first run is done.
    """
    import torch

    eos = _eos_ids(model, tok)
    prefix = len(ids)
    ticks = _Ticks(bar)
    with torch.inference_mode():
        t0 = time.perf_counter()
        bar.describe(f"drift #{index}: exact, generating {new_tokens} tokens")
        feed = feed_of(None, chunk)
        use_attention(model, False)
        cache = _exact_cache()
        logits = _prefill(model, ids, cache, feed, ticks.tick)
        scales = _amax_scales(cache)
        forced = copy.deepcopy(cache)
        generated = _free_run(model, cache, logits, new_tokens, eos, ngram, None, ticks.tick)
        bar.describe(f"drift #{index}: exact, teacher-forced")
        ref = _teacher_forced(model, forced, logits, generated, feed, prefix, ticks.tick)
        ticks.settle(_drift_steps(prefix, new_tokens, feed))
        del cache, forced
        t_exact = time.perf_counter() - t0
        grams = [tuple(generated[i : i + 4]) for i in range(len(generated) - 3)]
        record = {
            "index": index,
            "prefix_ids": ids,
            "generated": generated,
            "generated_text": tok.decode(generated),
            "distinct_4grams": len(set(grams)) / max(len(grams), 1),
            "runs": {},
        }
        for run_index, run in enumerate(runs):
            r0 = time.perf_counter()
            feed = feed_of(run.method, chunk)
            bar.describe(f"drift #{index}: {run.label}, teacher-forced")
            cache = _method_cache(run, model, scales, feed)
            logits = _prefill(model, ids, cache, feed, ticks.tick)
            free = copy.deepcopy(cache)
            lp = _teacher_forced(model, cache, logits, generated, feed, prefix, ticks.tick)
            kl = _kl_rows(ref, lp)
            same = (lp.argmax(-1) == ref.argmax(-1)).float()
            del cache, lp
            bar.describe(f"drift #{index}: {run.label}, free run")
            own = _free_run(model, free, logits, new_tokens, eos, ngram, generated, ticks.tick)
            ticks.settle(_drift_steps(prefix, new_tokens, feed))
            del free
            diverged = len(own) - 1 if own[-1] != generated[len(own) - 1] else None
            record["runs"][run.label] = {
                "kl": kl.tolist(),
                "kl_windows": _windows(kl.tolist()),
                "kl_mean": float(kl.mean()),
                "top1": float(same.mean()),
                "top1_windows": _windows(same.tolist()),
                "first_divergence": diverged,
                "seconds": round(time.perf_counter() - r0, 3),
            }
            if run_index == 0 and first_run is not None:
                first_run(t_exact, time.perf_counter() - r0)
        use_attention(model, False)
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return record


def drift(
    model,
    tok,
    runs: list[Run],
    prefix: int = DRIFT_PREFIX,
    new_tokens: int = DRIFT_TOKENS,
    samples: int = 1,
    seed: int = 0,
    text: str | None = None,
    ngram: int = NO_REPEAT_NGRAM,
    progress_factory: Callable | None = None,
    log: Callable[[str], None] = print,
    workers: Workers | None = None,
    records_log: RecordLog | None = None,
    chunk: int | None = None,
) -> dict:
    """Teacher-forced KL along the exact model's own generation, and each run's first greedy divergence.

    ``workers``: run the prefixes on these processes (``model`` is then unused and may be None).
    ``records_log``: append each finished prefix there, and take the prefixes it already holds from it.
    ``chunk``: chunk tokens after the first tile (:func:`~kvarn.eval.longctx.feed_of`); None: one tile at a time.
    """
    if chunk is not None:
        check_chunk(chunk, [r.method for r in runs])
    from kvarn.eval.harness import bundled_text

    prefixes = drift_prefixes(tok, bundled_text() if text is None else text, prefix, samples, seed)
    per_prefix = _drift_steps(prefix, new_tokens, feed_of(None, chunk)) + sum(
        _drift_steps(prefix, new_tokens, feed_of(r.method, chunk)) for r in runs
    )
    records, todo, kept = taken_from_log(records_log, [(index,) for index in range(samples)])
    where = f" on {workers.count} worker processes" if workers else ""
    log(
        f"drift: {samples} prefix(es) of {prefix} tokens, {new_tokens} generated tokens, {len(runs) + 1} runs a "
        f"prefix (the exact model and each method){where}{kept}; a time estimate follows the first "
        + ("prefix" if workers else "method")
    )
    bar = (progress_factory or PlainProgress)(total=len(todo) * per_prefix)
    t_start = time.perf_counter()

    def finished(index: int, record: dict) -> None:
        records[index] = record
        if records_log is not None:
            records_log.add((index,), record)

    def first_run(t_exact: float, t_run: float) -> None:
        left = (len(runs) - 1) * t_run + (len(todo) - 1) * (t_exact + len(runs) * t_run)
        log(
            f"drift: the exact run took {t_exact:.0f} s, {runs[0].label} {t_run:.0f} s; remaining run "
            f"time at most {_fmt_minutes(left)} (a method's free run stops at its first divergence)"
        )

    try:
        if workers is None:
            for n, index in enumerate(todo):
                finished(
                    index,
                    drift_sample(
                        model,
                        tok,
                        index,
                        prefixes[index],
                        runs,
                        new_tokens,
                        ngram,
                        chunk,
                        bar,
                        first_run if n == 0 else None,
                    ),
                )
        elif todo:
            bar.describe(f"drift: {len(todo)} prefixes")
            jobs = [(index, prefixes[index], runs, new_tokens, ngram, chunk) for index in todo]
            for n, (j, record) in enumerate(workers.run(drift_sample, jobs)):
                finished(todo[j], record)
                for _ in range(per_prefix):
                    bar.tick()
                if n == 0:  # the other workers' first prefixes finish about now
                    rounds = math.ceil(len(todo) / workers.count) - 1
                    log(
                        f"drift: the first prefix took {record['seconds']:.0f} s; remaining run time at most "
                        f"{_fmt_minutes(rounds * record['seconds'])}"
                    )
    finally:
        bar.close()
    return {
        "task": "drift",
        "prefix": prefix,
        "new_tokens": new_tokens,
        "samples": samples,
        "seed": seed,
        "no_repeat_ngram": ngram,
        "prefill_chunk": chunk,
        "window": WINDOW,
        "runs": [_run_info(r, workers.config if workers else model.config) for r in runs],
        "records": records,
        "summary": summarize_drift(records, runs, new_tokens),
        "seconds": time.perf_counter() - t_start,
    }


def _windows(values: list[float]) -> list[float]:
    return [sum(values[i : i + WINDOW]) / len(values[i : i + WINDOW]) for i in range(0, len(values), WINDOW)]


def summarize_drift(records: list[dict], runs: list[Run], new_tokens: int) -> list[dict]:
    """Per run: KL per window (mean over samples), KL at :data:`DRIFT_POSITIONS`, top-1, first divergence."""
    out = []
    for run in runs:
        rows = [r["runs"][run.label] for r in records]
        windows = [sum(w) / len(w) for w in zip(*(r["kl_windows"] for r in rows), strict=True)]
        at = {p: windows[p // WINDOW - 1] if p <= new_tokens else None for p in DRIFT_POSITIONS}
        firsts = [new_tokens if r["first_divergence"] is None else r["first_divergence"] for r in rows]
        out.append(
            {
                "label": run.label,
                "kl_windows": windows,
                "kl_at": {str(p): v for p, v in at.items()},
                "kl_mean": sum(r["kl_mean"] for r in rows) / len(rows),
                "top1": sum(r["top1"] for r in rows) / len(rows),
                "top1_windows": [sum(w) / len(w) for w in zip(*(r["top1_windows"] for r in rows), strict=True)],
                "first_divergence": firsts,
                "first_divergence_median": statistics.median(firsts),
            }
        )
    return out
