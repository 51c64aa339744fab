"""A tiny random Llama with a byte-level tokenizer, saved as a Hugging Face folder (no download)."""

from __future__ import annotations

import pathlib


def build_tiny_model(path: pathlib.Path, attention_bias: bool = False) -> pathlib.Path:
    """A 2-layer random Llama (head_dim 64, GQA 4:2) with a byte-level BPE tokenizer, saved at ``path``."""
    if (path / "config.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<s>", "</s>", "<unk>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        initializer_range=0.05,
        attention_bias=attention_bias,
    )
    torch.manual_seed(0)
    tmp = path.with_name(path.name + ".tmp")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp
    )
    tmp.rename(path)
    return path


def build_tiny_gguf(path: pathlib.Path) -> pathlib.Path:
    """A 2-layer random Llama (head_dim 64, GQA 2:1) with a byte-level BPE vocabulary, written as a GGUF file.

    fp32 tensors under llama.cpp's names, the tokenizer as ``tokenizer.ggml.*`` metadata; what
    transformers' GGUF loader reads. About 1.5 MB.
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
