"""The demo warm start: SFT encoding, config size, cache handling, and (slow) a real build."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen3MoeForCausalLM

import rltool.app.demo_model as demo_model
from rltool.app.demo_model import (
    BUILD_ARGS,
    BUILD_INFO_FILE,
    OPTIMIZER_FILE,
    SFTSettings,
    build_demo_checkpoint,
    demo_model_config,
    demo_moe_config,
    encode_sft_example,
    ensure_demo_checkpoint,
)
from rltool.builtin import demo_cache_dir
from rltool.config.schema import ModelConfig
from rltool.demo.data import Problem
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.models import load_model_and_tokenizer
from rltool.moe import find_routers
from rltool.rollout.state import IGNORE_INDEX


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


def test_sft_example_supervises_exactly_the_answer_and_eos(tok):
    ids, labels = encode_sft_example(tok, Problem("What is 2 + 3?", "2 + 3 = 5\n#### 5"))
    answer = tok("2 + 3 = 5\n#### 5", add_special_tokens=False)["input_ids"]
    n_prompt = len(ids) - len(answer) - 1
    prompt_text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids[:n_prompt]) == prompt_text
    assert labels == [IGNORE_INDEX] * n_prompt + [*answer, tok.eos_token_id]
    assert ids[n_prompt:] == [*answer, tok.eos_token_id]


def test_demo_config_is_a_3m_qwen2(tok):
    cfg = demo_model_config(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 4, 4)
    assert cfg.tie_word_embeddings
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    assert 3.0e6 < n < 3.6e6


def test_moe_demo_config_is_qwen3_moe_with_the_dense_shape(tok):
    """builtin:tiny-gsm8k-moe: every layer 8 experts top-2, each half the dense MLP, so a
    token's expert compute is the dense demo's."""
    cfg = demo_moe_config(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (256, 4, 8)
    assert (
        cfg.num_experts_per_tok * cfg.moe_intermediate_size
        == demo_model_config(tok).intermediate_size
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    routers = find_routers(model)
    assert (routers.layers, routers.top_k, routers.num_experts) == (4, 2, 8)


@pytest.mark.slow
def test_reduced_moe_build_loads_as_the_builtin(monkeypatch, tmp_path):
    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path / "cache"))
    settings = SFTSettings(
        max_steps=2, batch_size=4, probe_from=2, probe_every=2, probe_problems=4, eval_problems=4
    )
    out = demo_cache_dir("tiny-gsm8k-moe")
    info = build_demo_checkpoint(
        out, settings=settings, show_progress=False, **BUILD_ARGS["tiny-gsm8k-moe"]
    )
    assert info["name"] == "tiny-gsm8k-moe-v1" and info["sft_steps"] == 2
    model, _, _ = load_model_and_tokenizer(ModelConfig(path="builtin:tiny-gsm8k-moe"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_cache_dir_follows_rltool_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path))
    assert demo_cache_dir() == tmp_path / "tiny-gsm8k-v2"
    monkeypatch.delenv("RLTOOL_CACHE")
    assert demo_cache_dir().parts[-3:] == (".cache", "rltool", "tiny-gsm8k-v2")


def test_ensure_builds_once_into_the_cache(monkeypatch, tmp_path):
    calls = []

    def fake_build(out_dir, seed=0, show_progress=True):
        calls.append(out_dir)
        assert out_dir.parent == tmp_path and out_dir.name != "tiny-gsm8k-v2"  # a temp dir
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "build_demo_checkpoint", fake_build)
    path = ensure_demo_checkpoint(show_progress=False)
    assert path == tmp_path / "tiny-gsm8k-v2" and (path / "config.json").is_file()
    assert ensure_demo_checkpoint(show_progress=False) == path
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-gsm8k-v2"]  # temp dir gone


def test_ensure_cleans_up_after_a_failed_build(monkeypatch, tmp_path):
    def failing_build(out_dir, seed=0, show_progress=True):
        (out_dir / "half-written").write_text("x")
        raise RuntimeError("interrupted")

    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "build_demo_checkpoint", failing_build)
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_demo_checkpoint(show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_ensure_names_a_blocking_path(monkeypatch, tmp_path):
    def build(out_dir, seed=0, show_progress=True):
        (out_dir / "config.json").write_text("{}")

    (tmp_path / "tiny-gsm8k-v2").mkdir()
    (tmp_path / "tiny-gsm8k-v2" / "junk").write_text("x")
    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "build_demo_checkpoint", build)
    with pytest.raises(ValueError, match=r"tiny-gsm8k-v2.*holds no checkpoint"):
        ensure_demo_checkpoint(show_progress=False)


@pytest.mark.slow
def test_reduced_build_is_deterministic_and_loads_as_the_builtin(monkeypatch, tmp_path):
    monkeypatch.setenv("RLTOOL_CACHE", str(tmp_path / "cache"))
    settings = SFTSettings(
        max_steps=4, batch_size=8, probe_from=2, probe_every=2, probe_problems=8, eval_problems=16
    )
    before = torch.get_rng_state()
    build = {"seed": 0, "settings": settings, "show_progress": False}
    info = build_demo_checkpoint(demo_cache_dir(), **build)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    again = build_demo_checkpoint(
        tmp_path / "again", seed=0, settings=settings, show_progress=False
    )
    assert info["sft_steps"] == again["sft_steps"] == 4  # 4 steps cannot reach the target
    assert info["test_problems"] == 16 and 0.0 <= info["test_greedy_accuracy"] <= 1.0
    assert json.loads((demo_cache_dir() / BUILD_INFO_FILE).read_text()) == info

    # the builtin resolves to the cached build and loads through the ordinary path
    model, tokenizer, device = load_model_and_tokenizer(ModelConfig())
    assert device == torch.device("cpu") and model.training
    assert tokenizer.padding_side == "left" and tokenizer.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tokenizer.eos_token_id
    reloaded, _, _ = load_model_and_tokenizer(ModelConfig(path=str(tmp_path / "again")))
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name

    state = torch.load(demo_cache_dir() / OPTIMIZER_FILE, weights_only=True)
    n_params = len(list(model.parameters()))
    assert len(state["state"]) == n_params  # AdamW moments for every (tied: unique) parameter
    assert all(int(s["step"]) == 4 for s in state["state"].values())
