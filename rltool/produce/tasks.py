"""Tasks of a recipe: each with its own agent loop, data and share of the batch.

A recipe either lists ``tasks:`` or, when that list is empty, is one task built
from ``agent_loop`` + ``data.train_files``/``data.eval_files`` and named after
the loop's own default task name (``"gsm8k"`` for the gsm8k loop, or the loop's
``options.task_name``). Every sample a task's loop produces carries
``task_name == spec.name``: that name keys ``algorithm.task_adv_weight``, the
per-task metrics (``task/<name>/...``) and the per-task evaluation
(``eval/<name>/...``).

Prompts come from one ``PromptSampler`` per task; each step's groups are split
between tasks by weight with ``allocate`` (floor, then largest remainder).
A single-task recipe draws exactly the prompts ``PromptSampler(seed)`` did.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rltool.agent_loops.base import AgentLoop, get_agent_loop
from rltool.config.schema import AgentLoopConfig, RecipeConfig
from rltool.produce.allocation import allocate
from rltool.produce.sampler import PromptSampler
from rltool.rollout.state import RolloutState

# eval metrics that add up over tasks; every other eval metric is a per-row mean
_EVAL_SUM_KEYS = frozenset({"eval/n", "eval/reward_errors"})


@dataclass
class TaskSpec:
    """One task, resolved from the recipe."""

    name: str  # the RolloutState.task_name of its samples
    weight: float  # share of each step's groups
    loop: AgentLoopConfig  # which agent loop and its options
    train_files: list[str]
    eval_files: list[str]
    where: str = "agent_loop"  # the recipe key it came from, for error messages


# --- specs ----------------------------------------------------------------------------


def default_task_name(loop: AgentLoopConfig) -> str:
    """``options.task_name`` if set, else the default of the loop's ``task_name`` argument."""
    if "task_name" in loop.options:
        return str(loop.options["task_name"])
    param = _task_name_param(get_agent_loop(loop.name))
    if param is None or param.default is inspect.Parameter.empty:
        raise ValueError(
            f"agent loop {loop.name!r} has no default task name; set "
            "agent_loop.options.task_name, or list the task under `tasks:` with a name"
        )
    return str(param.default)


def task_specs(recipe: RecipeConfig) -> list[TaskSpec]:
    """``recipe.tasks``, or one spec from ``agent_loop`` + ``data.*`` when that list is empty."""
    if not recipe.tasks:
        single = TaskSpec(
            name=default_task_name(recipe.agent_loop),
            weight=1.0,
            loop=recipe.agent_loop,
            train_files=list(recipe.data.train_files),
            eval_files=list(recipe.data.eval_files),
            where="agent_loop",
        )
        specs = [single]
    else:
        specs = [
            TaskSpec(
                name=t.name,
                weight=float(t.weight),
                loop=t.agent_loop,
                train_files=list(t.train_files),
                eval_files=list(t.eval_files),
                where=f"tasks[{i}]",
            )
            for i, t in enumerate(recipe.tasks)
        ]
    check_specs(specs, recipe.algorithm.task_adv_weight)
    return specs


def check_specs(specs: Sequence[TaskSpec], task_adv_weight: Mapping[str, float]) -> None:
    """ValueError naming the recipe key for a task list that cannot train."""
    seen: dict[str, str] = {}
    for s in specs:
        if not s.name or "/" in s.name or s.name != s.name.strip():
            raise ValueError(
                f"{s.where}.name must be a non-empty name without '/' or surrounding "
                f"spaces (it becomes the metric prefix task/<name>/), got {s.name!r}"
            )
        if s.name in seen:
            raise ValueError(
                f"{s.where}.name {s.name!r} is also the name of {seen[s.name]}; task names "
                "must be unique"
            )
        seen[s.name] = s.where
        option_name = s.loop.options.get("task_name")
        if s.where != "agent_loop" and option_name is not None and option_name != s.name:
            raise ValueError(
                f"{s.where}.agent_loop.options.task_name is {option_name!r} but the task is "
                f"named {s.name!r}; drop the option (the task name is used)"
            )
        if not s.train_files:
            key = "data.train_files" if s.where == "agent_loop" else f"{s.where}.train_files"
            raise ValueError(f"{key} is empty: task {s.name!r} needs at least one training file")
        if not (math.isfinite(s.weight) and s.weight >= 0):
            raise ValueError(
                f"{s.where}.weight of task {s.name!r} must be finite and >= 0, got {s.weight}"
            )
    if all(s.weight == 0 for s in specs):
        raise ValueError(
            f"every task weight is 0 ({', '.join(s.name for s in specs)}); give at least one "
            "task a weight > 0"
        )
    known = ", ".join(s.name for s in specs)
    for name in task_adv_weight:
        if name not in seen:
            raise ValueError(
                f"algorithm.task_adv_weight names task {name!r}, which the recipe does not "
                f"have; known tasks: {known}"
            )


