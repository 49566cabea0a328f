"""``rltool export``: a run's checkpoint as a plain Hugging Face model directory.

A LoRA run's checkpoint holds adapters only; the export loads the run's base model
(``model.path`` of its ``config.yaml``), loads the adapters and folds them in
(``W + scale * B @ A``), and saves a merged checkpoint that any ``model.path`` loads.
A full-weight checkpoint is written out as it is, without the trainer state.
Design: docs/lora.md#exporting-a-merged-model
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rltool.app.checkpoint import NoCheckpointError, open_checkpoint, verify_checkpoint
from rltool.app.demo_model import ensure_builtin_models
from rltool.config.loader import resume_recipe
from rltool.lora import apply_lora, is_lora, load_checkpoint_weights
from rltool.models import load_model_and_tokenizer


@dataclass(frozen=True, slots=True)
class Exported:
    checkpoint: Path  # the checkpoint directory read
    out_dir: Path
    lora: bool  # adapters were merged into the base
    skipped: list[str]  # newer checkpoints that did not verify or load


def export_model(
    run_dir: Path,
    out_dir: Path,
    checkpoint: Path | None = None,
    overrides: Sequence[str] = (),
) -> Exported:
    """Write the merged model of ``checkpoint`` (default: the run's newest complete one)
    to ``out_dir`` (new or empty). ValueErrors: no run config, a non-empty ``out_dir``;
    NoCheckpointError: nothing complete to export."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty directory; give a new OUT_DIR")
    recipe = resume_recipe(run_dir, overrides)
    ensure_builtin_models(recipe.model.path)
    model, tokenizer, _ = load_model_and_tokenizer(recipe.model)
    if recipe.model.lora.enabled:
        model = apply_lora(model, recipe.model.lora)

    def load(ckpt: Path) -> None:
        load_checkpoint_weights(model, ckpt)

    if checkpoint is not None:
        reason = verify_checkpoint(checkpoint) if checkpoint.is_dir() else "no such directory"
        if reason is not None:
            raise NoCheckpointError(f"--checkpoint {checkpoint}: {reason}")
        load(checkpoint)
        found, skipped = checkpoint, []
    else:
        opened = open_checkpoint(run_dir, load)
        found, skipped = opened.path, opened.skipped
    lora = is_lora(model)
    merged = model.merge_and_unload() if lora else model
    merged.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return Exported(found, out_dir, lora, skipped)
