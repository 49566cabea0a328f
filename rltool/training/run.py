"""The synchronous RL driver behind ``rltool train``.

One step: take the next prompts, generate ``group_size`` samples per prompt with
the current policy (canonicalized by the agent loop at generation time), hand
the groups to ``TrainingController.fit``, sync the engine to the new weights.
Evaluation, metrics, checkpoints and clean interruption wrap around that.
"""

from __future__ import annotations

import math
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltool.agent_loops.base import AgentLoop, get_agent_loop
from rltool.config.loader import load_recipe
from rltool.config.schema import RecipeConfig
from rltool.data import load_examples
from rltool.engines.hf import HFEngine
from rltool.models import load_model_and_tokenizer, resolve_builtin_data, resolve_model_path
from rltool.rollout.state import RolloutState
from rltool.training.checkpoint import (
    TrainerState,
    capture_rng,
    latest_checkpoint,
    load_trainer_state,
    restore_rng,
)
from rltool.training.controller import TrainingController
from rltool.training.convert import ConversionConfig
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.sampler import PromptSampler
from rltool.training.update import PolicyUpdater


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    """Everything one training run is built from, constructed from a recipe."""

    recipe: RecipeConfig
    model: Any
    tokenizer: Any
    engine: HFEngine
    loop: AgentLoop
    train_tasks: list[dict]
    eval_tasks: list[dict]
    sampler: PromptSampler
    controller: TrainingController
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def build_loop(recipe: RecipeConfig, engine: HFEngine, tokenizer: Any) -> AgentLoop:
    loop_cls = get_agent_loop(recipe.agent_loop.name)
    return loop_cls.from_recipe(recipe, engine=engine, tokenizer=tokenizer)


def build_run(recipe: RecipeConfig, with_trainer: bool = True) -> Run:
    seed_everything(recipe.trainer.seed)
    model, tokenizer, _device = load_model_and_tokenizer(recipe.model)
    engine = HFEngine(model, tokenizer, batch_size=recipe.rollout.batch_size)
    loop = build_loop(recipe, engine, tokenizer)
    train_tasks = load_examples([resolve_builtin_data(f) for f in recipe.data.train_files])
    eval_tasks = load_examples([resolve_builtin_data(f) for f in recipe.data.eval_files])
    if recipe.data.eval_limit:
        eval_tasks = eval_tasks[: recipe.data.eval_limit]
    sampler = PromptSampler(len(train_tasks), recipe.trainer.seed, recipe.data.shuffle)
    updater = None
    if with_trainer:
        optimizer = build_optimizer(model, recipe.optimizer, init_dir=_optimizer_init(recipe))
        scheduler = build_scheduler(optimizer, recipe.optimizer, total_steps=recipe.trainer.steps)
        ref_model = None
        if recipe.algorithm.kl_coef > 0:
            ref_model, _, _ = load_model_and_tokenizer(recipe.model)
            ref_model.eval().requires_grad_(False)
        updater = PolicyUpdater(
            model,
            optimizer,
            scheduler,
            recipe.algorithm,
            grad_clip=recipe.optimizer.grad_clip,
            ref_model=ref_model,
            temperature=recipe.rollout.sampling.temperature or 1.0,
            norm_len=recipe.rollout.sampling.max_new_tokens,  # Dr.GRPO's constant length
        )
    controller = TrainingController(updater, ConversionConfig.from_recipe(recipe))
    return Run(recipe, model, tokenizer, engine, loop, train_tasks, eval_tasks, sampler, controller)


def _optimizer_init(recipe: RecipeConfig) -> Path | None:
    """Warm-start optimizer moments shipped beside the weights, when asked for."""
    if not recipe.optimizer.init_from_checkpoint:
        return None
    return resolve_model_path(recipe.model.path)


def generate_step(run: Run) -> list[list[RolloutState]]:
    """Sample one step's groups with the current policy."""
    d = run.recipe.data
    indices = run.sampler.take(d.prompts_per_step)
    tasks = [run.train_tasks[i] for i in indices]
    # k keeps ids unique when a step crosses an epoch and draws a prompt twice
    group_ids = [f"s{run.step + 1}-g{k}-p{i}" for k, i in enumerate(indices)]
    return run.loop.generate_groups(tasks, d.group_size, group_ids)


def evaluate(run: Run) -> dict[str, float]:
    return run.loop.evaluate(run.eval_tasks, run.recipe.rollout.eval_sampling)


def rollout_metrics(run: Run, groups: list[list[RolloutState]]) -> dict[str, float]:
    """Reward and status figures over every generated sample, before filtering."""
    samples = [s for g in groups for s in g]
    scores = [s.score for s in samples if s.score is not None]
    failed = sum(s.status == "FAILED" for s in samples)
    truncated = sum(s.finish_reason == "length" for s in samples)
    return {
        **run.loop.pop_metrics(),
        "rollout/reward_mean": float(np.mean(scores)) if scores else math.nan,
        "rollout/samples": float(len(samples)),
        "rollout/failed": float(failed),
        "rollout/truncated_frac": truncated / max(len(samples), 1),
        "rollout/response_tokens_mean": float(
            np.mean([len(s.response_ids or []) for s in samples]) if samples else 0.0
        ),
    }


class StopRequest:
    """Ctrl-C / SIGTERM: finish the current step, save, exit. A second Ctrl-C aborts."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def trainer_state(run: Run) -> TrainerState:
    updater = run.controller.updater
    return TrainerState(
        step=run.step,
        optimizer=updater.optimizer.state_dict(),
        scheduler=updater.scheduler.state_dict(),
        data=run.sampler.state_dict(),
        rng=capture_rng(),
        extra={"history": run.history},
    )


def resume(run: Run, run_dir: Path) -> Path:
    """Load the newest checkpoint of ``run_dir`` into ``run``; returns its path."""
    ckpt = latest_checkpoint(run_dir)
    from safetensors.torch import load_model

    load_model(run.model, str(ckpt / "model.safetensors"))  # strict: every weight restored
    state = load_trainer_state(ckpt)
    updater = run.controller.updater
    updater.optimizer.load_state_dict(state.optimizer)
    updater.scheduler.load_state_dict(state.scheduler)
    run.sampler.load_state_dict(state.data)
    restore_rng(state.rng)
    run.step = state.step
    run.history = list(state.extra.get("history", []))
    run.engine.sync_weights(run.step)
    return ckpt


def generate_batch_from_recipe(path: str, overrides: list[str]):
    """One step's groups from a recipe's model and loop, for ``inspect-batch``."""
    recipe = load_recipe(path, overrides)
    run = build_run(recipe, with_trainer=False)
    groups = generate_step(run)
    return groups, run.tokenizer, ConversionConfig.from_recipe(recipe), run.step + 1