# --- loops and data -------------------------------------------------------------------


def _task_name_param(loop_cls: type[AgentLoop]) -> inspect.Parameter | None:
    return inspect.signature(loop_cls.__init__).parameters.get("task_name")


def build_task_loops(recipe: RecipeConfig, engine: Any, tokenizer: Any) -> dict[str, AgentLoop]:
    """Task name -> its agent loop, built so that every sample carries ``task_name=name``."""
    loops: dict[str, AgentLoop] = {}
    for spec in task_specs(recipe):
        loop_cls = get_agent_loop(spec.loop.name)
        if _task_name_param(loop_cls) is None:
            raise ValueError(
                f"{spec.where}: agent loop {spec.loop.name!r} takes no task_name argument, so "
                f"its samples cannot be labelled {spec.name!r}; give its __init__ a "
                "`task_name: str` that it writes into every RolloutState"
            )
        options = {**spec.loop.options, "task_name": spec.name}
        # from_recipe keeps any loop-specific construction; it reads recipe.agent_loop
        task_recipe = dataclasses.replace(
            recipe, agent_loop=AgentLoopConfig(name=spec.loop.name, options=options)
        )
        try:
            loops[spec.name] = loop_cls.from_recipe(task_recipe, engine=engine, tokenizer=tokenizer)
        except ValueError as exc:
            if spec.where == "agent_loop":
                raise
            raise ValueError(f"{spec.where} (task {spec.name!r}): {exc}") from exc
    return loops


def load_task_data(recipe: RecipeConfig) -> dict[str, tuple[list[dict], list[dict]]]:
    """Task name -> (train rows, eval rows cut to ``data.eval_limit``)."""
    from rltool.data import load_examples  # lazy: builtin paths pull in the model stack

    out: dict[str, tuple[list[dict], list[dict]]] = {}
    limit = recipe.data.eval_limit
    for spec in task_specs(recipe):
        train = load_examples(spec.train_files)
        if not train:
            raise ValueError(
                f"task {spec.name!r}: the training files {spec.train_files} hold no records"
            )
        evals = load_examples(spec.eval_files)
        out[spec.name] = (train, evals[:limit] if limit else evals)
    return out


# --- prompt sampling ------------------------------------------------------------------


def task_seed_offset(name: str, n_tasks: int) -> int:
    """Seed offset of a task's prompt order: 0 for a lone task (the pre-multi-task order),
    else a hash of its name, so listing tasks in another order keeps each task's prompts."""
    return 0 if n_tasks == 1 else zlib.crc32(name.encode("utf-8"))


