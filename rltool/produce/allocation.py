"""Split one batch between tasks by weight (multi-task recipes).

Each task's quota is ``total * w / sum(w)``. Every task gets the floor of its
quota; the groups left over go one each to the largest remainders, ties to the
task listed first. The result sums exactly to ``total``, and a task never gets
more than one group above or below its quota. Arithmetic is exact (Fraction),
so equal weights really tie.

Worked: total 10, weights 1:1:1 -> quotas 3.33 each -> floors 3, 3, 3, one
left, remainders tie -> 4, 3, 3. Total 7, weights 0.5/0.3/0.2 -> quotas
3.5, 2.1, 1.4 -> floors 3, 2, 1, one left to the largest remainder (0.5) -> 4, 2, 1.
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
