"""Atomic, verified checkpoints: HF weights plus everything needed to resume exactly.

Layout under ``<run_dir>/checkpoints/``::

    step_000010/            model (safetensors, HF format) + tokenizer
    step_000010/trainer_state.pt   optimizer, scheduler, RNG states, step, and the
                                   producer (replay buffer, accounting, prompt position)
    step_000010/manifest.json      every other file's size and sha256, written last
    latest                  name of the newest checkpoint (a hint: resume scans step_*)

Design: docs/app.md#checkpoints
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltool.app.faults import fault_point

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
LATEST = "latest"


@dataclass(slots=True)
class TrainerState:
    step: int  # train steps completed
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]  # history, metrics.jsonl lines written before the save
    # the producer's state: replay buffer, accounting, task sampler, requests in flight
    producer: dict[str, Any]


class NoCheckpointError(ValueError):
    """No complete, loadable checkpoint in a run directory."""


class DiskFullError(OSError):
    """A save ran out of disk space; its partial directory is removed already."""


# what a full disk looks like from each writer: an OSError's errno, else the text of the
# error torch.save (its C++ stream writer) or safetensors (a Rust io::Error) raises
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "StorageFull", "file write failed", "Disk quota")


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(ckpt: Path) -> None:
    """Size and sha256 of every file, fsynced first; the manifest itself goes last."""
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        _fsync(path)
        rel = path.relative_to(ckpt).as_posix()
        files[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    tmp = ckpt / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1) + "\n")
    _fsync(tmp)
    os.replace(tmp, ckpt / MANIFEST)


def save_checkpoint(
    ckpt_root: Path,
    model: Any,
    tokenizer: Any,
    state: TrainerState,
    keep_last: int = 2,
    write_model: Callable[[Path], None] | None = None,
) -> Path:
    """Write a complete checkpoint atomically; returns its directory. ``write_model(tmp)``
    replaces ``model.save_pretrained(tmp)`` (a sharded run: app/sharded_checkpoint.py)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state.step:06d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_tmp(tmp, model, tokenizer, state, write_model)
    except Exception as exc:  # safetensors' SafetensorError is no OSError: any, re-raised
        shutil.rmtree(tmp, ignore_errors=True)  # a partial save would keep the disk full
        if _is_disk_full(exc):
            raise DiskFullError(_disk_full_message(ckpt_root, exc)) from exc
        raise
    if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    _fsync(ckpt_root)
    _prune(ckpt_root, keep_last)
    return final


def _write_tmp(
    tmp: Path,
    model: Any,
    tokenizer: Any,
    state: TrainerState,
    write_model: Callable[[Path], None] | None,
) -> None:
    """Every file of the checkpoint into ``tmp``, the manifest last, all fsynced."""
    tmp.mkdir()
    if write_model is None:
        model.save_pretrained(tmp, safe_serialization=True)
    else:
        write_model(tmp)
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
    fault_point("save", state.step)  # the fault drill: weights and state written, no manifest
    _write_manifest(tmp)
    _fsync(tmp)


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    return any(text in str(exc) for text in _FULL_TEXTS)


def _disk_full_message(ckpt_root: Path, exc: BaseException) -> str:
    """The path, the free space (measured once the partial save is gone), the size of the
    newest complete checkpoint (about what the next one needs) and how to go on."""
    free = shutil.disk_usage(ckpt_root).free
    complete = checkpoint_dirs(ckpt_root.parent)
    if complete:
        size = sum(p.stat().st_size for p in complete[0].rglob("*") if p.is_file())
        need = f"; the newest checkpoint, {complete[0].name}, takes {_mib(size)}"
        kept = f"{complete[0].name} and older checkpoints stay"
    else:
        need, kept = "", "no earlier checkpoint"
    return (
        f"no space left on the device of {ckpt_root} to save a checkpoint: {_mib(free)} "
        f"free{need} ({type(exc).__name__}: {_first_line(exc)}). The partial save was "
        f"removed; {kept}. Free some space, then continue with: rltool train --resume "
        f"{ckpt_root.parent}"
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def remove_partial_saves(run_dir: Path) -> list[Path]:
    """Remove the ``.tmp-step_*`` directories of saves that did not finish (a kill, a full
    disk); only the run's lock holder may call this. Returns what was removed."""
    partial = sorted((run_dir / "checkpoints").glob(".tmp-step_*"))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def _prune(ckpt_root: Path, keep_last: int) -> None:
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(ckpt: Path) -> str | None:
    """Why ``ckpt`` is not complete (a one-line reason), or None when its manifest holds."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    if STATE_FILE not in files:
        return f"{MANIFEST} does not list {STATE_FILE}"
    for rel, size, digest in entries:
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{rel} size {actual} != {size} in the manifest"
        if _sha256(path) != digest:
            return f"{rel} sha256 differs from the manifest (bytes changed in place)"
    return None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every ``step_*`` directory of a run, newest first (the ``latest`` pointer is not
    needed: the step is in the name)."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


@dataclass(slots=True)
class Resumable:
    path: Path
    state: TrainerState
    skipped: list[str]  # "step_000006: model.safetensors size 123 != 4567 in the manifest"


def open_checkpoint(run_dir: Path, load_weights: Callable[[Path], None] | None = None) -> Resumable:
    """The newest checkpoint whose manifest holds and whose trainer state (and, with
    ``load_weights``, weights) load; every newer one is skipped with its reason."""
    skipped: list[str] = []
    for ckpt in checkpoint_dirs(run_dir):
        try:
            reason = verify_checkpoint(ckpt)
            if reason is None:
                state = load_trainer_state(ckpt)
                if load_weights is not None:
                    load_weights(ckpt)
                return Resumable(ckpt, state, skipped)
        except Exception as exc:  # any damage: reported as this checkpoint's skip reason
            reason = f"does not load ({type(exc).__name__}: {_first_line(exc)})"
        skipped.append(f"{ckpt.name}: {reason}")
    detail = "; ".join(skipped) if skipped else "no checkpoints/step_* directory"
    raise NoCheckpointError(
        f"no complete checkpoint to resume from in {run_dir} ({detail}); "
        "start a new run instead of --resume"
    )


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run (manifest verified); a clear error if none."""
    return open_checkpoint(run_dir).path


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


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
