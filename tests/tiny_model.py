"""A tiny random Llama with a byte-level tokenizer, saved as a Hugging Face folder (no download)."""

from __future__ import annotations

import pathlib


def build_tiny_model(path: pathlib.Path) -> pathlib.Path:
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
    )
    torch.manual_seed(0)
    tmp = path.with_name(path.name + ".tmp")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp
    )
    tmp.rename(path)
    return path
