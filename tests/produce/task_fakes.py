"""Shared helpers of the task tests: task items, recipes that list them, specs, rows."""

from __future__ import annotations

from rltool.config.schema import AgentLoopConfig, RecipeConfig, TaskConfig
from rltool.produce.task_specs import TaskSpec


def task(name: str, weight: float = 1.0, loop: str = "gsm8k", **options) -> TaskConfig:
    return TaskConfig(
        name=name,
        weight=weight,
        agent_loop=AgentLoopConfig(name=loop, options=dict(options)),
        train_files=[f"{name}.jsonl"],
        eval_files=[],
    )


def recipe_with(*tasks: TaskConfig, adv: dict[str, float] | None = None) -> RecipeConfig:
    r = RecipeConfig(tasks=list(tasks))
    r.algorithm.task_adv_weight = dict(adv or {})
    return r


def spec(name: str, weight: float = 1.0) -> TaskSpec:
    return TaskSpec(name, weight, AgentLoopConfig(), [f"{name}.jsonl"], [])


def rows(n: int, tag: str = "q") -> list[dict]:
    return [{"question": f"{tag}{i}", "answer": str(i)} for i in range(n)]
