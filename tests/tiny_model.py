"""Tiny random models with a byte-level tokenizer (a Llama, two hybrids, a GGUF Llama), built here: no download."""

from __future__ import annotations

import pathlib


def _byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte) and ``<s>``, ``</s>``, ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<unk>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return fast, vocab


def _save(path: pathlib.Path, model, tokenizer) -> pathlib.Path:
    """Save ``model`` and ``tokenizer`` at ``path`` through a temporary folder, so a half-written one is never found."""
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def build_tiny_model(path: pathlib.Path, attention_bias: bool = False, num_kv_heads: int = 2) -> pathlib.Path:
    """A 2-layer random Llama (head_dim 64, 4 query heads, ``num_kv_heads`` KV heads) with a byte-level BPE
    tokenizer, saved at ``path``."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok, vocab = _byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        initializer_range=0.05,
        attention_bias=attention_bias,
    )
    torch.manual_seed(0)
    return _save(path, LlamaForCausalLM(config).to(torch.bfloat16), tok)


def build_tiny_eagle(path: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A random EAGLE draft head for the tiny Llama at ``target``, saved at ``path``: one Llama decoder layer (without
    its input norm, as EAGLE's first layer) behind ``fc``, which maps a token's embedding and the target's hidden
    state to the layer's input; embeddings and output head come from the target. Its drafts are random (the target
    rejects nearly all of them); what it exercises is EAGLE's drafting schedule through the draft layer's cache."""
    if (path / "config.json").exists():
        return path
    import json
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    torch.manual_seed(1)
    layer = LlamaForCausalLM(LlamaConfig(**config)).model.layers[0]
    weights = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm")}
    hidden = config["hidden_size"]
    weights["fc.weight"] = torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config))
    for name in target.iterdir():
        if "token" in name.name:
            shutil.copy(name, tmp / name.name)
    tmp.rename(path)
    return path


HYBRIDS = ("lfm2", "nemotron_h")


def build_tiny_hybrid(path: pathlib.Path, kind: str) -> pathlib.Path:
    """A random float32 hybrid model (head_dim 64, 2 KV heads) with the byte-level tokenizer, saved at ``path``.

    ``lfm2``: ``Lfm2ForCausalLM``, short-conv and attention layers alternating (conv, attention, conv,
    attention); its conv state is smaller than one attention page, so vLLM keeps blocks of one tile.
    ``nemotron_h``: ``NemotronHForCausalLM``, Mamba2, attention, MLP, attention; its Mamba state (8 heads of
    32 x 64, fp32: about 70 KB) makes vLLM raise the block size to several tiles, and its one Mamba layer
    against two attention layers puts each attention layer in a KV-cache group of its own.
    """
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    tok, vocab = _byte_tokenizer()
    special = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["<unk>"]}
    common = {"vocab_size": len(vocab), "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    common.update(special, max_position_embeddings=2048, initializer_range=0.05)
    if kind == "lfm2":
        from transformers import Lfm2Config

        # vLLM reads conv_dim and block_dim, which LFM2 checkpoints carry and transformers' config does not
        config = Lfm2Config(
            **common,
            intermediate_size=256,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            block_auto_adjust_ff_dim=False,
            conv_dim=128,
            block_dim=128,
        )
    elif kind == "nemotron_h":
        from transformers import NemotronHConfig

        config = NemotronHConfig(
            **common,
            head_dim=64,
            layers_block_type=["mamba", "attention", "mlp", "attention"],
            intermediate_size=256,
            ssm_state_size=64,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=1,
            chunk_size=64,
        )
    else:
        raise ValueError(f"kind must be one of {HYBRIDS}, got {kind!r}")
    torch.manual_seed(0)
    return _save(path, AutoModelForCausalLM.from_config(config).to(torch.float32), tok)


def build_tiny_gguf(path: pathlib.Path, add_bos: bool | None = None, add_eos: bool | None = None) -> pathlib.Path:
    """A 2-layer random Llama (head_dim 64, GQA 2:1) with a byte-level BPE vocabulary, written as a GGUF file.

    fp32 tensors under llama.cpp's names, the tokenizer as ``tokenizer.ggml.*`` metadata; what
    transformers' GGUF loader reads. ``add_bos``, ``add_eos``: the ``tokenizer.ggml.add_bos_token`` and
    ``add_eos_token`` keys (left out when ``None``). About 1.5 MB.
    """
    import numpy as np
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "th", "<s>", "</s>"]  # one merge: an empty merge list sends transformers to SentencePiece
    hidden, ff, layers, heads, kv_heads, head_dim = 128, 256, 2, 2, 1, 64
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(["t h"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)

    def weight(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (0.05 * rng.standard_normal((rows, cols))).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    weight("output.weight", len(tokens), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        weight(f"blk.{i}.ffn_gate.weight", ff, hidden)
        weight(f"blk.{i}.ffn_up.weight", ff, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


WINDOWED = ("gemma3", "granite_swa", "gpt_oss")
WINDOW = 200
"""The tiny windowed models' sliding window: not a multiple of the tile, so the first visible tile is masked."""


def build_tiny_windowed(path: pathlib.Path, kind: str) -> pathlib.Path:
    """A random float32 dense model with sliding-window layers between global ones (window :data:`WINDOW`, head_dim
    64, 2 query and 2 KV heads, 4 layers: window, global, window, global) and the byte-level tokenizer, at ``path``.

    ``gemma3``: ``Gemma3ForCausalLM`` (text only). ``granite_swa``: vLLM's Granite with ``layer_types``, which
    gives every layer learned per-head attention sinks; transformers' Granite has none, so random ``sinks`` are
    written into the checkpoint beside its weights. ``gpt_oss``: ``GptOssForCausalLM`` (4 experts, 2 a token,
    biased projections, random sinks on every layer).
    """
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    tok, vocab = _byte_tokenizer()
    common = {"vocab_size": len(vocab), "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    common.update(bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<unk>"])
    common.update(max_position_embeddings=2048, initializer_range=0.05, intermediate_size=256, num_hidden_layers=4)
    layer_types = ["sliding_attention", "full_attention"] * 2
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(
            **common, head_dim=64, layer_types=layer_types, sliding_window=WINDOW, query_pre_attn_scalar=64
        )
        config.architectures = ["Gemma3ForCausalLM"]
    elif kind == "granite_swa":
        from transformers import GraniteConfig

        config = GraniteConfig(
            **common, layer_types=layer_types, sliding_window=WINDOW, attention_sinks=True, attention_multiplier=0.125
        )
    elif kind == "gpt_oss":
        from transformers import GptOssConfig

        common.update(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
        config = GptOssConfig(**common, head_dim=64, layer_types=layer_types, sliding_window=WINDOW)
    else:
        raise ValueError(f"kind must be one of {WINDOWED}, got {kind!r}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if kind == "gpt_oss":  # larger than transformers starts them, so they weigh
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads) + 1.0)
    _save(path, model, tok)
    if kind == "granite_swa":
        from safetensors.torch import load_file, save_file

        (weights,) = path.glob("*.safetensors")
        tensors = load_file(weights)
        for i in range(config.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.sinks"] = torch.randn(config.num_attention_heads) + 1.0
        save_file(tensors, weights, metadata={"format": "pt"})
    return path


def hold_worker(model, tok, seconds: float, bar) -> None:
    """A ``kvarn.eval.workers`` job that keeps its worker busy for ``seconds``."""
    import time

    time.sleep(seconds)
