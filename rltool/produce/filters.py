"""Group filters and refilling a batch from over-sampled groups (DAPO's dynamic sampling).

Design: docs/production.md#group-filters
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rltool.registry import Registry
from rltool.rollout.state import RolloutState, Status, group_status

Group = list[RolloutState]
GroupFilter = Callable[[Sequence[RolloutState]], bool]  # True = keep the group

GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter", "produce.group_filter")


@GROUP_FILTERS.register("none")
def keep_every_group(group: Sequence[RolloutState]) -> bool:
    return True


@GROUP_FILTERS.register("zero_variance")
def has_reward_variance(group: Sequence[RolloutState]) -> bool:
    """False when every member has a finite score and all scores are equal.

    A group with a missing or non-finite score is kept: there is nothing to
    judge (a distillation task with weight 0 has no reward), and the
    controller decides what to do with it.
    """
    scores = [s.score for s in group]
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in scores):
        return True
    return len(set(scores)) > 1


def oversample(n: int, fraction: float) -> int:
    """Groups to generate so that ``n`` may survive the filter: ceil(n * (1 + fraction)).

    Rounded to 9 decimals first, so 10 * 1.1 = 11.000000000000002 gives 11, not 12.
    """
    assert n >= 0 and fraction >= 0, (n, fraction)  # produce.oversample: config/checks.py
    return math.ceil(round(n * (1.0 + fraction), 9))


def apply_group_filter(groups: Sequence[Group], name: str) -> tuple[list[Group], list[Group]]:
    """Split COMPLETED groups into (kept, filtered); mark the filtered members FILTERED."""
    keep = GROUP_FILTERS.get(name)
    kept: list[Group] = []
    filtered: list[Group] = []
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {g} given to the {name!r} filter is empty")
        status = group_status(s.status for s in group)
        if status != Status.COMPLETED:
            raise ValueError(
                f"group {group[0].group_id} is {status.value}, not COMPLETED: filter only "
                "completed groups (take them from the replay buffer)"
            )
        if keep(group):
            kept.append(group)
            continue
        for s in group:
            s.status = Status.FILTERED
            s.error = f"filtered by {name}"
        filtered.append(group)
    return kept, filtered
