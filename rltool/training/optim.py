"""AdamW and the learning-rate schedule, built from ``OptimizerConfig``.

Design (the schedule, checkpoints, warm starts): docs/losses.md#the-optimizer
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from rltool.config.schema import OptimizerConfig

OPTIMIZER_FILE = "optimizer.pt"  # AdamW moments shipped beside a model's weights


def lr_multiplier(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Factor applied to the base learning rate during train step ``step`` (0-based);
    ``schedule`` is one of config/checks.py's ``optimizer.schedule`` names."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    assert schedule == "cosine", schedule
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, init_dir: Path | None = None
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; moments from ``init_dir/optimizer.pt`` if given."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    if init_dir is not None:
        load_moments(optimizer, Path(init_dir) / OPTIMIZER_FILE)
    return optimizer


def save_moments(optimizer: torch.optim.Optimizer, directory: Path) -> Path:
    """Write the optimizer state beside a model's weights, for a later warm start."""
    path = Path(directory) / OPTIMIZER_FILE
    torch.save(optimizer.state_dict(), path)
    return path


def load_moments(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load per-parameter state (AdamW moments, step counts), keep current hyperparameters."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no optimizer state to warm-start from; "
            "set optimizer.init_from_checkpoint=false or save one with save_moments"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    current = optimizer.state_dict()
    n_saved = sum(len(g["params"]) for g in saved["param_groups"])
    n_current = sum(len(g["params"]) for g in current["param_groups"])
    if n_saved != n_current:
        raise ValueError(
            f"{path}: holds state for {n_saved} parameters, the model has {n_current} "
            "trainable ones; it was saved for another model"
        )
    saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
    current_ids = [i for g in current["param_groups"] for i in g["params"]]
    remap = dict(zip(saved_ids, current_ids, strict=True))
    current["state"] = {remap[i]: s for i, s in saved["state"].items()}
    optimizer.load_state_dict(current)  # moves the state to the parameters' device


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> LambdaLR:
    """LambdaLR stepping once per train step; the shape: docs/losses.md#the-optimizer."""

    def multiplier(step: int) -> float:
        return lr_multiplier(step, cfg.warmup_steps, total_steps, cfg.schedule, cfg.min_lr_ratio)

    return LambdaLR(optimizer, multiplier)
