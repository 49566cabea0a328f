"""Atomic checkpoints: HF weights plus everything needed to resume exactly.

Layout under ``<run_dir>/checkpoints/``::

    step_000010/            model (safetensors, HF format) + tokenizer
    step_000010/trainer_state.pt   optimizer, scheduler, RNG states, step, and the
                                   producer (replay buffer, accounting, prompt position)
    latest                  name of the newest complete checkpoint

Design: docs/app.md#checkpoints
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
LATEST = "latest"


@dataclass(slots=True)
class TrainerState:
    step: int  # train steps completed
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]  # e.g. best eval so far
    # the producer's state: replay buffer, accounting, task sampler, requests in flight
    producer: dict[str, Any]


def capture_rng() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_root: Path, model: Any, tokenizer: Any, state: TrainerState, keep_last: int = 2
) -> Path:
    """Write a complete checkpoint atomically; returns its directory."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state.step:06d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "step": state.step,
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "rng": state.rng,
            "extra": state.extra,
            "producer": state.producer,
        },
        tmp / STATE_FILE,
    )
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    _fsync_dir(ckpt_root)
    _prune(ckpt_root, keep_last)
    return final


def _prune(ckpt_root: Path, keep_last: int) -> None:
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; a clear error if there is none."""
    ckpt_root = run_dir / "checkpoints"
    pointer = ckpt_root / LATEST
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from in {run_dir} ({pointer} is missing)")
    path = ckpt_root / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint {path} named by {pointer} is incomplete")
    return path


def load_trainer_state(ckpt: Path) -> TrainerState:
    raw = torch.load(ckpt / STATE_FILE, weights_only=False, map_location="cpu")
    return TrainerState(
        step=raw["step"],
        optimizer=raw["optimizer"],
        scheduler=raw["scheduler"],
        rng=raw["rng"],
        extra=raw["extra"],
        producer=raw["producer"],
    )
