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


def random_moe(
    vocab_size: int,
    arch: str = "qwen3_moe",
    *,
    seed: int = 0,
    hidden_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    attn: str = "sdpa",
) -> torch.nn.Module:
    """A 2-layer mixture-of-experts model (``qwen3_moe`` or ``mixtral``), every layer sparse,
    whose weights depend only on ``seed``; router weights drawn large enough that routing
    depends on the token."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=top_k,
        max_position_embeddings=128,
    )
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, num_experts=num_experts, moe_intermediate_size=32, norm_topk_prob=True
        )
    elif arch == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=num_experts)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):  # the routers: Qwen3-MoE's start at zero
                p.normal_(0.0, 0.5)
    return model.eval()
