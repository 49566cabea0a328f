"""model.path as a Hugging Face hub id: found in a hub cache the test builds, never downloaded."""

from __future__ import annotations

import shutil

import pytest
from hub_and_wandb import build_hub_cache

from rltool.config.schema import ModelConfig
from rltool.models import (
    hub_cache_dir,
    load_model_and_tokenizer,
    looks_like_hub_id,
    resolve_model_path,
)


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a test never reaches the network
    return cache


def test_hub_id_resolves_to_the_cached_snapshot(hub_env, tiny_checkpoint):
    snapshot = build_hub_cache(hub_env, "tiny-org/tiny-model", tiny_checkpoint)
    assert resolve_model_path("tiny-org/tiny-model") == snapshot
    model, tok, _ = load_model_and_tokenizer(ModelConfig(path="tiny-org/tiny-model", device="cpu"))
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    assert tok.padding_side == "left"


def test_hf_home_is_honoured(tmp_path, monkeypatch, tiny_checkpoint):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "home" / "hub").mkdir(parents=True)
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    snapshot = build_hub_cache(tmp_path / "home" / "hub", "tiny-org/tiny-model", tiny_checkpoint)
    assert resolve_model_path("tiny-org/tiny-model") == snapshot


def test_an_existing_local_directory_wins_over_the_cache(
    hub_env, tiny_checkpoint, tmp_path, monkeypatch
):
    build_hub_cache(hub_env, "tiny-org/tiny-model", tiny_checkpoint)
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "tiny-org" / "tiny-model"
    shutil.copytree(tiny_checkpoint, local)
    assert resolve_model_path("tiny-org/tiny-model") == local.relative_to(tmp_path)


def test_not_cached_and_offline_says_how_to_provide_it(hub_env):
    with pytest.raises(ValueError) as err:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(err.value)
    assert msg.startswith("model.path: 'Qwen/Qwen2.5-0.5B-Instruct' is not a local directory")
    assert str(hub_env) in msg and "HF_HUB_OFFLINE is set" in msg
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in msg


def test_not_cached_and_unreachable_says_so(hub_env, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once
    with pytest.raises(ValueError, match=r"could not be downloaded.*hf download"):
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", key="distill.teacher_path")
    with pytest.raises(ValueError, match=r"^distill\.teacher_path: "):
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", key="distill.teacher_path")


def test_a_cached_repo_without_config_is_named(hub_env, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    snapshot = build_hub_cache(hub_env, "org/weights-only", empty)
    with pytest.raises(ValueError, match=f"{snapshot} has no config.json"):
        resolve_model_path("org/weights-only")


@pytest.mark.parametrize(
    ("path", "hub"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("/abs/dir", False),
        ("./rel/dir", False),
        ("~/models/x", False),
        ("a/b/c", False),
        ("single", False),
        ("../up", False),
        ("org/..", False),
    ],
)
def test_which_paths_are_hub_ids(path, hub):
    assert looks_like_hub_id(path) is hub
