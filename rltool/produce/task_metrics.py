"""Per-task figures: ``task/<name>/...`` over generated samples, and the per-task
evaluation ``eval/<name>/...`` with its overall ``eval/...`` summary."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rltool.metric_names import (
    EVAL_ACCURACY,
    EVAL_ACCURACY_CI_HIGH,
    EVAL_ACCURACY_CI_LOW,
    EVAL_FAILED,
    EVAL_FAILURES,
    EVAL_N,
    EVAL_REWARD_ERRORS,
    eval_of_task,
)
from rltool.produce.task_specs import TaskSpec
from rltool.rollout.state import RolloutState

# eval metrics that add up over tasks; every other eval metric is a per-row mean
_EVAL_SUM_KEYS = frozenset({EVAL_N, EVAL_REWARD_ERRORS, EVAL_FAILED})
_EVAL_INTERVAL_KEYS = (EVAL_ACCURACY_CI_LOW, EVAL_ACCURACY_CI_HIGH)  # combined, not averaged


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
    (``eval/n``, ``eval/reward_errors`` and ``eval/failed`` are summed); each failure reason
    ``eval/failures/<reason>`` is summed over the tasks that have it. Tasks without eval rows
    are skipped.
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
            out[eval_of_task(key, name)] = value
    common = set.intersection(*(set(m) for _, m in per_task.values()))
    first = next(iter(per_task.values()))[1]
    total = sum(n for n, _ in per_task.values())
    for key in (
        k
        for k in first
        if k in common and not k.startswith(EVAL_FAILURES) and k not in _EVAL_INTERVAL_KEYS
    ):
        values = [(n, m[key]) for n, m in per_task.values()]
        if key in _EVAL_SUM_KEYS:
            out[key] = float(sum(v for _, v in values))
        else:
            out[key] = float(sum(n * v for n, v in values) / total)
    reasons = dict.fromkeys(
        k for _, m in per_task.values() for k in m if k.startswith(EVAL_FAILURES)
    )
    for key in reasons:
        out[key] = float(sum(m.get(key, 0.0) for _, m in per_task.values()))
    if all(EVAL_ACCURACY_CI_LOW in m for _, m in per_task.values()):
        out.update(combined_interval([(n / total, m) for n, m in per_task.values()]))
    return out


def combined_interval(tasks: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """The interval of the row-weighted overall accuracy from each task's (weight, eval
    metrics): the tasks' rows are drawn independently, so each side's distance from the
    accuracy adds in quadrature, weighted (``sqrt(sum w_i^2 d_i^2)``); one task keeps its
    own interval exactly."""
    acc = sum(w * m[EVAL_ACCURACY] for w, m in tasks)
    below = math.sqrt(
        sum((w * (m[EVAL_ACCURACY] - m[EVAL_ACCURACY_CI_LOW])) ** 2 for w, m in tasks)
    )
    above = math.sqrt(
        sum((w * (m[EVAL_ACCURACY_CI_HIGH] - m[EVAL_ACCURACY])) ** 2 for w, m in tasks)
    )
    return {EVAL_ACCURACY_CI_LOW: acc - below, EVAL_ACCURACY_CI_HIGH: acc + above}