class TaskSampler:
    """One ``PromptSampler`` per task; each ``take`` splits the groups by weight."""

    def __init__(
        self,
        specs: Sequence[TaskSpec],
        train_rows: Mapping[str, list[dict]],
        seed: int,
        shuffle: bool,
    ) -> None:
        missing = [s.name for s in specs if s.name not in train_rows]
        if missing:
            raise ValueError(f"no training rows given for task(s) {missing}")
        self.weights = {s.name: s.weight for s in specs}
        self.rows = {s.name: train_rows[s.name] for s in specs}
        self.samplers: dict[str, PromptSampler] = {}
        for s in specs:
            if not self.rows[s.name]:
                raise ValueError(f"task {s.name!r} has no training rows")
            seed_s = seed + task_seed_offset(s.name, len(specs))
            self.samplers[s.name] = PromptSampler(len(self.rows[s.name]), seed_s, shuffle)

    def take(self, n_groups: int) -> list[tuple[str, int, dict]]:
        """(task name, row index, row) for the next ``n_groups`` prompts, tasks in spec order."""
        out: list[tuple[str, int, dict]] = []
        for name, k in allocate(n_groups, self.weights).items():
            rows = self.rows[name]
            out.extend((name, i, rows[i]) for i in self.samplers[name].take(k))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": {name: s.state_dict() for name, s in self.samplers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "tasks" not in state and len(self.samplers) == 1:
            # a checkpoint from before multi-task: one PromptSampler's state
            state = {"tasks": {next(iter(self.samplers)): state}}
        saved = state["tasks"]
        if set(saved) != set(self.samplers):
            raise ValueError(
                f"checkpoint was taken with tasks {sorted(saved)}, the recipe now has "
                f"{sorted(self.samplers)}; resume with the same tasks"
            )
        for name, sampler in self.samplers.items():
            try:
                sampler.load_state_dict(saved[name])
            except ValueError as exc:
                raise ValueError(f"task {name!r}: {exc}") from exc


# --- metrics --------------------------------------------------------------------------


def per_task_metrics(groups: Sequence[Sequence[RolloutState]]) -> dict[str, float]:
    """``task/<name>/{reward_mean,accuracy,samples,truncated_frac}`` over generated samples.

    ``accuracy`` is the mean of ``reward["correct"]`` over the samples whose reward
    has it, present only when some do; ``reward_mean`` is NaN when no sample has a score.
    """
    by_task: dict[str, list[RolloutState]] = {}
    for g in groups:
        for s in g:
            by_task.setdefault(s.task_name, []).append(s)
    out: dict[str, float] = {}
    for name, samples in by_task.items():
        p = f"task/{name}"
        scores = np.array([s.score for s in samples if s.score is not None], dtype=np.float64)
        correct = np.array(
            [float(s.reward["correct"]) for s in samples if s.reward and "correct" in s.reward],
            dtype=np.float64,
        )
        truncated = np.array([s.finish_reason == "length" for s in samples], dtype=np.float64)
        out[f"{p}/reward_mean"] = float(scores.mean()) if scores.size else math.nan
        if correct.size:
            out[f"{p}/accuracy"] = float(correct.mean())
        out[f"{p}/samples"] = float(len(samples))
        out[f"{p}/truncated_frac"] = float(truncated.mean())
    return out


EvaluateFn = Callable[[str, list[dict], Any], dict[str, float]]


def evaluate_tasks(
    evaluate_fn: EvaluateFn,
    specs: Sequence[TaskSpec],
    eval_rows: Mapping[str, list[dict]],
    sampling: Any,
) -> dict[str, float]:
    """Per-task ``eval/<task>/<metric>`` plus the overall ``eval/<metric>``.

    ``evaluate_fn(task_name, rows, sampling)`` returns a loop's ``eval/*`` dict. The
    overall figure of a metric every task reports is its mean weighted by eval rows
    (``eval/n`` and ``eval/reward_errors`` are summed). Tasks without eval rows are skipped.
    """
    per_task: dict[str, tuple[int, dict[str, float]]] = {}
    for spec in specs:
        rows = eval_rows.get(spec.name, [])
        if rows:
            per_task[spec.name] = (len(rows), evaluate_fn(spec.name, rows, sampling))
    if not per_task:
        raise ValueError("no task has evaluation rows; set data.eval_files or tasks[*].eval_files")
    out: dict[str, float] = {}
    for name, (_, metrics) in per_task.items():
        for key, value in metrics.items():
            out[f"eval/{name}/{key.removeprefix('eval/')}"] = value
    common = set.intersection(*(set(m) for _, m in per_task.values()))
    first = next(iter(per_task.values()))[1]
    total = sum(n for n, _ in per_task.values())
    for key in (k for k in first if k in common):
        values = [(n, m[key]) for n, m in per_task.values()]
        if key in _EVAL_SUM_KEYS:
            out[key] = float(sum(v for _, v in values))
        else:
            out[key] = float(sum(n * v for n, v in values) / total)
    return out
