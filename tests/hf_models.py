"""A tiny random Llama and prompts for the transformers cache tests (no download)."""

from __future__ import annotations

import torch


def tiny_llama():
    """A 2-layer random Llama (GQA 4:2, head_dim 64) in fp32 with SDPA attention, the same weights every call."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def prompt_ids(n: int, seed: int = 1) -> torch.Tensor:
    """``[1, n]`` random token ids below 128, the same for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, n), generator=g)
