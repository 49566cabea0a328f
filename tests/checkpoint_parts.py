"""What a checkpoint test saves: a tiny Qwen2 built from a config and a stand-in tokenizer."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


class FakeTokenizer:
    """Stands in for a tokenizer: save_pretrained writes one file."""

    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def tiny_qwen() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)
