"""Engines by name: ``rollout.engine`` picks the builder; an unknown name lists the known."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.config.schema import ModelConfig, RolloutConfig
from rltool.engines.hf import HFEngine
from rltool.engines.registry import ENGINES, build_engine


def test_an_unknown_engine_names_the_recipe_key_and_lists_the_known_ones():
    assert "hf" in ENGINES.names()
    ENGINES.get("hf")
    with pytest.raises(
        ValueError, match=r"rollout.engine: unknown rollout engine 'nope'; known: hf"
    ):
        ENGINES.get("nope")
    with pytest.raises(ValueError, match=r"known: hf"):
        build_engine(RolloutConfig(engine="nope"), ModelConfig(), None, None)


def test_hf_engine_takes_the_rollout_settings(tokenizer):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(demo_model_config(tokenizer, 32, 1, 2, 64))
    rollout = RolloutConfig(engine="hf", batch_size=5, chunk_tokens=3)
    engine = build_engine(rollout, ModelConfig(), model, tokenizer)
    assert isinstance(engine, HFEngine)
    assert (engine.model, engine.tokenizer) == (model, tokenizer)
    assert (engine.batch_size, engine.chunk_tokens, engine.model_step) == (5, 3, 0)
