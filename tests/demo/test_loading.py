"""rltool.models: loading a checkpoint from a recipe's model section, builtin data paths."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rltool.app.demo_model import demo_model_config
from rltool.builtin import resolve_builtin_data
from rltool.config.checks import check_values
from rltool.config.schema import ModelConfig, RecipeConfig
from rltool.demo.data import GSM8K_TINY_DIR
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.models import (
    load_model_and_tokenizer,
    resolve_device,
    resolve_model_path,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2 saved as an ordinary HF checkpoint."""
    path = tmp_path_factory.mktemp("ckpt")
    tok = train_demo_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(demo_model_config(tok, 32, 2, 2, 64)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_loads_a_local_checkpoint(checkpoint):
    model, tok, device = load_model_and_tokenizer(ModelConfig(path=str(checkpoint), device="auto"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.type == expected and model.device.type == expected
    assert model.dtype == torch.float32 and model.training
    assert model.config._attn_implementation == "sdpa"
    assert tok.padding_side == "left" and tok.chat_template


def test_dtype_and_attention_are_applied(checkpoint):
    cfg = ModelConfig(
        path=str(checkpoint), dtype="bfloat16", device="cpu", attn_implementation="eager"
    )
    model, _, _ = load_model_and_tokenizer(cfg)
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"{re.escape(str(missing))}.*not a local directory"):
        load_model_and_tokenizer(ModelConfig(path=str(missing)))


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))} has no config"):
        resolve_model_path(str(tmp_path))


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(ValueError, match="builtin:tiny-gsm8k"):
        resolve_model_path("builtin:gpt-5")


def test_bad_dtype_and_device():
    # the names are checked when the recipe loads (config/checks.py); the loader trusts them
    cfg = RecipeConfig(model=ModelConfig(dtype="fp8", device="tpu:0"))
    dtype, device = check_values(cfg)
    assert dtype.startswith("model.dtype = 'fp8': must be one of: float32, bfloat16, float16")
    assert device.startswith("model.device = 'tpu:0': must be one of: auto, cpu, cuda, cuda:N")
    assert check_values(RecipeConfig(model=ModelConfig(device="cuda:1"))) == []
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():  # a name can be good and this machine still lack it
        with pytest.raises(ValueError, match=r"model\.device is 'cuda:1' but CUDA is not"):
            resolve_device("cuda:1")


def test_resolve_builtin_data():
    assert (
        resolve_builtin_data("builtin:gsm8k_tiny/train.jsonl")
        == (GSM8K_TINY_DIR / "train.jsonl").resolve()
    )
    assert resolve_builtin_data("data/mine.jsonl").as_posix() == "data/mine.jsonl"
    with pytest.raises(ValueError, match=r"builtin:gsm8k_tiny/test\.jsonl"):
        resolve_builtin_data("builtin:gsm8k_tiny/valid.jsonl")
    with pytest.raises(ValueError, match="unknown builtin data file"):
        resolve_builtin_data("builtin:../../pyproject.toml")
