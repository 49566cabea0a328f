"""The tasks of a recipe: each with its own agent loop, data files and share of the batch.

Design: docs/production.md#tasks
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rltool.config.schema import (
    AgentLoopConfig,
    DataConfig,
    ReasoningGymConfig,
    RecipeConfig,
    TaskConfig,
)
from rltool.data.mapping import FieldMap, field_map
from rltool.data.reasoning_gym import PRESET as RG_PRESET
from rltool.data.reasoning_gym import generator_rows

# the loops that score reasoning-gym rows by their generator (agent_loops/gsm8k.py)
RG_LOOPS = ("gsm8k",)
# the option of ``agent_loop.options`` that names the task; the loop never sees it
TASK_NAME_OPTION = "task_name"


@dataclass
class TaskSpec:
    """One task, resolved from the recipe."""

    name: str  # the RolloutState.task_name of its samples
    weight: float  # share of each step's groups
    loop: AgentLoopConfig  # which agent loop and its options
    train_files: list[str]
    eval_files: list[str]
    where: str = "agent_loop"  # the recipe key it came from, for error messages
    fields: FieldMap = field(default_factory=FieldMap)  # where a record's fields come from
    # preset reasoning_gym: the rows come from this generator, not from files
    generator: ReasoningGymConfig | None = None

    @property
    def sources(self) -> str:
        """What the rows come from, for messages: the files, or the generator."""
        if self.generator is not None:
            return f"generator {RG_PRESET}:{self.generator.dataset}"
        return f"files {self.train_files}"


def default_task_name(loop: AgentLoopConfig) -> str:
    """``options.task_name`` if set, else the loop's name."""
    return str(loop.options.get(TASK_NAME_OPTION, loop.name))


def task_specs(recipe: RecipeConfig) -> list[TaskSpec]:
    """``recipe.tasks``, or one spec from ``agent_loop`` + ``data.*`` when that list is empty."""
    if not recipe.tasks:
        generated = _generator(recipe.data) is not None  # data.*_files are not read
        single = TaskSpec(
            name=default_task_name(recipe.agent_loop),
            weight=1.0,
            loop=recipe.agent_loop,
            train_files=[] if generated else list(recipe.data.train_files),
            eval_files=[] if generated else list(recipe.data.eval_files),
            where="agent_loop",
            fields=_fields(recipe.data, "data"),
            generator=_generator(recipe.data),
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
                fields=_fields(t, f"tasks[{i}]") if _maps(t) else _fields(recipe.data, "data"),
                generator=_generator(t) if _maps(t) else _generator(recipe.data),
            )
            for i, t in enumerate(recipe.tasks)
        ]
    check_specs(specs, recipe.algorithm.task_adv_weight)
    return specs


def _maps(c: TaskConfig) -> bool:
    return any((c.preset, c.prompt_key, c.answer_key, c.task_key))


def _fields(c: DataConfig | TaskConfig, where: str) -> FieldMap:
    return field_map(c.preset, c.prompt_key, c.answer_key, c.task_key, where)


def _generator(c: DataConfig | TaskConfig) -> ReasoningGymConfig | None:
    return c.reasoning_gym if c.preset == RG_PRESET else None


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
        option_name = s.loop.options.get(TASK_NAME_OPTION)
        if s.where != "agent_loop" and option_name is not None and option_name != s.name:
            raise ValueError(
                f"{s.where}.agent_loop.options.task_name is {option_name!r} but the task is "
                f"named {s.name!r}; drop the option (the task name is used)"
            )
        files = "data" if s.where == "agent_loop" else s.where
        if s.generator is not None and s.where != "agent_loop" and s.train_files + s.eval_files:
            raise ValueError(
                f"{s.where} has preset reasoning_gym and data files: the rows come from "
                f"{s.where}.reasoning_gym; drop {s.where}.train_files and eval_files"
            )
        if s.generator is not None and s.loop.name not in RG_LOOPS:
            loop_key = "agent_loop" if s.where == "agent_loop" else f"{s.where}.agent_loop"
            raise ValueError(
                f"{files}.preset reasoning_gym needs {loop_key}.name gsm8k (the loop that "
                f"scores a generator's rows with its score_answer), got {s.loop.name!r}"
            )
        if s.generator is None and not s.train_files:
            raise ValueError(
                f"{files}.train_files is empty: task {s.name!r} needs at least one training file"
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


# what a run keeps of one data file: (spec, path, its records after where each is, eval?)
FileFit = Callable[[TaskSpec, str, list[tuple[str, dict]], bool], list[dict]]


def load_task_data(
    recipe: RecipeConfig, fit: FileFit | None = None
) -> dict[str, tuple[list[dict], list[dict]]]:
    """Task name -> (train rows, eval rows cut to ``data.eval_limit``); ``fit`` chooses the
    rows kept of each file (default: all; ``produce/prompt_fit.py``: those that fit)."""
    out: dict[str, tuple[list[dict], list[dict]]] = {}
    limit = recipe.data.eval_limit
    for spec in task_specs(recipe):
        train = _load(spec, spec.train_files, fit, evaluation=False)
        if not train:
            raise ValueError(f"task {spec.name!r}: the training {spec.sources} hold no records")
        evals = _load(spec, spec.eval_files, fit, evaluation=True)
        out[spec.name] = (train, evals[:limit] if limit else evals)
    return out


def _load(spec: TaskSpec, files: list[str], fit: FileFit | None, evaluation: bool) -> list[dict]:
    from rltool.data import load_located  # lazy: builtin paths pull in the model stack

    if spec.generator is not None:
        located = generator_located(spec, evaluation)
        name = f"{RG_PRESET}:{spec.generator.dataset}"  # what prompt_fit's report names
        return [r for _, r in located] if fit is None else fit(spec, name, located, evaluation)
    rows: list[dict] = []
    for path in files:
        located = load_located([path], spec.fields)
        rows += [r for _, r in located] if fit is None else fit(spec, path, located, evaluation)
    return rows


def generator_located(spec: TaskSpec, evaluation: bool) -> list[tuple[str, dict]]:
    """A generator task's rows of one split, each after where it comes from."""
    assert spec.generator is not None
    where = "data" if spec.where == "agent_loop" else spec.where
    return generator_rows(spec.generator, where, evaluation)
