"""``inspect-batch FILE --model PATH_OR_RUN``: the trainer's logprobs recomputed with a model
beside the rollout's, token by token (``report.mismatch_view``).

``PATH_OR_RUN`` is a Hugging Face model directory, or a run directory (``rltool train``'s
``runs/<name>``): its newest complete checkpoint, with the run's sampling temperature and
``algorithm.routing_replay``. Design: docs/inspect.md#where-the-mismatch-lives
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer

from rltool.config.loader import RUN_CONFIG, resume_recipe
from rltool.config.schema import ModelConfig
from rltool.report.console import make_console
from rltool.report.inspect_view import Decoder
from rltool.report.mismatch_view import (
    SampleMismatch,
    gather_mismatch,
    mismatch_json,
    render_mismatch,
)
from rltool.training.batch import TrainBatch


@dataclass(slots=True)
class InspectModel:
    model: torch.nn.Module
    tokenizer: Any
    path: Path  # the weights loaded (a run's checkpoint directory)
    step: int | None  # the checkpoint's train step; None for a model directory
    temperature: float  # the sampling temperature the logprobs are scored at
    routing_replay: bool  # the run's algorithm.routing_replay; False for a model directory

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "step": self.step,
            "temperature": self.temperature,
            "routing_replay": self.routing_replay,
        }


def load_inspect_model(spec: Path) -> InspectModel:
    """The model of ``--model``: a run directory's newest checkpoint, or a model directory.
    ValueError (a run without a complete checkpoint, a directory that holds no model)."""
    from rltool.app.checkpoint import latest_checkpoint, load_trainer_state
    from rltool.models import load_model_and_tokenizer

    if (spec / RUN_CONFIG).is_file():
        recipe = resume_recipe(spec)
        ckpt = latest_checkpoint(spec)  # NoCheckpointError (a ValueError) names the run
        cfg = dataclasses.replace(recipe.model, path=str(ckpt))
        step: int | None = load_trainer_state(ckpt).step
        temperature = recipe.rollout.sampling.temperature or 1.0  # as the run's updater
        replay = recipe.algorithm.routing_replay
    else:
        ckpt, cfg, step, temperature, replay = spec, ModelConfig(path=str(spec)), None, 1.0, False
    try:
        model, tokenizer, _ = load_model_and_tokenizer(cfg, "--model")
    except OSError as exc:  # no config.json / weights: not a model (a LoRA run's adapters)
        raise ValueError(
            f"--model {spec}: {ckpt} holds no Hugging Face model ({exc}); give a model "
            "directory, a run directory, or `rltool export` a LoRA run first"
        ) from exc
    model.eval()
    return InspectModel(model, tokenizer, ckpt, step, temperature, replay)


@dataclass(slots=True)
class MismatchView:
    samples: list[SampleMismatch]
    model: dict[str, Any]  # what was loaded and how it scored (mismatch_json's "model")
    tokenizer: Any  # the model's, to show tokens as text


def mismatch_view(
    batch: TrainBatch, indices: list[int], spec: Path, replay: bool | None
) -> MismatchView:
    """Load ``--model`` and recompute the packs that hold the samples ``indices``."""
    from rltool.moe import find_routers
    from rltool.training.recompute import recompute_packs

    loaded = load_inspect_model(spec)
    use_replay = loaded.routing_replay if replay is None else replay
    needed = sorted({batch.samples[i].pack for i in indices})
    packs = [batch.packs[p] for p in needed]
    recomputed = recompute_packs(loaded.model, packs, loaded.temperature, use_replay)
    routers = find_routers(loaded.model)
    described = {
        **loaded.describe(),
        "routing_replay": use_replay,
        "moe_layers": None if routers is None else routers.layers,
    }
    samples = gather_mismatch(batch, dict(zip(needed, recomputed, strict=True)), indices)
    return MismatchView(samples, described, loaded.tokenizer)


def show_mismatch(view: MismatchView, as_json: bool, decode: Decoder | None) -> None:
    if as_json:
        typer.echo(json.dumps(mismatch_json(view.samples, view.model)))
    else:
        render_mismatch(make_console(), view.samples, view.model, decode)
