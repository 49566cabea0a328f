"""Fixtures shared across test folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.demo.model import demo_model_config
from rltool.demo.tokenizer import train_demo_tokenizer


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with the demo tokenizer, saved as an ordinary HF checkpoint
    (loaded through ``model.path=DIR`` like a user's model; read-only for tests)."""
    out = tmp_path_factory.mktemp("tiny-ckpt")
    tokenizer = train_demo_tokenizer()
    torch.manual_seed(0)
    cfg = demo_model_config(
        tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
