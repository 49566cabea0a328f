"""``rltool replay RUN_DIR --from-step N [--to-step M] [key=value ...]``: train steps N..M
again on the rollouts the run dumped, generating nothing.

The trainer is built as ``rltool train`` builds it (same seed, model, optimizer and
schedule), restored from the run's checkpoint at step N-1 (the recipe's model at N=1),
and each step's dumped groups go through the same ``TrainingController.fit``. Without
overrides, a synchronous run's step-M weights come back equal to its checkpoint at M;
with overrides (``algorithm.policy_loss``, ``optimizer.lr``, a correction) it compares
algorithms on identical rollouts. The replay writes into a new directory
(``RUN_DIR/replay-N-M`` unless ``out`` says otherwise), never into the run's own files.
Design: docs/replay.md
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltool import metric_names as mn
from rltool.app.checkpoint import (
    TrainerState,
    capture_rng,
    checkpoint_dirs,
    load_trainer_state,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)
from rltool.app.demo_model import ensure_builtin_models
from rltool.app.metrics_log import MetricsWriter
from rltool.app.recipe_names import check_config
from rltool.app.rollout_dumps import (
    DumpSource,
    dumped_steps,
    read_step_dump,
    require_dump,
)
from rltool.app.run import build_updater, seed_everything
from rltool.app.sharded_checkpoint import restore_updater
from rltool.app.view import RunView, SilentView
from rltool.config.loader import RUN_CONFIG, load_recipe, recipe_to_yaml
from rltool.config.schema import RecipeConfig
from rltool.lora import apply_lora
from rltool.models import load_model_and_tokenizer
from rltool.produce.inprocess import async_torch_threads
from rltool.training.controller import TrainingController
from rltool.training.convert import ConversionConfig

REPLAY_FILE = "replay.json"  # in the replay's directory: source run, steps, overrides


@dataclass(slots=True)
class ReplayOutcome:
    out_dir: Path
    from_step: int
    to_step: int
    checkpoint: Path  # the replay's checkpoint at ``to_step``
    history: list[dict[str, float]]  # the train metrics of each replayed step


def replay(
    run_dir: Path,
    from_step: int,
    to_step: int | None = None,
    overrides: list[str] | None = None,
    out_dir: Path | None = None,
    view: RunView | None = None,
) -> ReplayOutcome:
    """Train steps ``from_step``..``to_step`` (default: the last dumped step) of the run in
    ``run_dir`` on its dumps; ValueError (a DumpError for dumps) before any model loads
    when the steps, the dumps or the checkpoint to start from are not there."""
    view = view or SilentView()
    overrides = list(overrides or [])
    original = load_recipe(run_dir / RUN_CONFIG)
    recipe = load_recipe(run_dir / RUN_CONFIG, overrides)
    check_config(recipe, f"replay of {run_dir}")
    _check_one_process(recipe)
    last = to_step if to_step is not None else _last_dumped(run_dir)
    if not 1 <= from_step <= last:
        raise ValueError(
            f"--from-step {from_step} --to-step {last}: need 1 <= from-step <= to-step"
        )
    for step in range(from_step, last + 1):  # before the model loads
        require_dump(run_dir, step)
    start = _start_checkpoint(run_dir, from_step)
    view.phase("loading the model")
    trainer, tokenizer = _build_trainer(recipe, start)
    # every dump read and checked before a step trains: a bad one stops the replay early
    source = DumpSource(original.model.path, len(tokenizer))
    steps = {s: read_step_dump(run_dir, s, source) for s in range(from_step, last + 1)}
    out = out_dir if out_dir is not None else _new_out_dir(run_dir, from_step, last)
    out.mkdir(parents=True, exist_ok=False)
    (out / RUN_CONFIG).write_text(recipe_to_yaml(recipe))
    record = {
        "run": str(run_dir),
        "from_step": from_step,
        "to_step": last,
        "start": str(start) if start is not None else recipe.model.path,
        "overrides": overrides,
    }
    (out / REPLAY_FILE).write_text(json.dumps(record, indent=1) + "\n")
    view.note(f"replaying steps {from_step}..{last} of {run_dir} from {record['start']}")
    history: list[dict[str, float]] = []
    writer = MetricsWriter(out)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(trainer_threads(recipe))
        with view.progress(total=last - from_step + 1) as advance:
            for step, groups in steps.items():
                t0 = time.perf_counter()
                result = trainer.fit(groups, train_step=step)
                metrics = result.metrics | {mn.TIME_STEP: time.perf_counter() - t0}
                history.append(metrics)
                writer.write(step, metrics, kind="train")
                view.step_line(step, metrics, result.batch.skipped_groups)
                advance()
        state = TrainerState(
            step=last,
            optimizer=trainer.updater.optimizer.state_dict(),
            scheduler=trainer.updater.scheduler.state_dict(),
            rng=capture_rng(),
            extra={"history": history, "metrics_lines": writer.lines, "replay": record},
            producer={},  # nothing was produced: a replay's checkpoint is not for --resume
        )
        saved = save_checkpoint(out / "checkpoints", trainer.updater.model, tokenizer, state)
    finally:
        torch.set_num_threads(threads)
        writer.close()
    view.note(f"checkpoint saved: {saved}")
    return ReplayOutcome(out, from_step, last, saved, history)


def trainer_threads(recipe: RecipeConfig) -> int:
    """The torch threads the run's trainer had: an async run in one process splits them
    with the generator (``produce/inprocess.py``); float sums depend on the count."""
    if recipe.produce.mode == "async" and recipe.rollout.backend == "inprocess":
        return async_torch_threads()
    return torch.get_num_threads()


def _check_one_process(recipe: RecipeConfig) -> None:
    dist = recipe.distributed
    if dist.nproc_per_node * dist.nnodes > 1:
        raise ValueError(
            "rltool replay trains in one process; give distributed.nproc_per_node=1 "
            "distributed.nnodes=1 (a sharded checkpoint restores on one process)"
        )


def _last_dumped(run_dir: Path) -> int:
    steps = dumped_steps(run_dir)
    if not steps:
        raise ValueError(
            f"{run_dir}/rollouts: no step_*.jsonl dumps; replay needs a run trained with "
            "--dump-rollouts"
        )
    return steps[-1]


def _start_checkpoint(run_dir: Path, from_step: int) -> Path | None:
    """The complete checkpoint at step ``from_step - 1`` (None at step 1: the model)."""
    if from_step == 1:
        return None
    ckpt = run_dir / "checkpoints" / f"step_{from_step - 1:06d}"
    saved = sorted(int(p.name[5:]) for p in checkpoint_dirs(run_dir))
    hint = ", ".join(str(s + 1) for s in saved) or "none: the run has no checkpoint"
    if not ckpt.is_dir():
        raise ValueError(
            f"{ckpt}: replay from step {from_step} starts from the checkpoint of step "
            f"{from_step - 1}, which the run does not have; --from-step can be 1 or one "
            f"after a checkpoint ({hint})"
        )
    reason = verify_checkpoint(ckpt)
    if reason is not None:
        raise ValueError(f"{ckpt}: the checkpoint to replay from is damaged: {reason}")
    return ckpt


def _build_trainer(recipe: RecipeConfig, start: Path | None) -> tuple[TrainingController, Any]:
    """The trainer as ``build_run`` builds it (same seed, load order, LoRA init), restored
    from ``start``; the recipe's optimizer settings apply to the restored moments."""
    ensure_builtin_models(recipe.model.path, recipe.distill.teacher_path)
    seed_everything(recipe.trainer.seed, recipe.trainer.deterministic, recipe.trainer.threads)
    model, tokenizer, _device = load_model_and_tokenizer(recipe.model)
    if recipe.model.lora.enabled:
        model = apply_lora(model, recipe.model.lora)
    updater = build_updater(recipe, model)
    if start is not None:
        optimizer, scheduler = updater.optimizer, updater.scheduler
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        restore_updater(start, model, optimizer, scheduler, None)
        restore_rng(load_trainer_state(start).rng)
        apply_settings(optimizer, scheduler, settings)
    conversion = ConversionConfig.from_recipe(recipe)
    return TrainingController(updater, conversion, seed=recipe.trainer.seed), tokenizer


def apply_settings(optimizer: Any, scheduler: Any, settings: list[dict[str, Any]]) -> None:
    """The recipe's hyperparameters (lr, betas, weight decay, ...) over a restored
    optimizer, whose state_dict brought the original run's; the schedule continues from
    the restored step with the recipe's base rate. Without overrides this changes nothing."""
    for group, fresh in zip(optimizer.param_groups, settings, strict=True):
        group.update(fresh)
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _new_out_dir(run_dir: Path, from_step: int, to_step: int) -> Path:
    """RUN_DIR/replay-N-M, or -2, -3, ... so a second replay never overwrites the first."""
    base = run_dir / f"replay-{from_step}-{to_step}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = run_dir / f"replay-{from_step}-{to_step}-{n}"
    return path
