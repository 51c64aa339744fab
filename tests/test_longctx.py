"""Long-context tasks (kvarn.eval.tasks) and their runner (kvarn.eval.longctx): generators, scorer, CLI."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from kvarn.eval import tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """The tiny model's byte-level tokenizer (one token per byte, no chat template)."""
    pytest.importorskip("transformers")
    from tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture(scope="module")
def bpe_tok():
    """A byte-level BPE trained on the bundled text (merges words, one token per digit, as Llama and Qwen
    tokenizers do) with a chat template."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvarn.eval.harness import bundled_text

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([bundled_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _token_index(tok, sample: tasks.Sample, char: int) -> int:
    """Token index holding character ``char`` of the prompt, found independently of the generator."""
    special = not getattr(tok, "chat_template", None)
    enc = tok(sample.prompt, add_special_tokens=special, return_offsets_mapping=True)
    for i, (a, b) in enumerate(enc["offset_mapping"]):
        if a <= char < b:
            return i
    raise AssertionError(f"no token covers character {char}")


@pytest.mark.hf
@pytest.mark.parametrize("task", tasks.TASKS)
def test_samples_are_seeded(bpe_tok, task):
    a = tasks.make_sample(task, bpe_tok, 1024, 3, seed=7)
    assert tasks.make_sample(task, bpe_tok, 1024, 3, seed=7) == a
    other_seed = tasks.make_sample(task, bpe_tok, 1024, 3, seed=8)
    other_index = tasks.make_sample(task, bpe_tok, 1024, 4, seed=7)
    assert other_seed.prompt != a.prompt and other_seed.answer != a.answer
    assert other_index.prompt != a.prompt and other_index.depth != a.depth
    # the asked needle's depth depends on (seed, index) only: the same at every length
    assert tasks.make_sample(task, bpe_tok, 1536, 3, seed=7).depth == a.depth == tasks.sample_depth(7, 3)


def test_depths_spread_over_the_context():
    for n in (4, 8, 20):
        depths = sorted(tasks.sample_depth(0, i) for i in range(n))
        gaps = [b - a for a, b in zip([0.0, *depths], [*depths, 1.0], strict=True)]
        assert max(gaps) < 2.5 / n, (n, depths)
    assert tasks.sample_depth(0, 5) != tasks.sample_depth(1, 5)


@pytest.mark.hf
@pytest.mark.parametrize("task", tasks.TASKS)
@pytest.mark.parametrize("length", [768, 2048])
def test_needles_sit_at_their_depth_by_token_position(bpe_tok, task, length):
    from kvarn.eval.tasks import NEUTRAL_SENTENCES, _prose_sentences

    units = _prose_sentences() if tasks.DEFAULT_FILLER[task] == "prose" else NEUTRAL_SENTENCES
    unit = max(len(bpe_tok(" " + u).input_ids) for u in units)  # the filler's step
    for index in range(4):
        s = tasks.make_sample(task, bpe_tok, length, index)
        assert s.prompt_tokens == len(tasks.encode(bpe_tok, s))
        assert length - s.max_new_tokens - unit <= s.prompt_tokens <= length - s.max_new_tokens  # filled, fits
        c0, c1 = s.context
        t0, t1 = _token_index(bpe_tok, s, c0), _token_index(bpe_tok, s, c1 - 1) + 1
        for needle in s.needles:
            assert s.prompt[needle.start : needle.start + len(needle.text)] == needle.text
            measured = (_token_index(bpe_tok, s, needle.start) - t0) / (t1 - t0)
            assert measured == pytest.approx(needle.depth, abs=1e-9)
        at = next(i for i, n in enumerate(s.needles) if n.role == "answer")
        # the asked needle (vartrack: its chain's first assignment) at the filler boundary nearest the stated
        # depth: off by at most half a filler sentence (and a token a needle for tokenization at the joins),
        # unless the needles before (after) it do not fit between the start (end) and that depth
        before = sum(len(bpe_tok(" " + n.text).input_ids) for n in s.needles[:at])
        after = sum(len(bpe_tok(" " + n.text).input_ids) for n in s.needles[at + 1 :])
        crowded = max(0.0, s.depth * (t1 - t0) + after - (t1 - t0), before - s.depth * (t1 - t0))
        off = abs(s.needles[at].depth - s.depth) * (t1 - t0)
        assert off <= unit / 2 + len(s.needles) + crowded, (index, s.depth)
        assert 0 <= c0 < c1 < s.prompt.index(s.query)


@pytest.mark.hf
@pytest.mark.parametrize("which", ["bpe_tok", "byte_tok"])
@pytest.mark.parametrize("task", tasks.TASKS)
def test_the_answer_round_trips_through_the_tokenizer(request, which, task):
    tok = request.getfixturevalue(which)
    for index in range(3):
        s = tasks.make_sample(task, tok, 1024, index)
        special = not getattr(tok, "chat_template", None)
        enc = tok(s.prompt, add_special_tokens=special, return_offsets_mapping=True)
        for value in s.answer:
            spans = s.spans(value)
            assert spans, value
            for a, b in spans:  # the tokens covering the span decode to it (a merged leading space aside)
                covering = [i for i, (x, y) in enumerate(enc["offset_mapping"]) if x < b and y > a]
                decoded = tok.decode([enc["input_ids"][i] for i in covering])
                assert decoded.lstrip() == value and enc["offset_mapping"][covering[-1]][1] == b


@pytest.mark.hf
def test_passkey_and_niah_answers_appear_only_in_their_needles(bpe_tok):
    for index in range(4):
        s = tasks.passkey(bpe_tok, 1024, index)
        (key,) = s.answer
        assert 5 <= len(key) <= 7 and key.isdigit()
        assert s.prompt.count(key) == 2 == len(s.spans(key))  # said twice in its one needle, nowhere else
        n = tasks.niah(bpe_tok, 1024, index, num_needles=4)
        (value,) = n.answer
        assert len(n.distractors) == 3 and value not in n.distractors and len(set(n.distractors)) == 3
        assert n.prompt.count(value) == 1
        keys = [re.match(r"The secret number for (\S+) is", x.text).group(1) for x in n.needles]
        asked = re.search(r"secret number for (\S+)\?", n.query).group(1)
        assert len(set(keys)) == 4 and keys.count(asked) == 1
        assert next(x for x in n.needles if x.role == "answer").value == value
        assert n.prompt.endswith(f"The secret number for {asked} is")


@pytest.mark.hf
def test_vartrack_answer_is_what_the_assignments_say(bpe_tok):
    """Resolve every assignment in the prompt, in order: the variables holding the asked value are the answer."""
    for index in range(4):
        s = tasks.vartrack(bpe_tok, 1024, index, hops=3, chains=3)
        values: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", s.prompt):
            values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
        asked = re.search(r"hold the value (\d+)\?", s.query).group(1)
        assert len(values) == 12 and len(s.answer) == 4 and len(s.distractors) == 8
        assert {v for v, x in values.items() if x == asked} == set(s.answer)
        assert not set(s.answer) & set(s.distractors)
        assert {x for v, x in values.items() if v in s.distractors}.isdisjoint({asked})


@pytest.mark.hf
def test_chat_template_where_the_tokenizer_has_one(bpe_tok, byte_tok):
    chat = tasks.passkey(bpe_tok, 1024, 0)
    assert chat.prompt.startswith("<|im_start|>user\n") and chat.prompt.endswith(
        "<|im_start|>assistant\nThe pass key is"
    )
    assert tasks.encode(bpe_tok, chat)[0] == bpe_tok.convert_tokens_to_ids("<|im_start|>")
    plain = tasks.passkey(byte_tok, 1024, 0)
    assert "<|im_start|>" not in plain.prompt and plain.prompt.endswith("\n\nThe pass key is")
    asked = []

    class Spy:  # the tokenizer's own special tokens (BOS) only where no chat template supplies them
        chat_template = None

        def __call__(self, text, add_special_tokens):
            asked.append(add_special_tokens)
            return byte_tok(text, add_special_tokens=add_special_tokens)

    tasks.encode(Spy(), plain)
    tasks.encode(bpe_tok, chat)
    assert asked == [True]


@pytest.mark.hf
def test_a_length_too_short_for_the_task_says_so(bpe_tok):
    with pytest.raises(ValueError, match=r"a 200-token context leaves no room for filler.*use a longer length"):
        tasks.niah(bpe_tok, 200, 0)


@pytest.mark.parametrize(
    ("output", "pred", "correct"),
    [
        (" 4817263.", "4817263", True),
        ("4,817,263 is the number", "4817263", True),
        ("\n  4817263\nDone", "4817263", True),
        (" 48172634.", "48172634", False),  # one digit more
        (" 481726.", "481726", False),
        ("12, then 4817263", "12", False),  # the first number counts
        (" not given.", "", False),
        ("", "", False),
    ],
)
def test_number_scoring(output, pred, correct):
    for task in ("passkey", "niah"):
        assert tasks.score(task, output, ("4817263",)) == {"pred": pred, "correct": correct}


def test_vartrack_scoring_is_a_set_match():
    gold = ("ABCDE", "FGHIJ", "KLMNO")
    assert tasks.score("vartrack", " KLMNO, ABCDE and FGHIJ.", gold) == {
        "pred": "ABCDE,FGHIJ,KLMNO",
        "correct": True,
        "recall": 1.0,
    }
    assert tasks.score("vartrack", "ABCDE, ABCDE, FGHIJ, KLMNO", gold)["correct"]  # repeats do not matter
    missing = tasks.score("vartrack", "ABCDE, FGHIJ", gold)
    assert not missing["correct"] and missing["recall"] == pytest.approx(2 / 3)
    extra = tasks.score("vartrack", "ABCDE, FGHIJ, KLMNO, PQRST", gold)
    assert not extra["correct"] and extra["recall"] == 1.0
    assert tasks.score("vartrack", "abcde, fghij, klmno", gold) == {"pred": "", "correct": False, "recall": 0.0}
    assert not tasks.score("vartrack", "ABCDEF, FGHIJ, KLMNO", gold)["correct"]  # six letters is no variable


def test_answer_done():
    assert not tasks.answer_done("passkey", " 48172")
    assert tasks.answer_done("passkey", " 4817263.")
    assert not tasks.answer_done("niah", " The number")
    assert tasks.answer_done("vartrack", " ABCDE, FGHIJ.")
    assert not tasks.answer_done("vartrack", " ABCDE, FGHIJ")
    assert not tasks.answer_done("vartrack", "\n1.")  # a numbered list has begun
    assert not tasks.answer_done("vartrack", "\n1. ABCDE\n2.")
    assert tasks.answer_done("vartrack", "\n1. ABCDE\n2. FGHIJ\n\n")
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.normalize("kl", "x")


def test_ngram_guard_blocks_only_repeats():
    from kvarn.eval.drift import _NgramGuard

    g = _NgramGuard(3)
    for t in (1, 2, 3, 1):
        g.push(t)
    assert g.banned() == set()
    g.push(2)
    assert g.banned() == {3}  # "1 2 3" happened: after "1 2" the 3 would repeat it
    off = _NgramGuard(0)
    for t in (1, 1, 1, 1):
        off.push(t)
    assert off.banned() == set()


def test_time_estimate_extrapolates_by_length():
    from kvarn.eval.longctx import COST_EXPONENT, _sample_seconds

    assert _sample_seconds({1024: 100.0}, 1024) == 100.0
    assert _sample_seconds({1024: 100.0}, 4096) == pytest.approx(100.0 * 4**COST_EXPONENT)
    assert _sample_seconds({1024: 100.0, 2048: 300.0}, 8192) == pytest.approx(300.0 * 9)  # measured: 3x a doubling
    assert _sample_seconds({1024: 100.0, 2048: 300.0}, 1536) == pytest.approx(300.0 * 0.75 ** math.log2(3))


@pytest.mark.parametrize(
    ("lost", "gained", "p"),
    [
        (0, 0, 1.0),
        (1, 0, 1.0),
        (4, 1, 0.375),  # 2 * (1 + 5) / 32
        (1, 4, 0.375),
        (5, 0, 0.0625),
        (10, 0, 2 / 1024),
        (7, 7, 1.0),
        (12, 2, 2 * (1 + 14 + 91) / 2**14),
    ],
)
def test_paired_p_value_is_the_exact_two_sided_mcnemar_test(lost, gained, p):
    from kvarn.eval.longctx import paired_p_value

    assert paired_p_value(lost, gained) == pytest.approx(p, rel=1e-12)


def test_summary_pairs_each_run_with_the_exact_model():
    from kvarn.eval.longctx import paired_p_value, plan_runs, summarize
    from kvarn.eval.longctx_report import retrieval_table

    (run,) = plan_runs(["kivi_k4v2_g128"], ["tail"])

    def answer(pred: str) -> dict:
        return {"pred": pred, "correct": pred == "1", "distractor": pred == "2"}

    # exact / run per sample: right / wrong (lost), wrong / right (gained), both right, both wrong with other answers
    pairs = [("1", "2"), ("3", "1"), ("1", "1"), ("3", "4"), ("1", "5")]
    records = [
        {"length": 512, "index": i, "exact": answer(e), "runs": {run.label: answer(r)}}
        for i, (e, r) in enumerate(pairs)
    ]
    exact, got = summarize(records, [run], [512])
    assert exact == {"label": "exact", "length": 512, "n": 5, "accuracy": 0.6, "agreement": 1.0, "distractor": 0.0}
    assert (got["accuracy"], got["agreement"], got["distractor"]) == (0.4, 0.2, 0.2)
    assert (got["lost"], got["gained"]) == (2, 1)  # accuracy gap 0.6 - 0.4 = (2 - 1) of 5 samples
    assert got["p_value"] == 1.0  # 2 against 1 is as even as 3 samples split
    info = {"label": run.label, "method": "kivi_k4v2_g128", "family": "f", "region": "tail", "bits_per_element": 3.5}
    table = retrieval_table({"lengths": [512], "summary": [exact, got], "runs": [info]})
    assert "| 60% |" in table and "| 40% (20%; -2 +1, p=1.00) |" in table
    assert "recall" not in table
    lopsided = {**got, "lost": 12, "gained": 2, "p_value": paired_p_value(12, 2)}
    assert "-12 +2, p=0.01)" in retrieval_table({"lengths": [512], "summary": [exact, lopsided], "runs": [info]})
    lopsided = {**got, "lost": 8, "gained": 0, "p_value": paired_p_value(8, 0)}
    assert "-8 +0, p<0.01)" in retrieval_table({"lengths": [512], "summary": [exact, lopsided], "runs": [info]})
    with_recall = [{**exact, "recall": 0.8}, {**got, "recall": 0.55}]
    table = retrieval_table({"lengths": [512], "summary": with_recall, "runs": [info]})
    assert "| exact | - | 80% |" in table and "| kivi_k4v2_g128 | tail | 55% |" in table


def test_runs_lossless_methods_once():
    from kvarn.eval.longctx import default_methods, plan_runs

    methods = default_methods()
    assert methods[methods.index("kvarn_k4v2_g128") + 1] == "kvarn_k4v2_g128_ks"
    assert methods[methods.index("kvarn_k2v2_g128") + 1] == "kvarn_k2v2_g128_ks"
    labels = [r.label for r in plan_runs(["fp16", "fp8_e4m3", "kvarn_k4v2_g128"], ["tail", "sink"])]
    assert labels == [
        "fp16 [tail]",
        "fp8_e4m3 [tail]",
        "fp8_e4m3 [sink+tail]",
        "kvarn_k4v2_g128 [tail]",
        "kvarn_k4v2_g128 [sink+tail]",
    ]


def test_a_longer_prompt_chunk_feeds_the_first_tile_alone():
    from kvarn.eval.longctx import Feed, feed_of
    from kvarn.eval.methods import get_method

    assert list(Feed(128).chunks(0, 300)) == [(0, 128), (128, 256), (256, 300)]
    assert list(Feed(128, 512).chunks(0, 1000)) == [(0, 128), (128, 640), (640, 1000)]
    assert list(Feed(64, 256).chunks(0, 300)) == [(0, 64), (64, 300)]
    assert list(Feed(128, 512).chunks(1000, 1500)) == [(1000, 1408), (1408, 1500)]  # back on a tile boundary
    assert Feed(128, 512).count(0, 1000) == 3
    assert feed_of(None, 512) == Feed(128, 512)  # the exact model: any chunk, its cache is exact
    assert feed_of(get_method("kvarn_k4v2_g64"), 512) == Feed(64, 512, paged=True)
    assert feed_of(get_method("fp8_e4m3"), 512) == Feed(128)  # reads its history back whole: one tile a chunk
    assert feed_of(get_method("kvarn_k4v2_g128"), None) == Feed(128)


@pytest.mark.hf
@pytest.mark.parametrize("method", ["kvarn_k2v2_g128", "kivi_k4v2_g128", "kvarn_k4v2_g64_ks"])
@pytest.mark.parametrize("region", ["tail", "sink"])
def test_a_longer_prompt_chunk_attends_as_one_tile_at_a_time(method, region, tmp_path):
    """Multi-tile chunks through the paged attention give what one-tile chunks give (the paged path's, up to the order
    of the arithmetic; the SDPA path's, up to the paged path's fp16 attention); a prompt chunk that saw its earlier
    tiles exactly would not."""
    import torch
    from tiny_model import build_tiny_model
    from transformers import AutoModelForCausalLM

    from kvarn.eval.drift import _teacher_forced
    from kvarn.eval.longctx import Feed, Run, _method_cache, _prefill, use_attention
    from kvarn.eval.methods import get_method
    from kvarn.integration.hf import KVarNCache

    model = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "tiny"), dtype=torch.float32, attn_implementation="sdpa"
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (700,), generator=gen).tolist()
    after = torch.randint(0, 250, (200,), generator=gen).tolist()
    run = Run(get_method(method), region)
    g = run.method.group_size

    def logprobs(feed: Feed):
        with torch.inference_mode():
            cache = _method_cache(run, model, None, feed)
            last = _prefill(model, ids, cache, feed, lambda: None)
            return _teacher_forced(model, cache, last, after, feed, len(ids), lambda: None)

    one_tile = logprobs(Feed(g, g, paged=True))
    chunked = max((logprobs(Feed(g, n * g, paged=True)) - one_tile).abs().max() for n in (3, 4))
    use_attention(model, False)
    assert model.config._attn_implementation == "sdpa"
    sdpa = (logprobs(Feed(g)) - one_tile).abs().max()
    with torch.inference_mode():  # the whole prompt in one exact chunk: its own tiles seen exactly
        cache = KVarNCache(run.method.config, sink=region == "sink", dtype=torch.float16)
        last = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1:]
        wrong = (_teacher_forced(model, cache, last, after, Feed(g), len(ids), lambda: None) - one_tile).abs().max()
    assert chunked < 1e-3 and sdpa < 0.03 and wrong > 0.2, (float(chunked), float(sdpa), float(wrong))


def _report(argv, tmp_path, monkeypatch, capsys):
    """``kvarn report ARGS`` through the CLI entry; exit status and captured output."""
    from kvarn import cli

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    try:
        rc = cli.main(["report", *argv, "--out", str(tmp_path / "r"), "--quiet"])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "haystack"], "invalid choice: 'haystack'"),
        (["--task", "niah", "--lengths", "1k"], "--lengths takes comma-separated token counts"),
        (["--task", "niah", "--lengths", "128"], "every length must be at least 256 tokens"),
        (["--task", "niah", "--lengths", "1024,1024"], "lists a length twice"),
        (["--task", "niah", "--lengths", "16384"], "16384 tokens exceed smollm2-135m's context length of 8192"),
        (["--task", "passkey", "--samples", "0"], "--samples must be at least 1"),
        (["--task", "niah", "--prefix", "256"], "--prefix applies to --task drift"),
        (["--task", "vartrack", "--new-tokens", "64"], "--new-tokens applies to --task drift"),
        (["--task", "drift", "--lengths", "1024"], "--lengths applies to the retrieval tasks"),
        (["--task", "drift", "--filler", "prose"], "--filler applies to the retrieval tasks"),
        (["--task", "drift", "--prefix", "100"], "--prefix must be a positive multiple of 128"),
        (["--task", "drift", "--new-tokens", "10"], "--new-tokens must be at least 64"),
        (["--task", "drift", "--no-repeat-ngram", "1"], "--no-repeat-ngram must be 0 (off) or at least 2"),
        (["--task", "drift", "--prefix", "8192"], "exceed smollm2-135m's context length"),
        (["--task", "niah", "--methods", "kvarn_k3v3_g128"], "unknown method 'kvarn_k3v3_g128'"),
        (["--task", "niah", "--regions", "middle"], "--regions takes 'tail' and/or 'sink'"),
        (["--task", "niah", "--filler", "essays"], "invalid choice: 'essays'"),
        (["--task", "niah", "--model", "llama-70b"], "unknown model 'llama-70b'"),
        (["--samples", "3"], "unrecognized arguments: --samples 3"),  # kl: the long-context options do not apply
        (["--task", "kl", "--regions", "middle"], "--regions takes 'tail' and/or 'sink', got 'middle'"),
        (["--task", "niah", "--workers", "0"], "--workers must be at least 1"),
        (["--task", "niah", "--prefill-chunk", "100"], "--prefill-chunk: the prompt chunk must be a positive multiple"),
        (["--task", "drift", "--prefill-chunk", "0"], "--prefill-chunk: the prompt chunk must be a positive multiple"),
    ],
)
def test_misuse_exits_2_before_a_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    from kvarn.eval import models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_loading)
    monkeypatch.setattr(models, "model_dir", no_loading)
    rc, out = _report(argv, tmp_path, monkeypatch, capsys)
    assert rc == 2
    assert "usage: kvarn report" in out.err and message in out.err
    assert not (tmp_path / "r").exists()


def test_method_lists():
    from kvarn.eval.longctx_report import _parse
    from kvarn.eval.methods import ALL_BASELINES, DEFAULT_METHODS

    default = _parse(["--task", "niah"])
    assert default.method_list[:4] == ["fp16", "fp8_e4m3", "fp8_e4m3_amax", "kvarn_k4v2_g128"]
    assert set(default.method_list) == {*DEFAULT_METHODS, "kvarn_k4v2_g128_ks", "kvarn_k2v2_g128_ks"}
    assert default.region_list == ["tail", "sink"]
    every = _parse(["--task", "drift", "--methods", "all"]).method_list
    assert set(ALL_BASELINES) < set(every) and "kvarn_k4v4_g64_ks" in every
    assert _parse(["--task", "niah", "--methods", "fp16, kivi_k4v2_g128"]).method_list == ["fp16", "kivi_k4v2_g128"]


def _table(stdout: str, first_header: str) -> list[list[str]]:
    """The markdown table printed after ``first_header``: rows of cells (separator row dropped)."""
    lines = stdout[stdout.index(f"| {first_header} |") :].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.mark.hf
@pytest.mark.parametrize("task", tasks.TASKS)
def test_retrieval_task_end_to_end_on_a_tiny_model(task, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    versions = iter(f"kvarn at commit {i}" for i in range(100))
    monkeypatch.setattr("kvarn.eval.report._commit", lambda: next(versions))
    argv = ["--task", task, "--model", str(folder), "--methods", "fp16,kvarn_k2v2_g128", "--regions", "tail,sink"]
    rc, out = _report([*argv, "--lengths", "768,640", "--samples", "2", "--seed", "3"], tmp_path, monkeypatch, capsys)
    assert rc == 0, out.err
    rows = _table(out.out, "method")
    assert rows[0] == ["method", "family", "bits/elem", "regions", "640 tokens", "768 tokens", "mean"]
    assert [r[0] for r in rows[1:]] == ["exact", "fp16", "kvarn_k2v2_g128", "kvarn_k2v2_g128"]
    assert [r[3] for r in rows[1:]] == ["-", "tail", "tail", "sink+tail"]
    cell_form = r"\d+% \(\d+%; -\d+ \+\d+(, p(=[01]\.\d\d|<0\.01))?\)"
    assert all(re.fullmatch(cell_form, cell) for r in rows[2:] for cell in r[4:6])
    out_dir = tmp_path / "r"
    report = (out_dir / "report.md").read_text()
    assert f"# kvarn long-context report: {task}" in report and "| 640 | 1 |" in report
    assert ("| recall, 640 tokens |" in report) == (task == "vartrack")
    (res,) = json.loads((out_dir / "results.json").read_text())
    assert res["task"] == task and res["lengths"] == [640, 768] and res["seed"] == 3
    assert res["commit"] == "kvarn at commit 0"  # the version read as the run started, not as it ended
    assert [(r["length"], r["index"]) for r in res["records"]] == [(640, 0), (640, 1), (768, 0), (768, 1)]
    for r in res["records"]:
        assert set(r["runs"]) == {"fp16 [tail]", "kvarn_k2v2_g128 [tail]", "kvarn_k2v2_g128 [sink+tail]"}
        assert r["runs"]["fp16 [tail]"]["same_tokens"]  # fp16 storage of a 2-layer model answers like the exact one
        assert len(r["exact"]["tokens"]) <= tasks.MAX_NEW_TOKENS[task]
        assert r["prompt_tokens"] + tasks.MAX_NEW_TOKENS[task] <= r["length"]
    assert len(res["summary"]) == 4 * 2
    assert [p for p in res["plots"]] == [f"tiny_{task}_accuracy.png"]
    assert (out_dir / res["plots"][0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # seeded: the same command gives the same prompts and answers
    rc, _ = _report(
        [*argv, "--lengths", "640", "--samples", "1", "--seed", "3"], tmp_path / "again", monkeypatch, capsys
    )
    (again,) = json.loads((tmp_path / "again" / "r" / "results.json").read_text())
    assert again["records"][0]["answer"] == res["records"][0]["answer"]
    assert again["records"][0]["exact"] == {
        **res["records"][0]["exact"],
        "seconds": again["records"][0]["exact"]["seconds"],
    }


@pytest.mark.hf
def test_drift_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    argv = ["--task", "drift", "--model", str(folder), "--methods", "fp16,kvarn_k2v2_g128", "--regions", "tail,sink"]
    rc, out = _report([*argv, "--prefix", "128", "--new-tokens", "192"], tmp_path, monkeypatch, capsys)
    assert rc == 0, out.err
    rows = _table(out.out, "method")
    assert rows[0][:4] == ["method", "family", "bits/elem", "regions"]
    assert rows[0][4:] == ["KL @64", "KL @256", "KL @512", "KL @1024", "mean KL", "top-1", "first divergence (of 192)"]
    assert [r[3] for r in rows[1:]] == ["tail", "tail", "sink+tail"]  # no exact row: it is the yardstick
    assert all(r[5:8] == ["-", "-", "-"] for r in rows[1:])  # positions past the 192 generated tokens
    (res,) = json.loads((tmp_path / "r" / "results.json").read_text())
    (record,) = res["records"]
    assert len(record["generated"]) == 192 and len(record["prefix_ids"]) == 128
    grams = [tuple(record["generated"][i : i + 4]) for i in range(189)]
    assert len(set(grams)) == len(grams)  # the default greedy rule repeats no 4-gram
    by = {e["label"]: e for e in res["summary"]}
    fp16, k2, k2sink = by["fp16 [tail]"], by["kvarn_k2v2_g128 [tail]"], by["kvarn_k2v2_g128 [sink+tail]"]
    assert len(record["runs"]["fp16 [tail]"]["kl"]) == 192 and len(fp16["kl_windows"]) == 3
    assert abs(fp16["kl_mean"]) < 1e-6 and fp16["top1"] == 1.0
    assert k2["kl_mean"] > 1e-4 and k2["kl_mean"] > k2sink["kl_mean"]
    assert 0 <= k2["first_divergence"][0] < 192  # a 2-bit cache of a random model does not follow 192 tokens
    assert (tmp_path / "r" / "tiny_drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "KL(exact || method) at position p" in (tmp_path / "r" / "report.md").read_text()


def _chunked_and_one_tile(argv, tmp_path, monkeypatch, capsys):
    """The results of ``kvarn report ARGV --prefill-chunk 256`` and of ``kvarn report ARGV`` on a tiny model."""
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    argv = [*argv, "--model", str(build_tiny_model(tmp_path / "tiny"))]
    rc, out = _report([*argv, "--prefill-chunk", "256"], tmp_path / "chunked", monkeypatch, capsys)
    assert rc == 0, out.err
    rc, out = _report(argv, tmp_path / "tile", monkeypatch, capsys)
    assert rc == 0, out.err
    (chunked,) = json.loads((tmp_path / "chunked" / "r" / "results.json").read_text())
    (tile,) = json.loads((tmp_path / "tile" / "r" / "results.json").read_text())
    assert chunked["prefill_chunk"] == 256 and tile["prefill_chunk"] is None
    return argv, chunked, tile


@pytest.mark.hf
def test_a_report_with_longer_prompt_chunks_says_so_and_keeps_its_log_apart(tmp_path, monkeypatch, capsys):
    argv = ["--task", "niah", "--methods", "fp8_e4m3,kvarn_k4v2_g128", "--regions", "tail"]
    argv += ["--lengths", "640", "--samples", "2"]
    argv, chunked, tile = _chunked_and_one_tile(argv, tmp_path, monkeypatch, capsys)
    for a, b in zip(chunked["records"], tile["records"], strict=True):
        assert a["exact"]["tokens"] == b["exact"]["tokens"]  # the exact model's answer does not depend on chunks
        assert a["runs"]["fp8_e4m3 [tail]"]["tokens"] == b["runs"]["fp8_e4m3 [tail]"]["tokens"]  # one tile a chunk
    report = (tmp_path / "chunked" / "r" / "report.md").read_text()
    assert "the first tile alone, then chunks of 256 tokens" in report
    assert "in chunks of one tile" in (tmp_path / "tile" / "r" / "report.md").read_text()
    rc, err = _report([*argv, "--resume"], tmp_path / "chunked", monkeypatch, capsys)
    assert rc == 2 and "holds a run with prefill_chunk = 256, not None" in err.err


@pytest.mark.hf
def test_drift_with_longer_prompt_chunks_measures_what_one_tile_chunks_do(tmp_path, monkeypatch, capsys):
    argv = ["--task", "drift", "--methods", "kvarn_k2v2_g128", "--regions", "tail,sink"]
    argv += ["--prefix", "256", "--new-tokens", "192"]
    _, chunked, tile = _chunked_and_one_tile(argv, tmp_path, monkeypatch, capsys)
    assert chunked["records"][0]["generated"] == tile["records"][0]["generated"]
    for a, b in zip(chunked["summary"], tile["summary"], strict=True):
        assert a["label"] == b["label"] and a["kl_mean"] == pytest.approx(b["kl_mean"], rel=0.05)


def _without_seconds(value):
    """``value`` with every ``seconds`` entry dropped (wall times differ between runs)."""
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


@pytest.mark.hf
@pytest.mark.parametrize(
    ("task", "sizes"),
    [
        ("niah", ["--lengths", "640,768", "--samples", "2"]),
        ("drift", ["--prefix", "128", "--new-tokens", "64", "--samples", "3"]),
    ],
)
def test_worker_processes_give_the_records_of_one_process(task, sizes, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    argv = ["--task", task, "--model", str(folder), "--methods", "fp16,kvarn_k2v2_g128", "--regions", "sink", *sizes]
    rc, one = _report(argv, tmp_path / "one", monkeypatch, capsys)
    assert rc == 0, one.err
    rc, two = _report([*argv, "--workers", "2"], tmp_path / "two", monkeypatch, capsys)
    assert rc == 0, two.err
    assert "on 2 worker processes" in two.out and "time estimate" in two.out
    (serial,) = json.loads((tmp_path / "one" / "r" / "results.json").read_text())
    (spread,) = json.loads((tmp_path / "two" / "r" / "results.json").read_text())
    assert spread["workers"] == 2 and serial["workers"] == 1
    assert len(spread["records"]) == (4 if task == "niah" else 3)
    for key in ("records", "summary", "runs"):
        assert _without_seconds(spread[key]) == _without_seconds(serial[key]), key
    assert "in each of 2 worker processes" in (tmp_path / "two" / "r" / "report.md").read_text()


_PARENT = """
import os, signal, sys, threading, time
from kvarn.eval.workers import Workers
from tiny_model import hold_worker


