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

from rltool.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltool.config.correction import CorrectionSpec, resolve_correction
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
    algorithm: AlgorithmConfig  # the run's (its rollout correction); defaults for a model dir

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
        replay, algorithm = recipe.algorithm.routing_replay, recipe.algorithm
    else:
        ckpt, cfg, step, temperature = spec, ModelConfig(path=str(spec)), None, 1.0
        replay, algorithm = False, AlgorithmConfig()
    try:
        model, tokenizer, _ = load_model_and_tokenizer(cfg, "--model")
    except OSError as exc:  # no config.json / weights: not a model (a LoRA run's adapters)
        raise ValueError(
            f"--model {spec}: {ckpt} holds no Hugging Face model ({exc}); give a model "
            "directory, a run directory, or `rltool export` a LoRA run first"
        ) from exc
    model.eval()
    return InspectModel(model, tokenizer, ckpt, step, temperature, replay, algorithm)


@dataclass(slots=True)
class MismatchView:
    samples: list[SampleMismatch]
    model: dict[str, Any]  # what was loaded and how it scored (mismatch_json's "model")
    tokenizer: Any  # the model's, to show tokens as text


def correction_of(algorithm: AlgorithmConfig, preset: str | None) -> CorrectionSpec:
    """The correction shown: the run's ``algorithm.rollout_correction`` (and ``tis_cap``), or
    only the preset ``--rollout-correction`` names. ValueError naming the key and presets."""
    if preset is not None:
        algorithm = dataclasses.replace(
            algorithm, tis_cap=None, rollout_correction=RolloutCorrectionConfig(preset=preset)
        )
    return resolve_correction(algorithm)


def mismatch_view(
    batch: TrainBatch,
    indices: list[int],
    spec: Path,
    replay: bool | None,
    correction: str | None = None,
) -> MismatchView:
    """Load ``--model`` and recompute the packs that hold the samples ``indices`` (every pack
    when batch-normalised weights need the whole step)."""
    from rltool.moe import find_routers
    from rltool.training.recompute import correct_packs, recompute_packs

    loaded = load_inspect_model(spec)
    corr = correction_of(loaded.algorithm, correction)
    use_replay = loaded.routing_replay if replay is None else replay
    needed = sorted({batch.samples[i].pack for i in indices})
    if corr.batch_normalize and corr.weights is not None:
        needed = list(range(len(batch.packs)))
    packs = [batch.packs[p] for p in needed]
    recomputed = recompute_packs(loaded.model, packs, loaded.temperature, use_replay)
    if corr.weights is not None or corr.reject:
        correct_packs(packs, recomputed, corr)
    routers = find_routers(loaded.model)
    described = {
        **loaded.describe(),
        "routing_replay": use_replay,
        "moe_layers": None if routers is None else routers.layers,
        "rollout_correction": dataclasses.asdict(corr),
    }
    samples = gather_mismatch(batch, dict(zip(needed, recomputed, strict=True)), indices)
    return MismatchView(samples, described, loaded.tokenizer)


def show_mismatch(view: MismatchView, as_json: bool, decode: Decoder | None) -> None:
    if as_json:
        typer.echo(json.dumps(mismatch_json(view.samples, view.model)))
    else:
        render_mismatch(make_console(), view.samples, view.model, decode)
