"""Synthetic long-context tasks, generated locally from a seed: ``passkey``, ``niah``, ``vartrack``.

Each sample is one prompt of at most ``length`` tokens (prompt plus the answer's token budget)
made of filler text with facts ("needles") hidden at measured depths, a question at the end, and
the start of the answer ("answer prefix") after the model's chat template, so that a few greedy
tokens hold the answer:

- ``passkey``: a random 5-7 digit pass key hidden in neutral sentences at a stated depth, asked
  for at the end.
- ``niah``: several "secret number for <key>" needles in prose; one key is asked for, the other
  needles (different keys, different numbers) are distractors.
- ``vartrack``: a chain of assignments ``VAR ABCDE = 48213.``, ``VAR FGHIJ = VAR ABCDE.``, ...
  (several hops) and a distractor chain holding another value, in neutral sentences; the question
  asks for every variable holding the chain's value.

Filler is either ``"noise"`` (neutral sentences drawn with the sample's seed) or ``"prose"`` (the
bundled public-domain text, :func:`kvarn.eval.harness.bundled_text`, from a seeded sentence on,
wrapping around). The depth of a needle is where it starts, in tokens, as a fraction of the
filler-and-needles context (0 = its first token, 1 = its end), measured on the final prompt.

Samples are reproducible: sample ``i`` of a task at a length depends only on ``(task, seed,
length, i)``, and the asked needle's depth only on ``(seed, i)`` (a golden-ratio sequence, so the
first ``n`` samples spread over the context for any ``n`` and every length sees the same depths).

Scoring (:func:`score`) is exact match after normalisation: the first number in the output (digits
only, thousands separators dropped) for ``passkey`` and ``niah``; the set of variable names in the
output for ``vartrack``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
import re
from dataclasses import dataclass

TASKS = ("passkey", "niah", "vartrack")
FILLERS = ("noise", "prose")
DEFAULT_FILLER = {"passkey": "noise", "niah": "prose", "vartrack": "noise"}
MAX_NEW_TOKENS = {"passkey": 12, "niah": 12, "vartrack": 48}
"""Greedy tokens each task's answer may take (5-7 digits, a 7-digit number, a list of variables)."""
MIN_FILLER_TOKENS = 64
_GOLDEN = 0.6180339887498949

NEUTRAL_SENTENCES = (
    "The morning was quiet and the road was empty.",
    "A light wind moved through the tall grass.",
    "The river ran slowly past the old stone bridge.",
    "Clouds drifted over the hills without a sound.",
    "The shop on the corner opened at nine as usual.",
    "A few birds sat on the fence and then flew away.",
    "The kettle was put on and the table was set.",
    "Rain had fallen in the night and the streets were still wet.",
    "The train left the station a little after noon.",
    "Someone had left a book open on the bench in the park.",
    "The lamps along the harbour came on one by one.",
    "It was an ordinary day in a small and ordinary town.",
)
"""Neutral filler: no numbers, no names, nothing a question could be about."""

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lofty",
    "misty", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy", "urban", "vivid", "woolly", "young",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pillow", "quarry", "ribbon", "saddle", "tunnel", "valley", "walnut",
)  # fmt: skip
_VAR = re.compile(r"\b[A-Z]{5}\b")


@dataclass(frozen=True)
class Needle:
    """One fact hidden in the context: its sentence, where it starts in the prompt, its measured depth."""

    text: str
    value: str  # the string a question may ask for (the key's number, a variable's name)
    role: str  # "answer" or "distractor"
    start: int  # character offset of ``text`` in the prompt
    depth: float  # token position of its start in the context, as a fraction of the context


@dataclass(frozen=True)
class Sample:
    """One prompt of a task and what a correct answer is."""

    task: str
    length: int  # the context length it was built for: prompt_tokens + max_new_tokens <= length
    index: int
    seed: int
    filler: str
    prompt: str  # what the model reads: chat template applied, ending in the answer prefix
    prompt_tokens: int
    answer: tuple[str, ...]  # passkey / niah: (number,); vartrack: the variables holding the value
    distractors: tuple[str, ...]  # numbers or variables in the context that are not the answer
    depth: float  # requested depth of the asked needle (vartrack: of the chain's first assignment)
    needles: tuple[Needle, ...]
    max_new_tokens: int
    query: str  # the question asked
    context: tuple[int, int]  # character span of the filler-and-needles context

    def spans(self, value: str) -> list[tuple[int, int]]:
        """Character spans of ``value`` inside the needles of the prompt."""
        out = []
        for n in self.needles:
            at = n.text.find(value)
            while at >= 0:
                out.append((n.start + at, n.start + at + len(value)))
                at = n.text.find(value, at + 1)
        return out


