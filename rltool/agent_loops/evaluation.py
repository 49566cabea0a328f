"""Evaluation figures the loops share: failed samples by reason (``eval/failed``,
``eval/failures/<reason>``), the accuracy's bootstrap interval over the eval rows
(``eval/accuracy_ci_low``/``_high``), and the error an evaluation in which every sample
failed is.

Design: docs/agent-loops.md#evaluation
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rltool.metric_names import (
    EVAL_ACCURACY,
    EVAL_ACCURACY_CI_HIGH,
    EVAL_ACCURACY_CI_LOW,
    EVAL_FAILED,
    EVAL_FAILURES,
    EVAL_N,
)
from rltool.rollout.bootstrap import bootstrap_interval
from rltool.rollout.failures import count_reasons
from rltool.rollout.state import RolloutState, Status

REASONS_NAMED = 3  # in the error of an evaluation that failed whole


class EvaluationFailed(ValueError):
    """Every sample of a task's evaluation failed: there is no accuracy to report."""


def failure_metrics(samples: Sequence[RolloutState]) -> dict[str, float]:
    """``eval/failed`` (FAILED samples) and ``eval/failures/<reason>`` for each reason."""
    reasons = count_reasons(samples)
    return {
        EVAL_FAILED: float(sum(reasons.values())),
        **{f"{EVAL_FAILURES}{reason}": float(n) for reason, n in reasons.items()},
    }


def accuracy_metrics(per_row: np.ndarray) -> dict[str, float]:
    """``eval/accuracy`` (the mean of ``per_row`` [N], one figure per eval row) and its 95%
    percentile-bootstrap interval: how far the accuracy could move by the draw of rows."""
    ci = bootstrap_interval(per_row)
    return {
        EVAL_ACCURACY: float(np.mean(per_row)),
        EVAL_ACCURACY_CI_LOW: ci.low,
        EVAL_ACCURACY_CI_HIGH: ci.high,
    }


def check_evaluation(task_name: str, metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` unchanged, or EvaluationFailed when ``eval/failed`` is all of ``eval/n``,
    naming the task and the most frequent reasons with their counts."""
    n, failed = metrics[EVAL_N], metrics.get(EVAL_FAILED, 0.0)
    if n > 0 and failed >= n:
        reasons = sorted(
            (
                (k.removeprefix(EVAL_FAILURES), v)
                for k, v in metrics.items()
                if k.startswith(EVAL_FAILURES)
            ),
            key=lambda kv: (-kv[1], kv[0]),
        )
        named = ", ".join(f"{r} ({int(c)})" for r, c in reasons[:REASONS_NAMED])
        more = len(reasons) - REASONS_NAMED
        named += f", and {more} more reason(s)" if more > 0 else ""
        raise EvaluationFailed(
            f"evaluation of task {task_name!r}: all {int(n)} samples failed: {named or 'unknown'}"
        )
    return dict(metrics)


def session_eval_metrics(groups: Sequence[list[RolloutState]]) -> dict[str, float]:
    """One session per task: eval/accuracy is the mean session score, a failed session
    counting 0; a failed session's reason is that of its first FAILED segment."""
    ok = [all(s.status == Status.COMPLETED for s in g) for g in groups]
    scores = np.array(  # [N] one per task
        [float(g[0].score or 0.0) if o else 0.0 for g, o in zip(groups, ok, strict=True)]
    )
    first_failed = [next((s for s in g if s.status == Status.FAILED), g[0]) for g in groups]
    return {
        **accuracy_metrics(scores),
        **failure_metrics([s for s, o in zip(first_failed, ok, strict=True) if not o]),
        EVAL_N: float(len(groups)),
    }
