"""The step loop of ``rltool train``: produce, fit, hand over weights, evaluate, log,
checkpoint; what happens is told to a ``RunView``."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rltool import metric_names as mn
from rltool.agent_loops.evaluation import EvaluationFailed
from rltool.app.alarms import AlarmWatch, alarm_metrics, stopping
from rltool.app.checkpoint import NoCheckpointError, checkpoint_dirs, remove_partial_saves
from rltool.app.determinism import determinism_warnings
from rltool.app.failed_steps import (
    all_failed,
    failed_streak,
    new_failures,
    run_failures,
    stop_message,
    trained_nothing_message,
    trained_samples,
)
from rltool.app.faults import fault_point
from rltool.app.metrics_log import MetricsWriter, trim_metrics
from rltool.app.rollout_dumps import DumpSource, dumped_steps, write_step_dump
from rltool.app.run import (
    Run,
    build_run,
    evaluate,
    resume,
    save,
    sync_weights,
    tell,
    trainer_state,
)
from rltool.app.run_lock import LOCK_FILE, RunLock
from rltool.app.signals import StopRequest
from rltool.app.trackers import open_trackers
from rltool.app.view import RunView, SilentView
from rltool.config.loader import (
    RUN_CONFIG,
    config_changes,
    format_changes,
    load_recipe,
    recipe_to_yaml,
)
from rltool.config.schema import RecipeConfig
from rltool.engines.base import ServersDown


@dataclass(slots=True)
class TrainOutcome:
    run_dir: Path
    steps_done: int
    # "steps" | "time_budget" | "SIGINT" | "SIGTERM" | "failures" | "servers_down" | "alarm"
    stopped_by: str
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    failures: dict[str, int] = field(default_factory=dict)  # failed samples by reason, run-wide
    # why the run is not a success (it stopped on failures, or trained on no sample at
    # all); the CLI exits with failed_steps.EXIT_TRAINED_NOTHING
    failure: str | None = None
    saved: Path | None = None  # the checkpoint this process saved last (None: none)


def new_run_dir(recipe: RecipeConfig) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... so a second run never overwrites the first;
    created here (mkdir claims a name atomically: two runs started at once differ)."""
    root = Path(recipe.logging.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path, n = root / recipe.logging.name, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = root / f"{recipe.logging.name}-{n}"


def train(
    recipe: RecipeConfig,
    resume_dir: Path | None = None,
    dump_rollouts: bool = False,
    view: RunView | None = None,
) -> TrainOutcome:
    """The run, in its directory locked against a second writer (``RunInUseError``, raised
    before the model loads); Ctrl-C / SIGTERM at any moment from here on end it cleanly."""
    view = view or SilentView()
    run_dir = resume_dir if resume_dir is not None else new_run_dir(recipe)
    stop = StopRequest()
    with RunLock(run_dir), stop.installed():
        if resume_dir is None:  # a stop before step 1 leaves a run --resume starts again
            (run_dir / RUN_CONFIG).write_text(recipe_to_yaml(recipe))
        view.phase("checking the recipe, then loading model and data")
        try:
            run = build_run(recipe)
        except BaseException:
            if resume_dir is None:  # nothing of this run exists but its config
                _remove_unstarted(run_dir)
            raise
        if run.too_long.files:
            view.note(run.too_long.message())
        try:
            return _train(run, recipe, run_dir, resume_dir is not None, dump_rollouts, view, stop)
        finally:
            run.close()


def _remove_unstarted(run_dir: Path) -> None:
    if {p.name for p in run_dir.iterdir()} <= {RUN_CONFIG, LOCK_FILE}:
        shutil.rmtree(run_dir, ignore_errors=True)


def _train(
    run: Run,
    recipe: RecipeConfig,
    run_dir: Path,
    resumed: bool,
    dump_rollouts: bool,
    view: RunView,
    stop: StopRequest,
) -> TrainOutcome:
    view.show_staleness = recipe.produce.mode == "async"
    for warning in determinism_warnings(recipe):
        view.note(warning)
    evals = _resume(run, recipe, run_dir, view) if resumed else None
    # a run that dumped goes on dumping when resumed (replay and the drills need every step)
    dump = (
        dump_rollouts or recipe.logging.dump_rollouts or (resumed and bool(dumped_steps(run_dir)))
    )
    writer = MetricsWriter(run_dir, open_trackers(run_dir, recipe))
    try:
        return _loop(run, run_dir, writer, view, dump, evals, stop)
    finally:
        writer.close()


def _resume(run: Run, recipe: RecipeConfig, run_dir: Path, view: RunView) -> list[dict] | None:
    """Load the checkpoint, cut metrics.jsonl back to it, record the config changes;
    returns the evaluation lines kept. A run stopped before its first checkpoint starts
    again from step 0 with its config (None: no evaluation kept)."""
    for partial in remove_partial_saves(run_dir):  # the lock is ours: no save in progress
        view.note(f"removed {partial.name}, a save that did not finish")
    if not checkpoint_dirs(run_dir):
        view.note(f"no checkpoint yet in {run_dir}: starting from step 0 with its config")
        trim_metrics(run_dir, 0)
        _record_resume(run, recipe, run_dir, view, None, [])
        return None
    try:
        found = resume(run, run_dir)
    except NoCheckpointError as exc:  # every checkpoint damaged: the way to start again
        raise NoCheckpointError(f"{exc}: rltool train {run_dir / RUN_CONFIG}") from exc
    for line in found.skipped:
        view.note(f"skipped {line}")
    view.note(f"resumed from {found.path} at step {run.step}")
    kept = trim_metrics(run_dir, found.state.extra["metrics_lines"])
    _record_resume(run, recipe, run_dir, view, found.path.name, found.skipped)
    return [x for x in kept if x.get("kind") == "eval"]


def _record_resume(
    run: Run,
    recipe: RecipeConfig,
    run_dir: Path,
    view: RunView,
    checkpoint: str | None,
    skipped: list[str],
) -> None:
    """The config changes shown and kept, the resume appended to resumes.jsonl."""
    changes = config_changes(load_recipe(run_dir / RUN_CONFIG), recipe)
    if changes:
        view.note(
            f"config changed on resume (key: run value -> new value):\n{format_changes(changes)}"
        )
        (run_dir / RUN_CONFIG).write_text(recipe_to_yaml(recipe))
    record = {
        "step": run.step,
        "checkpoint": checkpoint,
        "skipped": skipped,
        "changes": {key: [old, new] for key, old, new in changes},
    }
    with (run_dir / "resumes.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=repr) + "\n")
    if run.step >= recipe.trainer.steps:
        view.note(
            f"the run has already reached trainer.steps={recipe.trainer.steps}; "
            "give trainer.steps=N to train on"
        )


def _evaluate(run: Run, writer: MetricsWriter, view: RunView) -> dict[str, float]:
    t0 = time.perf_counter()
    metrics = evaluate(run)
    metrics[mn.TIME_EVAL] = time.perf_counter() - t0
    writer.write(run.step, metrics, kind="eval")
    view.eval_line(run.step, metrics)
    return metrics


def _evaluate_or_stop(
    run: Run, writer: MetricsWriter, view: RunView
) -> tuple[dict[str, float] | None, str | None]:
    """A mid-run or final evaluation: (metrics, None), or (None, why) when every sample
    failed, so that the run stops and still saves what it trained."""
    try:
        return _evaluate(run, writer, view), None
    except EvaluationFailed as exc:
        return None, str(exc)


def _scores(line: dict) -> dict[str, float]:
    return {k: v for k, v in line.items() if "/" in k}


def _step(
    run: Run, run_dir: Path, view: RunView, dump: bool
) -> tuple[dict[str, float], list, list, str | None]:
    """One train step: the producer's batch, fit, then the new weights to the workers;
    returns the metrics, the groups the trainer skipped, the step's FAILED groups, and
    why no rollout server is left to take the weights (None: the weights went out)."""
    t_step = time.perf_counter()
    produced = run.producer.produce(run.step + 1)
    t_gen = time.perf_counter() - t_step
    fault_point("generate", run.step + 1)
    view.rollout_errors(run.producer.errors, run.producer.backend.pop_deaths())
    groups = produced.groups
    if dump:  # the FAILED groups too, with their errors: what explains a bad step
        source = DumpSource(run.recipe.model.path, len(run.tokenizer))
        write_step_dump(run_dir, run.step + 1, run.step, groups, produced.failed_groups, source)
    # the step being taken is run.step + 1: tokens sampled from the current weights
    # (version run.step) have staleness 0, as the contract's section 6 says
    train_start = time.time()
    tell(run, "fit", (groups, run.step + 1))  # the other ranks train their share of it
    result = run.controller.fit(groups, train_step=run.step + 1)
    overlap = run.producer.generation_overlap(train_start, time.time())
    run.step += 1
    servers_down = None
    try:
        sync_weights(run)
    except ServersDown as exc:  # the step stays (metrics, final checkpoint); the run stops
        servers_down = str(exc)
    metrics = {**produced.metrics(), **result.metrics}
    if run.shard is not None:
        metrics["dist/world_size"] = float(run.shard.world_size)
    if run.recipe.trainer.deterministic:  # what a second run must match (docs/replay.md)
        metrics["dist/threads"] = float(torch.get_num_threads())
    metrics |= {mn.TIME_GENERATE: t_gen, mn.TIME_OVERLAP: overlap, **run.too_long.metrics()}
    metrics[mn.TIME_STEP] = time.perf_counter() - t_step
    return metrics, result.batch.skipped_groups, produced.failed_groups, servers_down


def _loop(
    run: Run,
    run_dir: Path,
    writer: MetricsWriter,
    view: RunView,
    dump: bool,
    evals: list[dict] | None,
    stop: StopRequest,
) -> TrainOutcome:
    """Steps until done. A resumed run (``evals``: the evaluation lines kept) evaluates
    no step twice: an evaluation at its checkpoint's step is already in metrics.jsonl.
    A stop (``stop``) is obeyed after the evaluation or step it arrives in."""
    cfg = run.recipe.trainer
    ckpt_root = run_dir / "checkpoints"
    if evals is None:  # not when the stop came while the run was being built
        first_eval = {} if stop.requested else _evaluate(run, writer, view)
        last_eval, last_eval_step = first_eval, run.step
        watch = AlarmWatch(cfg.alarms, [{"step": run.step, **first_eval}])
    else:
        first_eval, last_eval = (_scores(evals[0]), _scores(evals[-1])) if evals else ({}, {})
        last_eval_step = evals[-1]["step"] if evals else -1
        watch = AlarmWatch(cfg.alarms, evals)
    alarm = None  # the alarm that stopped the run (trainer.alarms.stop_on)
    stopped_by = stop.signal_name if stop.requested else "steps"
    eval_error, servers_down = None, None
    saved, saved_at = None, None
    first_step, unsaved_from = len(run.history), len(run.history)  # history index
    seen: set[str] = set()  # failure reasons shown in full already
    started = time.perf_counter()
    with view.progress(total=cfg.steps, done=run.step) as advance:
        while stopped_by == "steps" and run.step < cfg.steps:
            metrics, skipped, failed, servers_down = _step(run, run_dir, view, dump)
            run.history.append(metrics)
            fired, new = watch.step(run.history, run.step)
            metrics |= alarm_metrics(fired)
            writer.write(run.step, metrics, kind="train")
            view.step_line(run.step, metrics, skipped)
            for a in new:
                view.note(f"alarm {a.name} at step {run.step}: {a.message}")
            for reason, example in new_failures(failed, seen):
                view.failure(reason, example)
            advance()
            if servers_down is not None:
                stopped_by = "servers_down"
                break
            if failed_streak(run.history) >= cfg.max_failed_steps:
                stopped_by = "failures"
                break
            if (alarm := stopping(fired, cfg.alarms)) is not None:
                stopped_by = "alarm"
                break
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < cfg.steps:
                evaluated, eval_error = _evaluate_or_stop(run, writer, view)
                if evaluated is None:
                    stopped_by = "failures"
                    break
                last_eval, last_eval_step = evaluated, run.step
                watch.evaluated(run.step, evaluated)
            fault_point("train", run.step)
            # a step in which every sample failed changed nothing worth a checkpoint
            if cfg.save_every and run.step % cfg.save_every == 0 and not all_failed(metrics):
                state = trainer_state(run, writer.lines)
                saved = save(run, ckpt_root, state)
                saved_at, unsaved_from = (run.step, writer.lines), len(run.history)
            if stop.requested:
                stopped_by = stop.signal_name
                break
            if cfg.time_budget_s and time.perf_counter() - started > cfg.time_budget_s:
                stopped_by = "time_budget"
                break
    if stopped_by in ("steps", "time_budget") and last_eval_step != run.step:
        evaluated, eval_error = _evaluate_or_stop(run, writer, view)
        last_eval = evaluated if evaluated is not None else last_eval
    unsaved = run.history[unsaved_from:]
    if stopped_by in ("SIGINT", "SIGTERM") and len(run.history) == first_step:
        view.note(f"stopped by {stopped_by} before step {run.step + 1}: nothing new to save")
    elif not _saves_at_end(unsaved, stopped_by):
        newest = f"; the newest checkpoint is {saved}" if saved else ""
        view.note(f"no checkpoint saved for the last {len(unsaved)} steps (all failed){newest}")
    else:
        if saved_at != (run.step, writer.lines):  # not saved already with these very lines
            state = trainer_state(run, writer.lines)
            saved = save(run, ckpt_root, state)
        view.note(f"checkpoint saved: {saved}")
    outcome = TrainOutcome(run_dir, run.step, stopped_by, first_eval, last_eval, saved=saved)
    outcome.failures = run_failures(run.history)
    if eval_error is not None:
        outcome.stopped_by, outcome.failure = "failures", eval_error
    elif stopped_by == "servers_down":
        outcome.failure = f"stopped after step {run.step}: {servers_down}"
    elif stopped_by == "failures":
        outcome.failure = stop_message(failed_streak(run.history), outcome.failures)
    elif alarm is not None:
        outcome.failure = (
            f"stopped after step {run.step} by the alarm {alarm.name} "
            f"(trainer.alarms.stop_on): {alarm.message}"
        )
    elif len(run.history) > first_step and trained_samples(run.history) == 0:
        outcome.failure = trained_nothing_message(len(run.history), outcome.failures)
    view.summary(outcome, run.history)
    return outcome


def _saves_at_end(unsaved: list[dict[str, float]], stopped_by: str) -> bool:
    """The final save, unless every step since the last one (or the start) trained nothing
    because its samples failed: nothing new to keep, and a resume redoes those steps.
    A stop by signal always saves (exit 130/143 promise a checkpoint)."""
    if stopped_by in ("SIGINT", "SIGTERM") or not unsaved:
        return True
    return not all(all_failed(m) for m in unsaved)
