"""Loading the policy model and tokenizer from a recipe's ``model`` section.

``builtin:tiny-gsm8k`` is built into the cache by the application (``rltool.demo.model``)
and then loaded from that directory through the very same path as a user's
local checkpoint, so the demo exercises the real loading code. Nothing is ever
fetched from a model hub (``local_files_only=True``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rltool.config.schema import ModelConfig
from rltool.demo.cache import BUILTIN_DIRS, demo_cache_dir

BUILTIN_PREFIX = "builtin:"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's (first) parameters."""
    return next(model.parameters()).device


def resolve_device(device: str) -> torch.device:
    """``auto`` = cuda when available, else cpu; anything else as given (``cpu``, ``cuda:1``)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"model.device: {device!r} is not a device (use auto, cpu, cuda or cuda:N)"
        ) from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"model.device is {device!r} but CUDA is not available; use 'auto' or 'cpu'"
        )
    return resolved


def check_builtin_model(path: str) -> str:
    """The name of a ``builtin:<name>`` model path, or a ValueError listing the known ones."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_DIRS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_DIRS)
        raise ValueError(f"model.path: unknown builtin model {path!r}; known: {known}")
    return name


def resolve_model_path(path: str) -> Path:
    """The checkpoint directory for ``model.path``; a builtin demo must have been built
    (``rltool.demo.model.ensure_demo_checkpoint``; ``rltool train`` does it on first use)."""
    if path.startswith(BUILTIN_PREFIX):
        name = check_builtin_model(path)
        built = demo_cache_dir(name)
        if not (built / "config.json").is_file():
            raise ValueError(
                f"model.path: {path} is not built yet (no checkpoint in {built}); `rltool train` "
                "builds it on first use, or run `python -m rltool.demo.model`"
            )
        return built
    local = Path(path).expanduser()
    if not local.is_dir():
        raise ValueError(
            f"model.path: {path!r} is not a local directory; give a Hugging Face checkpoint "
            f"directory (config.json, weights, tokenizer files) or builtin:tiny-gsm8k"
        )
    if not (local / "config.json").is_file():
        raise ValueError(
            f"model.path: {local} has no config.json; is it a Hugging Face checkpoint?"
        )
    return local


def load_model_and_tokenizer(
    cfg: ModelConfig,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.device]:
    """Model (on its device, train mode), tokenizer and device for ``cfg``."""
    if cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype: {cfg.dtype!r} is not one of {', '.join(_DTYPES)}")
    device = resolve_device(cfg.device)
    path = resolve_model_path(cfg.path)
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


def resolve_builtin_data(path: str) -> Path:
    """``builtin:gsm8k_tiny/train.jsonl`` -> the shipped file; any other path unchanged."""
    if not path.startswith(BUILTIN_PREFIX):
        return Path(path)
    from rltool.demo.data import DATA_DIR

    rel = path.removeprefix(BUILTIN_PREFIX)
    resolved = (DATA_DIR / rel).resolve()
    if not resolved.is_relative_to(DATA_DIR.resolve()) or not resolved.is_file():
        known = ", ".join(
            BUILTIN_PREFIX + p.relative_to(DATA_DIR).as_posix()
            for p in sorted(DATA_DIR.rglob("*.jsonl"))
        )
        raise ValueError(f"unknown builtin data file {path!r}; known: {known}")
    return resolved
