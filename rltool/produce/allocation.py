"""Split one batch between tasks by weight (multi-task recipes).

Floors of the quotas, then one group each to the largest remainders (ties to the task
listed first), in exact arithmetic. Design: docs/production.md#splitting-a-batch-between-tasks
"""

from __future__ import annotations

import math
from fractions import Fraction


def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Groups per task, in the order of ``weights``; sums exactly to ``total``.

    The weights are the recipe's, checked when it loaded (each finite and >= 0:
    config/checks.py; not all 0: task_specs)."""
    assert total >= 0, total
    exact = {task: Fraction(w) for task, w in weights.items()}
    weight_sum = sum(exact.values())
    assert weight_sum > 0, weights
    quota = {task: total * w / weight_sum for task, w in exact.items()}
    out = {task: math.floor(q) for task, q in quota.items()}
    left = total - sum(out.values())
    # sorted() is stable, so equal remainders keep the task order
    by_remainder = sorted(weights, key=lambda task: quota[task] - out[task], reverse=True)
    for task in by_remainder[:left]:
        out[task] += 1
    return out