def workers_of(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
            found.append(entry)
    return found


workers = Workers(sys.argv[1], "cpu", 2)
list(workers.run(print, [(), ()]))  # both workers loaded the model and answered
print("pids", *workers_of(os.getpid()), flush=True)
threading.Thread(target=lambda: list(workers.run(hold_worker, [(60,), (60,)])), daemon=True).start()
time.sleep(2)  # both workers are mid-job
if sys.argv[2] == "close":
    workers.close(wait=False)
    time.sleep(60)  # the report lives on; its workers must not
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


@pytest.mark.hf
@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["killed", "close"])
def test_workers_end_with_their_report(how, tmp_path):
    """A report killed (SIGKILL: no clean-up runs) or closing its workers at once (an interrupt) leaves none."""
    from tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    path = [str(ROOT), str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(folder), how], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("pids "):  # the workers' own output (the job prints its arguments)
            line = proc.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2, line
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a worker outlived its report's " + how
        if how == "close":
            assert proc.poll() is None  # the workers ended on the stop, not with their report
        else:
            assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.hf
@pytest.mark.parametrize(
    ("task", "first", "more"),
    [
        ("niah", ["--lengths", "640", "--samples", "1"], ["--lengths", "640,768", "--samples", "2"]),
        ("drift", ["--samples", "1"], ["--samples", "2"]),
    ],
)
def test_a_resumed_run_takes_its_finished_samples_from_the_record_log(task, first, more, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    argv = ["--task", task, "--model", str(folder), "--methods", "kvarn_k2v2_g128", "--regions", "sink"]
    if task == "drift":
        argv += ["--prefix", "128", "--new-tokens", "64"]
    out = tmp_path / "run" / "r"
    rc, _ = _report([*argv, *first], tmp_path / "run", monkeypatch, capsys)
    assert rc == 0
    (before,) = json.loads((out / "results.json").read_text())
    log = out / f"tiny_{task}.records.jsonl"
    assert len(log.read_text().splitlines()) == 2  # the settings, then one finished sample
    with log.open("a") as f:
        f.write('{"key": [640, 1], "rec')  # a line cut short by a killed run
    rc, got = _report([*argv, *more, "--resume"], tmp_path / "run", monkeypatch, capsys)
    assert rc == 0, got.err
    assert f"1 taken from {log}" in got.out
    (resumed,) = json.loads((out / "results.json").read_text())
    assert resumed["records"][0] == before["records"][0]  # taken over, its wall time included
    rc, _ = _report([*argv, *more], tmp_path / "fresh", monkeypatch, capsys)
    (fresh,) = json.loads((tmp_path / "fresh" / "r" / "results.json").read_text())
    assert _without_seconds(resumed["records"]) == _without_seconds(fresh["records"])
    assert _without_seconds(resumed["summary"]) == _without_seconds(fresh["summary"])
    assert len(log.read_text().splitlines()) == 1 + len(fresh["records"])
    # other settings are refused, naming the first that differs
    rc, err = _report(
        [*argv[:5], "kivi_k2v2_g128", *argv[6:], *more, "--resume"], tmp_path / "run", monkeypatch, capsys
    )
    assert rc == 2 and "holds a run with runs = ['kvarn_k2v2_g128 [sink+tail]']" in err.err


@pytest.mark.parametrize("task", ["kl", "longctx"])
def test_forwards_leave_out_cudnn_attention(task):
    """cuDNN's SDPA plans every new key length on the host: each forward of the harness runs without it."""
    import torch

    from kvarn.eval import harness, longctx

    seen = []

    class Model:
        device = "cpu"

        def __call__(self, **kwargs):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return type("Out", (), {"logits": torch.zeros(1, 1, 5)})()

    before = torch.backends.cuda.cudnn_sdp_enabled()
    if task == "kl":
        harness._forward(Model(), torch.tensor([[1]]), None)
    else:
        longctx._forward(Model(), [1], cache=None)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled() == before
