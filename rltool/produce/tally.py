"""What came back between two batches, and its checkpoint form.

In async production, groups finish while the trainer trains (``generation_overlap``): they
go to the replay buffer at once, and their figures (samples produced, errors, FAILED groups)
wait in a ``Tally`` for the next step's result. A checkpoint taken in between keeps the
tally, so the next step after a resume reports what an uninterrupted run would, and a group
that failed meanwhile is still handed along (dumped with that step) instead of vanishing.
Design: docs/app.md#what-an-async-checkpoint-holds
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rltool.produce.result import GroupError
from rltool.rollout.state import RolloutState

Group = list[RolloutState]


@dataclass(slots=True)
class Tally:
    """What happened between two batches: groups that came back and where they went."""

    generated: list[Group] = field(default_factory=list)
    gen_times: list[float] = field(default_factory=list)
    loop_metrics: dict[str, float] = field(default_factory=dict)  # summed over outcomes
    expired_groups: int = 0  # too stale on arrival or when served: retried or dropped
    expired_samples: int = 0  # their samples
    failed: list[Group] = field(default_factory=list)  # groups filed FAILED (samples: why)
    filtered_groups: int = 0
    errors: list[GroupError] = field(default_factory=list)  # every error outcome
    refills: int = 0


def _dump(groups: Iterable[Group]) -> list[list[str]]:
    return [[s.to_json() for s in g] for g in groups]


def tally_state(t: Tally) -> dict[str, Any]:
    """JSON-serialisable; groups as lists of RolloutState JSON lines."""
    return {
        "generated": _dump(t.generated),
        "gen_times": list(t.gen_times),
        "loop_metrics": dict(t.loop_metrics),
        "expired_groups": t.expired_groups,
        "expired_samples": t.expired_samples,
        "failed": _dump(t.failed),
        "filtered_groups": t.filtered_groups,
        "errors": [asdict(e) for e in t.errors],
        "refills": t.refills,
    }


def load_tally(state: Mapping[str, Any] | None, queued: Iterable[Group]) -> Tally:
    """The tally of ``tally_state``. A generated group still in the buffer (``queued``,
    the same JSON lines) is that very group object again, as before the save: a later
    expiry or staleness mark changes what the tally's figures see, as in an uninterrupted
    run. ``None`` (a checkpoint from before the tally was kept): an empty tally."""
    if state is None:
        return Tally()
    by_lines = {tuple(s.to_json() for s in g): g for g in queued}

    def load(rows: Iterable[list[str]], link: bool) -> list[Group]:
        out = []
        for g in rows:
            same = by_lines.get(tuple(g)) if link else None
            out.append(same if same is not None else [RolloutState.from_json(x) for x in g])
        return out

    return Tally(
        generated=load(state["generated"], link=True),
        gen_times=[float(x) for x in state["gen_times"]],
        loop_metrics={k: float(v) for k, v in state["loop_metrics"].items()},
        expired_groups=int(state["expired_groups"]),
        expired_samples=int(state["expired_samples"]),
        failed=load(state["failed"], link=False),
        filtered_groups=int(state["filtered_groups"]),
        errors=[GroupError(**e) for e in state["errors"]],
        refills=int(state["refills"]),
    )
