"""The RL driver behind ``rltool train``: a run built from a recipe.

One step: the producer serves the step's groups, ``TrainingController.fit`` trains on
them, the producer hands the new weights to the rollout workers.
Design: docs/app.md#one-step-of-a-run
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltool.app.checkpoint import (
    Resumable,
    TrainerState,
    capture_rng,
    open_checkpoint,
    restore_rng,
    save_checkpoint,
)
from rltool.app.demo_model import ensure_builtin_models
from rltool.app.determinism import make_deterministic
from rltool.app.recipe_names import check_config
from rltool.app.sharded_checkpoint import (
    SHARDED,
    load_full_moments,
    restore_updater,
    write_sharded,
)
from rltool.app.trackers import check_trackers
from rltool.config.loader import load_recipe
from rltool.config.schema import RecipeConfig
from rltool.lora import AdapterFreeReference, apply_lora, require_peft
from rltool.models import (
    context_length,
    embedding_rows,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model_path,
)
from rltool.produce.backend import RolloutBackend
from rltool.produce.preflight import check_preflight
from rltool.produce.producer import Producer
from rltool.produce.prompt_fit import TooLong, fit_task_data
from rltool.produce.task_metrics import evaluate_tasks
from rltool.produce.task_sampler import TaskSampler
from rltool.produce.task_specs import TaskSpec, task_specs
from rltool.rollout.state import RolloutState
from rltool.training.controller import TrainingController
from rltool.training.convert import ConversionConfig
from rltool.training.optim import OPTIMIZER_FILE, build_optimizer, build_scheduler
from rltool.training.sharding import (
    Shard,
    announce,
    check_distributed,
    close_shard,
    copy_full_weights,
    init_shard,
    ready,
    shard_model,
)
from rltool.training.updater import PolicyUpdater


def seed_everything(seed: int, deterministic: bool = False, threads: int | None = None) -> None:
    """Python's, numpy's and torch's generators from ``trainer.seed``; with
    ``trainer.deterministic``, deterministic kernels too (app/determinism.py);
    ``trainer.threads`` torch threads (None: as they are)."""
    if deterministic:
        make_deterministic()
    if threads is not None:
        torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    """Everything one training run is built from, constructed from a recipe."""

    recipe: RecipeConfig
    model: Any
    tokenizer: Any
    specs: list[TaskSpec]
    eval_rows: dict[str, list[dict]]
    producer: Producer
    controller: TrainingController
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    # several processes (FSDP2): this leader's group, and the full copy generation runs on
    shard: Shard | None = None
    rollout_model: Any = None
    too_long: TooLong = field(default_factory=TooLong)  # prompts left out (data.too_long)

    def close(self) -> None:
        self.producer.close()
        if self.shard is not None:
            tell(self, "stop")
            ready(self.shard)  # every rank tears gloo down together (one alone can abort another)
            close_shard(self.shard)


def tell(run: Run, kind: str, arg: Any = None) -> None:
    """The leader's message to the other ranks (app/distributed.py ``follow``): fit,
    weights, save, load, stop; nothing when the run has one process."""
    if run.shard is not None:
        announce(run.shard, (kind, arg))


def build_backend(recipe: RecipeConfig, model: Any, tokenizer: Any) -> RolloutBackend:
    """``rollout.backend``: in process (sharing or copying ``model``) or Ray actors."""
    if recipe.rollout.backend == "ray":
        from rltool.produce.ray_backend import RayBackend  # imports ray: only when asked for

        return RayBackend(recipe)
    from rltool.produce.inprocess import InProcessBackend

    return InProcessBackend(recipe, model=model, tokenizer=tokenizer)


def build_scorer(recipe: RecipeConfig, tokenizer: Any) -> Any:
    """The distillation teacher when ``distill.teacher_path`` is set, else None."""
    if not recipe.distill.teacher_path:
        return None
    from rltool.produce.teacher import TeacherScorer

    return TeacherScorer(
        recipe.distill, student_tokenizer=tokenizer, student_path=recipe.model.path
    )


def check_recipe(recipe: RecipeConfig) -> None:
    """The recipe can run here: ValueErrors naming the key and the fix, raised before
    anything heavy is loaded. Its values and names (loops, estimator, backend, filter, ...)
    first, as ``rltool train`` checks them (a recipe built in code has not been loaded)."""
    check_config(recipe)
    task_specs(recipe)  # the task list
    check_preflight(task_specs(recipe))  # loops' programs and packages, data files and fields
    check_trackers(recipe.logging)  # logging.trackers: known, their packages installed
    check_distributed(recipe.distributed)
    if recipe.model.lora.enabled:
        check_lora_recipe(recipe)


def check_lora_recipe(recipe: RecipeConfig) -> None:
    """``model.lora``: peft installed; no warm-start moments (they are the full model's)."""
    require_peft()
    if recipe.optimizer.init_from_checkpoint:
        raise ValueError(
            "optimizer.init_from_checkpoint: the moments shipped beside model.path are for "
            "the full model, not LoRA adapters; set it to false with model.lora.enabled"
        )
    dist = recipe.distributed
    if dist.nproc_per_node * dist.nnodes > 1:
        raise ValueError(
            "model.lora.enabled: LoRA trains in one process for now; set "
            "distributed.nproc_per_node=1 and distributed.nnodes=1 (or turn LoRA off)"
        )


def build_run(recipe: RecipeConfig, with_trainer: bool = True) -> Run:
    """Every part of a run; names and data files are checked before the model loads."""
    check_recipe(recipe)
    specs = task_specs(recipe)
    shard = init_shard(recipe.distributed) if with_trainer else None
    ensure_builtin_models(recipe.model.path, recipe.distill.teacher_path)
    ready(shard)  # the other ranks load the model once it is built
    # prompts counted with the run's tokenizer and the model's context, before it loads
    data, too_long = fit_task_data(
        recipe, load_tokenizer(recipe.model), context_length(recipe.model)
    )
    seed_everything(recipe.trainer.seed, recipe.trainer.deterministic, recipe.trainer.threads)
    model, tokenizer, _device = load_model_and_tokenizer(recipe.model)
    if recipe.model.lora.enabled:  # only the adapters train (rltool/lora.py)
        model = apply_lora(model, recipe.model.lora)
    rollout_model = None
    if shard is not None:  # generation keeps a full copy; the trainer's is sharded
        rollout_model = model.requires_grad_(False)
        model = trainer_model(copy.deepcopy(model).requires_grad_(True), recipe, shard)
    sampler = TaskSampler(
        specs,
        {name: rows[0] for name, rows in data.items()},
        recipe.trainer.seed,
        recipe.data.shuffle,
    )
    backend = build_backend(recipe, rollout_model or model, tokenizer)
    producer = Producer(recipe, backend, sampler, scorer=build_scorer(recipe, tokenizer))
    updater = build_updater(recipe, model, shard) if with_trainer else None
    conversion = ConversionConfig.from_recipe(recipe, vocab_size=embedding_rows(model))
    controller = TrainingController(updater, conversion, seed=recipe.trainer.seed)
    eval_rows = {name: rows[1] for name, rows in data.items()}
    run = Run(recipe, model, tokenizer, specs, eval_rows, producer, controller)
    run.shard, run.rollout_model, run.too_long = shard, rollout_model, too_long
    return run


def trainer_model(model: Any, recipe: RecipeConfig, shard: Shard | None) -> Any:
    """The model as the trainer holds it: sharded with FSDP2 on several processes."""
    return model if shard is None else shard_model(model, recipe.distributed)


def build_updater(recipe: RecipeConfig, model: Any, shard: Shard | None = None) -> PolicyUpdater:
    """The updater of ``model`` (already sharded when ``shard`` is set)."""
    init_dir = _optimizer_init(recipe)
    # a sharded optimizer takes the one-process moments by parameter name
    optimizer = build_optimizer(model, recipe.optimizer, init_dir if shard is None else None)
    if shard is not None and init_dir is not None:
        load_full_moments(model, optimizer, init_dir / OPTIMIZER_FILE)
    scheduler = build_scheduler(optimizer, recipe.optimizer, total_steps=recipe.trainer.steps)
    ref_model = None
    if recipe.algorithm.kl_coef > 0 and recipe.model.lora.enabled:
        ref_model = AdapterFreeReference(model)  # the base: the policy with adapters off
    elif recipe.algorithm.kl_coef > 0:
        ref_model, _, _ = load_model_and_tokenizer(recipe.model)
        ref_model = trainer_model(ref_model.eval().requires_grad_(False), recipe, shard)
    return PolicyUpdater(
        model,
        optimizer,
        scheduler,
        recipe.algorithm,
        grad_clip=recipe.optimizer.grad_clip,
        ref_model=ref_model,
        temperature=recipe.rollout.sampling.temperature or 1.0,
        norm_len=recipe.rollout.sampling.max_new_tokens,  # Dr.GRPO's constant length
        distill=recipe.distill,  # coef of the distillation loss (packs with teacher targets)
        shard=shard,
        compile=recipe.trainer.compile,  # compiled decoder layers in the train step
    )


def _optimizer_init(recipe: RecipeConfig) -> Path | None:
    """Warm-start optimizer moments shipped beside the weights, when asked for."""
    if not recipe.optimizer.init_from_checkpoint:
        return None
    return resolve_model_path(recipe.model.path)


def generate_step(run: Run) -> list[list[RolloutState]]:
    """One step's groups from the producer (in sync mode: sampled with the current policy)."""
    return run.producer.produce(run.step + 1).groups


def evaluate(run: Run) -> dict[str, float]:
    """Every task's loop on its eval rows, on the rollout weights; one task keeps the plain
    ``eval/<metric>`` keys, several add ``eval/<task>/<metric>`` and row-weighted means."""
    backend = run.producer.backend
    sampling = run.recipe.rollout.eval_sampling
    if len(run.specs) == 1:
        name = run.specs[0].name
        return backend.evaluate(name, run.eval_rows[name], sampling)
    return evaluate_tasks(backend.evaluate, run.specs, run.eval_rows, sampling)


def trainer_state(run: Run, metrics_lines: int) -> TrainerState:
    """What a checkpoint holds besides the weights; ``metrics_lines``: lines of
    ``metrics.jsonl`` written so far (a resume cuts the file back to them)."""
    updater = run.controller.updater
    return TrainerState(
        step=run.step,
        # several processes: the optimizer is saved in shards beside the model
        optimizer=updater.optimizer.state_dict() if run.shard is None else SHARDED,
        scheduler=updater.scheduler.state_dict(),
        rng=capture_rng(),
        extra={"history": run.history, "metrics_lines": metrics_lines},
        producer=run.producer.state_dict(),
    )


def sync_weights(run: Run, force: bool = False) -> None:
    """The trained weights to the rollout workers; several processes gather them into the
    leader's full copy one parameter at a time first."""
    if run.shard is None:
        run.producer.update_weights(run.model, run.step, force=force)
        return
    tell(run, "weights")
    copy_full_weights(run.model, run.rollout_model)
    run.producer.update_weights(run.rollout_model, run.step, force=force)


def save(run: Run, ckpt_root: Path, state: TrainerState) -> Path:
    """A checkpoint of ``run``: sharded (every rank writes its part) on several processes."""
    if run.shard is None:
        return save_checkpoint(ckpt_root, run.model, run.tokenizer, state)
    optimizer = run.controller.updater.optimizer

    def write(tmp: Path) -> None:
        tell(run, "save", str(tmp))
        write_sharded(tmp, run.model, optimizer, run.shard)

    return save_checkpoint(ckpt_root, run.model, run.tokenizer, state, write_model=write)


def resume(run: Run, run_dir: Path) -> Resumable:
    """Load the newest complete, loadable checkpoint of ``run_dir`` into ``run``, whichever
    number of processes saved it; newer damaged ones are skipped (``Resumable.skipped``)."""
    updater = run.controller.updater

    def load_weights(ckpt: Path) -> None:  # strict: every weight restored
        tell(run, "load", str(ckpt))
        restore_updater(ckpt, run.model, updater.optimizer, updater.scheduler, run.shard)

    # several processes: the manifest chooses, then every rank loads that one
    found = open_checkpoint(run_dir, load_weights if run.shard is None else None)
    if run.shard is not None:
        load_weights(found.path)
    state = found.state
    run.step = state.step
    # the rollout workers take the restored weights before any prompt is resubmitted
    sync_weights(run, force=True)
    run.producer.load_state_dict(state.producer)  # buffer, accounting, prompts in flight
    restore_rng(state.rng)
    run.history = list(state.extra.get("history", []))
    return found


def generate_batch_from_recipe(path: str, overrides: list[str]):
    """One step's groups from a recipe's model and loop, for ``inspect-batch``."""
    recipe = load_recipe(path, overrides)
    run = build_run(recipe, with_trainer=False)
    try:
        groups = generate_step(run)
    finally:
        run.close()
    conversion = ConversionConfig.from_recipe(recipe, vocab_size=embedding_rows(run.model))
    return groups, run.tokenizer, conversion, run.step + 1
