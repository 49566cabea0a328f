"""Loading the policy model and tokenizer from a recipe's ``model`` section.

``model.path`` is a local checkpoint directory, ``builtin:<name>`` (a demo checkpoint in the
cache, ``rltool.builtin``, loaded like a user's directory), or a Hugging Face hub id
resolved offline-first through the hub cache. Design: docs/app.md#model-paths Loading itself always
reads that directory (``local_files_only=True``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rltool.builtin import builtin_model_dir, is_builtin
from rltool.config.schema import ModelConfig

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as every peer writes it
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameters."""
    return next(model.parameters()).device


def resolve_device(device: str) -> torch.device:
    """``auto`` = cuda when available, else cpu; anything else as given (``cpu``, ``cuda:1``;
    the names were checked when the recipe loaded)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"model.device is {device!r} but CUDA is not available; use 'auto' or 'cpu'"
        )
    return resolved


def resolve_model_path(path: str, key: str = "model.path") -> Path:
    """The checkpoint directory for ``model.path`` (``key`` names it in errors): a builtin
    demo (built by ``rltool.app.demo_model.ensure_demo_checkpoint``; ``rltool train`` does it
    on first use), an existing local directory, or else a hub id found in the hub cache."""
    if is_builtin(path):
        return builtin_model_dir(path, key)
    local = Path(path).expanduser()
    if not local.is_dir() and looks_like_hub_id(path):
        local = resolve_hub_model(path, key)
    elif not local.is_dir():
        raise ValueError(
            f"{key}: {path!r} is not a local directory; give a Hugging Face checkpoint "
            f"directory (config.json, weights, tokenizer files), a hub id such as "
            f"Qwen/Qwen2.5-0.5B-Instruct, or builtin:tiny-gsm8k"
        )
    if not (local / "config.json").is_file():
        raise ValueError(f"{key}: {local} has no config.json; is it a Hugging Face checkpoint?")
    return local


def embedding_rows(model: torch.nn.Module) -> int:
    """The vocabulary as training sees it: the rows of the input embedding (the config's
    ``vocab_size``; ``len(tokenizer)`` may be smaller). Every token id must be below it
    (data-contract invariant 10), or the embedding lookup fails with an IndexError."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)  # a wrapper (LoRA) may not say
    return int(rows if rows is not None else embedding.weight.shape[0])


def vocab_size_at(path: str, key: str = "model.path") -> int:
    """``embedding_rows`` of the checkpoint ``path`` (as ``model.path`` takes it), read
    from its config.json without loading the weights."""
    cfg = AutoConfig.from_pretrained(resolve_model_path(path, key), local_files_only=True)
    return int(cfg.get_text_config().vocab_size)


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` (no leading ``/``, ``.`` or ``~``, exactly one slash)."""
    return _HUB_ID.fullmatch(path) is not None and ".." not in path


def hub_cache_dir() -> Path:
    """The hub cache, read from the environment at call time: ``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value."""
    on = {"1", "true", "yes", "on"}
    return any(
        os.environ.get(k, "").strip().lower() in on
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_hub_model(repo_id: str, key: str = "model.path") -> Path:
    """The snapshot directory of hub model ``repo_id``: from the cache when it is there,
    else downloaded unless ``HF_HUB_OFFLINE`` is set; a ValueError saying how to provide
    it when it is neither cached nor reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached: download it below unless offline
    how = (
        f"download it on a machine with network (`hf download {repo_id}`, or "
        f"`huggingface-cli download` with an older huggingface_hub, "
        f"with HF_HUB_CACHE or HF_HOME pointing at the cache used here) or give a local "
        f"checkpoint directory"
    )
    if hub_offline():
        raise ValueError(
            f"{key}: {repo_id!r} is not a local directory and not in the Hugging Face cache "
            f"{cache} (HF_HUB_OFFLINE is set, so it is not downloaded); {how}"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, ignore_patterns=_SKIPPED_HUB_FILES))
    except (HfHubHTTPError, OSError) as exc:  # unreachable, unknown repo, gated, disk
        raise ValueError(
            f"{key}: {repo_id!r} is not a local directory, not in the Hugging Face cache "
            f"{cache}, and could not be downloaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); {how}"
        ) from exc


# weight formats and copies that transformers does not load
_SKIPPED_HUB_FILES = ["*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*"]


def load_model_and_tokenizer(
    cfg: ModelConfig, key: str = "model.path"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    """Model (on its device, train mode), tokenizer and device for ``cfg``; ``key`` names
    the recipe key of ``cfg.path`` in errors."""
    device = resolve_device(cfg.device)
    path = resolve_model_path(cfg.path, key)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        local_files_only=True,
        dtype=_DTYPES[cfg.dtype],
        attn_implementation=cfg.attn_implementation,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.to(device)
    model.train()
    return model, tokenizer, device


def load_tokenizer(cfg: ModelConfig, key: str = "model.path") -> PreTrainedTokenizerBase:
    """The tokenizer of ``cfg.path`` alone (no weights): what preflight counts prompts with."""
    return AutoTokenizer.from_pretrained(resolve_model_path(cfg.path, key), local_files_only=True)


def context_length(cfg: ModelConfig, key: str = "model.path") -> int | None:
    """The model's context (``max_position_embeddings`` of its text config), read from its
    config alone; None when the config does not say."""
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.path, key), local_files_only=True)
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None
