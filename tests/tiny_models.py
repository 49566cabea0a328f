"""Tiny random-weight models for tests, built from a config (no download)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


def random_qwen2(
    vocab_size: int,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    max_positions: int = 128,
    attn: str = "sdpa",
) -> torch.nn.Module:
    """A 2-layer Qwen2 (4 heads, 2 KV heads) whose weights depend only on ``seed``."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
