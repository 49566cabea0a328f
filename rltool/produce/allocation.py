"""Split one batch between tasks by weight (multi-task recipes).

Floors of the quotas, then one group each to the largest remainders (ties to the task
listed first), in exact arithmetic. Design: docs/production.md#splitting-a-batch-between-tasks
"""

from __future__ import annotations

import math
from fractions import Fraction


def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Groups per task, in the order of ``weights``; sums exactly to ``total``."""
    if total < 0:
        raise ValueError(f"allocate: total must be >= 0 groups, got {total}")
    if not weights:
        raise ValueError("allocate: no task weights given; list at least one task")
    for task, w in weights.items():
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"task weight of {task!r} must be finite and >= 0, got {w}")
    exact = {task: Fraction(w) for task, w in weights.items()}
    weight_sum = sum(exact.values())
    if weight_sum == 0:
        raise ValueError(f"task weights sum to 0 ({weights}); give at least one task weight > 0")
    quota = {task: total * w / weight_sum for task, w in exact.items()}
    out = {task: math.floor(q) for task, q in quota.items()}
    left = total - sum(out.values())
    # sorted() is stable, so equal remainders keep the task order
    by_remainder = sorted(weights, key=lambda task: quota[task] - out[task], reverse=True)
    for task in by_remainder[:left]:
        out[task] += 1
    return out
