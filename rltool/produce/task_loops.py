"""The agent loop of every task of a recipe, built on one engine and tokenizer."""

from __future__ import annotations

from typing import Any

from rltool.agent_loops.base import AGENT_LOOPS, AgentLoop, LoopContext
from rltool.config.schema import RecipeConfig
from rltool.engines.base import RolloutEngine
from rltool.produce.task_specs import TASK_NAME_OPTION, task_specs


def build_task_loops(
    recipe: RecipeConfig, engine: RolloutEngine, tokenizer: Any
) -> dict[str, AgentLoop]:
    """Task name -> its agent loop, whose samples carry ``task_name=name``.

    A loop's error in a ``tasks:`` list is prefixed with the item (``tasks[i] (task 'x')``).
    """
    loops: dict[str, AgentLoop] = {}
    for spec in task_specs(recipe):
        loop_cls = AGENT_LOOPS.get(spec.loop.name)
        options = {k: v for k, v in spec.loop.options.items() if k != TASK_NAME_OPTION}
        ctx = LoopContext(engine, tokenizer, recipe.rollout.sampling, task_name=spec.name)
        try:
            loops[spec.name] = loop_cls.from_config(options, ctx)
        except ValueError as exc:
            if spec.where == "agent_loop":
                raise
            raise ValueError(f"{spec.where} (task {spec.name!r}): {exc}") from exc
    return loops
