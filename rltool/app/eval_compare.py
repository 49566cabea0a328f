"""``rltool eval A B``: two checkpoints evaluated on the same prompts with the same seed,
and the paired difference B - A of each figure with its bootstrap interval. Pairing per
prompt takes the prompts' own difficulty out of the noise, so a smaller difference is
seen than two separate intervals would show.
Design: docs/app.md#comparing-two-checkpoints
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rltool.app.evaluate import EvalReport, TaskFigures, eval_recipe
from rltool.config.schema import RecipeConfig
from rltool.rollout.bootstrap import PairedDifference, paired_difference


class UnpairedError(ValueError):
    """A and B were not evaluated on the same prompts or n: no paired difference."""


@dataclass(slots=True)
class EvalComparison:
    a: EvalReport
    b: EvalReport
    # task ("overall" too when there are several tasks) -> figure ("pass@1") -> B - A
    differences: dict[str, dict[str, PairedDifference]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "differences": {
                task: {
                    name: {
                        "mean": d.mean,
                        "low": d.interval.low,
                        "high": d.interval.high,
                        "prompts": d.prompts,
                        "distinguishable": d.distinguishable,
                    }
                    for name, d in figs.items()
                }
                for task, figs in self.differences.items()
            },
        }


@dataclass(slots=True)
class EvalSource:
    recipe: RecipeConfig
    run_dir: Path | None
    checkpoint: Path | None


def paired_sources(
    a: Path, b: Path, overrides: Sequence[str], checkpoint: Path | None = None
) -> tuple[EvalSource, EvalSource]:
    """The recipes of A and B (overrides applied to both); B samples with A's
    ``trainer.seed``, so both draw the same random numbers. ``--checkpoint`` has no
    meaning with two sources: name checkpoint directories as A and B instead."""
    if checkpoint is not None:
        raise ValueError(
            "--checkpoint names the weights of one evaluation; to compare two checkpoints, "
            "give their directories: rltool eval runs/a/checkpoints/step_000003 runs/b"
        )
    recipe_a, run_a, ckpt_a = eval_recipe(a, overrides)
    recipe_b, run_b, ckpt_b = eval_recipe(b, [*overrides, f"trainer.seed={recipe_a.trainer.seed}"])
    return EvalSource(recipe_a, run_a, ckpt_a), EvalSource(recipe_b, run_b, ckpt_b)


def compare(a: EvalReport, b: EvalReport) -> EvalComparison:
    """B - A per prompt for every figure both have, per task (and overall when there are
    several tasks). UnpairedError when they were not evaluated on the same prompts and n."""
    if a.n != b.n:
        raise UnpairedError(f"A drew {a.n} samples per prompt and B {b.n}: pair equal --n")
    if a.rows != b.rows:
        differ = sorted(t for t in {*a.rows, *b.rows} if a.rows.get(t) != b.rows.get(t))
        raise UnpairedError(
            f"A and B evaluate different prompts (task {differ[0]!r}): a paired difference "
            "needs the same eval rows; give both the same data.eval_files and "
            "data.eval_limit as overrides"
        )
    pairs = list(zip(a.tasks, b.tasks, strict=True))
    if len(pairs) > 1:
        pairs.append((a.overall, b.overall))
    return EvalComparison(a, b, {fa.task: _differences(fa, fb) for fa, fb in pairs})


def _differences(fa: TaskFigures, fb: TaskFigures) -> dict[str, PairedDifference]:
    return {
        name: paired_difference(
            np.asarray(fa.figures[name].per_prompt), np.asarray(fb.figures[name].per_prompt)
        )
        for name in fa.figures
        if name in fb.figures
    }