def sample_depth(seed: int, index: int) -> float:
    """The asked needle's depth of sample ``index``: ``frac(u + index * 0.618...)`` with ``u`` from ``seed``."""
    u = random.Random(f"depth/{seed}").random()
    return (u + index * _GOLDEN) % 1.0


def _rng(task: str, seed: int, length: int, index: int) -> random.Random:
    return random.Random(f"{task}/{seed}/{length}/{index}")


def _prose_sentences() -> list[str]:
    from kvarn.eval.harness import bundled_text

    flat = " ".join(bundled_text().split())
    return [s for s in re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"'])\s+", flat) if s]


def _filler_units(kind: str, rng: random.Random, n: int) -> list[str]:
    if kind == "noise":
        return [rng.choice(NEUTRAL_SENTENCES) for _ in range(n)]
    if kind == "prose":
        sentences = _prose_sentences()
        start = rng.randrange(len(sentences))
        return [sentences[(start + i) % len(sentences)] for i in range(n)]
    raise ValueError(f"filler must be one of {FILLERS}, got {kind!r}")


def _apply_template(tok, body: str, answer_prefix: str) -> tuple[str, bool]:
    """The prompt text and whether the tokenizer should add its special tokens (no chat template)."""
    if getattr(tok, "chat_template", None):
        messages = [{"role": "user", "content": body}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + answer_prefix, False
    return f"{body}\n\n{answer_prefix}", True


def encode(tok, sample_or_prompt) -> list[int]:
    """Token ids of a sample's prompt (special tokens only where no chat template supplies them)."""
    prompt = sample_or_prompt.prompt if isinstance(sample_or_prompt, Sample) else sample_or_prompt
    special = not getattr(tok, "chat_template", None)
    return tok(prompt, add_special_tokens=special).input_ids


def _token_ends(tok, text: str, special: bool) -> list[int]:
    """The end character offset of every token of ``text`` (a fast tokenizer's offset mapping)."""
    enc = tok(text, add_special_tokens=special, return_offsets_mapping=True)
    return [e for _, e in enc["offset_mapping"]]


def _token_at(ends: list[int], char: int) -> int:
    """Index of the first token ending after character ``char``."""
    return bisect.bisect_right(ends, char)


@dataclass
class _Spec:
    """What a task puts around the filler: instruction, question, answer prefix and needle sentences."""

    instruction: str
    question: str
    answer_prefix: str
    needles: list[tuple[str, str, str, float]]  # (text, value, role, requested depth), in context order
    answer: tuple[str, ...]
    distractors: tuple[str, ...]
    depth: float


def _nearest(values: list[int], target: float) -> int:
    """Index of the first of ``values`` nearest ``target``."""
    return min(range(len(values)), key=lambda i: (abs(values[i] - target), i))


def _place(units: list[str], needles: list[tuple[str, str, str, float]], tok) -> list[str]:
    """``units`` with each needle (sorted by depth) inserted at the unit boundary where its first token lands
    nearest its depth in the filled context (filler and needles); where needles crowd, the first asked one
    keeps its place."""
    if not needles:
        return units
    assert all(a[3] <= b[3] for a, b in itertools.pairwise(needles)), "needles must come sorted by depth"
    joined = " ".join(units)
    starts, at = [], 0
    for u in units:
        starts.append(at)
        at += len(u) + 1
    starts.append(len(joined) + 1)
    ends = _token_ends(tok, joined, False)
    total = max(len(ends), 1)
    boundary_tokens = [_token_at(ends, s) for s in starts]
    sizes = [len(tok(" " + text, add_special_tokens=False).input_ids) for text, *_ in needles]
    final, before, chosen = total + sum(sizes), 0, []
    for (_, _, _, depth), size in zip(needles, sizes, strict=True):
        # filler tokens before the needle: its place in the filled context less the needles before it
        chosen.append(_nearest(boundary_tokens, depth * final - before))
        before += size
    # needles keep their order: the first asked one stays where it belongs, crowded neighbours give way
    pivot = next((j for j, n in enumerate(needles) if n[2] == "answer"), 0)
    for j in range(pivot + 1, len(needles)):
        chosen[j] = max(chosen[j], chosen[j - 1])
    for j in range(pivot - 1, -1, -1):
        chosen[j] = min(chosen[j], chosen[j + 1])
    out = list(units)
    for j in reversed(range(len(needles))):  # from the back, so earlier boundaries keep their index
        out.insert(chosen[j], needles[j][0])
    return out


def _largest_fit(count, budget: int, probe: int = 32) -> int:
    """The largest ``n`` with ``count(n) <= budget``; ``count`` (tokens of the prompt with ``n`` filler units)
    increases with ``n`` and ``count(0) <= budget``. A guess from the tokens per unit, then a bracket and bisection."""
    count = functools.cache(count)
    per_unit = max((count(probe) - count(0)) / probe, 1e-6)
    guess = max(int((budget - count(0)) / per_unit), 0)
    step = max(guess // 64, 1)
    if count(guess) <= budget:
        lo, hi = guess, guess + step
        while count(hi) <= budget:
            lo, hi = hi, hi + 2 * (hi - lo)
    else:
        lo, hi = max(guess - step, 0), guess
        while lo > 0 and count(lo) > budget:
            lo, hi = max(lo - 2 * (hi - lo), 0), lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _build(tok, task: str, length: int, index: int, seed: int, filler: str, spec: _Spec, rng: random.Random):
    max_new = MAX_NEW_TOKENS[task]
    budget = length - max_new
    head = f"{spec.instruction}\n\n"
    tail = f"\n\n{spec.question}"

    filler_seed = rng.random()

    def assemble(n_units: int):
        units = _place(_filler_units(filler, random.Random(filler_seed), n_units), spec.needles, tok)
        context = " ".join(units)
        prompt, special = _apply_template(tok, head + context + tail, spec.answer_prefix)
        return prompt, special, context

    bare, _, _ = assemble(0)
    if len(encode(tok, bare)) + MIN_FILLER_TOKENS > budget:
        raise ValueError(
            f"{task}: a {length}-token context leaves no room for filler after the instruction, the needles, the "
            f"question and {max_new} answer tokens ({len(encode(tok, bare))} tokens); use a longer length"
        )
    n_units = _largest_fit(lambda n: len(encode(tok, assemble(n)[0])), budget)
    prompt, special, context = assemble(n_units)
    c0 = prompt.index(head) + len(head)
    c1 = c0 + len(context)
    ends = _token_ends(tok, prompt, special)
    t0, t1 = _token_at(ends, c0), _token_at(ends, c1 - 1) + 1
    needles, search = [], c0
    for text, value, role, _ in spec.needles:
        start = prompt.index(text, search)
        search = start + len(text)
        depth = (_token_at(ends, start) - t0) / max(t1 - t0, 1)
        needles.append(Needle(text, value, role, start, depth))
    return Sample(
        task=task,
        length=length,
        index=index,
        seed=seed,
        filler=filler,
        prompt=prompt,
        prompt_tokens=len(encode(tok, prompt)),
        answer=spec.answer,
        distractors=spec.distractors,
        depth=spec.depth,
        needles=tuple(needles),
        max_new_tokens=max_new,
        query=spec.question,
        context=(c0, c1),
    )


def _numbers(rng: random.Random, n: int, lo_digits: int, hi_digits: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        digits = rng.randint(lo_digits, hi_digits)
        x = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if x not in out:
            out.append(x)
    return out


def passkey(tok, length: int, index: int = 0, seed: int = 0, filler: str | None = None) -> Sample:
    """A 5-7 digit pass key hidden in filler at :func:`sample_depth`, asked for at the end."""
    rng = _rng("passkey", seed, length, index)
    depth = sample_depth(seed, index)
    key = _numbers(rng, 1, 5, 7)[0]
    spec = _Spec(
        instruction="A pass key is hidden somewhere in the long text below, among many unimportant sentences. "
        "Find it and remember it: you will be asked for it at the end.",
        question="What is the pass key? Answer with the number only.",
        answer_prefix="The pass key is",
        needles=[(f"The pass key is {key}. Remember it: the pass key is {key}.", key, "answer", depth)],
        answer=(key,),
        distractors=(),
        depth=depth,
    )
    return _build(tok, "passkey", length, index, seed, filler or DEFAULT_FILLER["passkey"], spec, rng)


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def niah(tok, length: int, index: int = 0, seed: int = 0, filler: str | None = None, num_needles: int = 4) -> Sample:
    """``num_needles`` "secret number for <key>" needles in filler; the one asked for sits at :func:`sample_depth`,
    the others (distractors: other keys, other 7-digit numbers) at random depths."""
    if num_needles < 1:
        raise ValueError(f"num_needles must be at least 1, got {num_needles}")
    rng = _rng("niah", seed, length, index)
    depth = sample_depth(seed, index)
    keys, values = _keys(rng, num_needles), _numbers(rng, num_needles, 7, 7)
    depths = [depth] + [rng.random() for _ in range(num_needles - 1)]
    needles = [
        (f"The secret number for {k} is {v}.", v, "answer" if i == 0 else "distractor", d)
        for i, (k, v, d) in enumerate(zip(keys, values, depths, strict=True))
    ]
    needles.sort(key=lambda n: n[3])
    spec = _Spec(
        instruction="Some secret numbers are hidden in the long text below, each for a different key. "
        "Remember them: you will be asked for one of them at the end.",
        question=f"What is the secret number for {keys[0]}? Answer with the number only.",
        answer_prefix=f"The secret number for {keys[0]} is",
        needles=needles,
        answer=(values[0],),
        distractors=tuple(values[1:]),
        depth=depth,
    )
    return _build(tok, "niah", length, index, seed, filler or DEFAULT_FILLER["niah"], spec, rng)


def _variables(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in out:
            out.append(name)
    return out


def vartrack(
    tok, length: int, index: int = 0, seed: int = 0, filler: str | None = None, hops: int = 4, chains: int = 2
) -> Sample:
    """``chains`` assignment chains of ``hops`` hops (``hops + 1`` variables each) in filler; the question asks
    for every variable holding the first chain's value. The first chain starts at :func:`sample_depth` (its
    later hops at random depths after it), the other chains (distractors, other values) at random depths."""
    if hops < 1 or chains < 1:
        raise ValueError(f"vartrack needs hops >= 1 and chains >= 1, got hops={hops}, chains={chains}")
    rng = _rng("vartrack", seed, length, index)
    depth = sample_depth(seed, index)
    names = _variables(rng, chains * (hops + 1))
    values = _numbers(rng, chains, 5, 5)
    needles = []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        start = depth if c == 0 else rng.random()
        depths = sorted([start] + [start + (1 - start) * rng.random() for _ in range(hops)])
        role = "answer" if c == 0 else "distractor"
        needles.append((f"VAR {chain[0]} = {values[c]}.", chain[0], role, depths[0]))
        for h in range(1, hops + 1):
            needles.append((f"VAR {chain[h]} = VAR {chain[h - 1]}.", chain[h], role, depths[h]))
    needles.sort(key=lambda n: n[3])  # stable: a chain's hops keep their order at equal depths
    answer = tuple(names[: hops + 1])
    spec = _Spec(
        instruction="The long text below hides a few variable assignments among unimportant sentences. Follow "
        "them: you will be asked which variables end up holding a value.",
        question=f"Which variables hold the value {values[0]}? List every one of them.",
        answer_prefix=f"The variables that hold the value {values[0]} are:",
        needles=needles,
        answer=answer,
        distractors=tuple(names[hops + 1 :]),
        depth=depth,
    )
    return _build(tok, "vartrack", length, index, seed, filler or DEFAULT_FILLER["vartrack"], spec, rng)


GENERATORS = {"passkey": passkey, "niah": niah, "vartrack": vartrack}


def make_sample(task: str, tok, length: int, index: int, seed: int = 0, filler: str | None = None) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return GENERATORS[task](tok, length, index, seed, filler)


def first_number(text: str) -> str:
    """The first number in ``text`` as its digits (``" 1,234,567." -> "1234567"``), or ``""``."""
    m = re.search(r"\d(?:[\d,]*\d)?", text.strip())
    return "" if m is None else m.group(0).replace(",", "")


def variables(text: str) -> frozenset[str]:
    """The variable names (five capital letters) in ``text``."""
    return frozenset(_VAR.findall(text))


def normalize(task: str, text: str):
    """What :func:`score` compares: the first number (passkey, niah) or the set of variables (vartrack)."""
    if task in ("passkey", "niah"):
        return first_number(text)
    if task == "vartrack":
        return variables(text)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def score(task: str, output: str, answer: tuple[str, ...] | list[str]) -> dict:
    """Exact match of a generated ``output`` against ``answer``.

    Returns ``{"pred", "correct"}`` and, for ``vartrack``, ``"recall"`` (fraction of the answer's
    variables named). ``pred`` is the normalised output (a string; vartrack's sorted, comma-joined).
    """
    pred = normalize(task, output)
    if task == "vartrack":
        gold = frozenset(answer)
        return {"pred": ",".join(sorted(pred)), "correct": pred == gold, "recall": len(pred & gold) / len(gold)}
    return {"pred": pred, "correct": pred == answer[0]}


def answer_done(task: str, text: str) -> bool:
    """Whether greedy decoding can stop: the answer is complete in ``text`` (generated so far)."""
    if task in ("passkey", "niah"):
        m = re.search(r"\d[\d,]*", text)
        return m is not None and m.end() < len(text) and not text[m.end()].isdigit()
    # a list that ended: "ABCDE, FGHIJ." or a numbered list followed by a blank line
    return bool(re.search(r"\b[A-Z]{5}\.\s*$", text)) or (bool(variables(text)) and "\n\n" in text.lstrip())
