"""What one produce call hands the trainer, and where every sample taken from the dataset went.

``ProduceBatchResult`` (the grouped batch and its ``produce/...`` figures) and
``Accounting``. Design: docs/production.md#accounting-and-the-produce-result
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from rltool import metric_names as mn
from rltool.rollout.failures import count_reasons
from rltool.rollout.staleness import token_staleness
from rltool.rollout.state import RolloutState, Status

Group = list[RolloutState]


class Fate(StrEnum):
    """Where a sample is. The first four are open (it can still move), the rest final."""

    PENDING = "pending"  # taken from the dataset (or handed back) for generation
    BUFFERED = "buffered"  # generated, waiting in the replay buffer (completed or aborted)
    RETRY = "retry"  # expired, reset to its prompt, waiting in the buffer to be regenerated
    TAKEN = "taken"  # served by the buffer, not yet trained, filtered or put back
    TRAINED = "trained"  # handed to the trainer (which may still skip an invalid group)
    FILTERED = "filtered"  # removed by the group filter
    FAILED = "failed"  # its group had a FAILED member: skipped whole, never trained
    DROPPED = "dropped"  # expired with ``expired: drop``

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({Fate.TRAINED, Fate.FILTERED, Fate.FAILED, Fate.DROPPED})

# The moves a sample may make; anything else is a producer bug (e.g. training a group twice).
_MOVES: dict[Fate, frozenset[Fate]] = {
    Fate.PENDING: frozenset(
        {Fate.BUFFERED, Fate.RETRY, Fate.TRAINED, Fate.FILTERED, Fate.FAILED, Fate.DROPPED}
    ),
    Fate.BUFFERED: frozenset({Fate.TAKEN, Fate.PENDING, Fate.RETRY, Fate.DROPPED}),
    Fate.TAKEN: frozenset({Fate.TRAINED, Fate.FILTERED, Fate.BUFFERED}),
    Fate.RETRY: frozenset({Fate.PENDING}),
}


class Accounting:
    """Every sample taken from the dataset, by rollout_id, and its current fate.

    Open samples are kept by id; a sample that reaches a final fate is counted
    and forgotten, so memory stays bounded by what is in flight. A move of an
    unknown id (never added, or already final) is an error, which is what
    catches a group trained twice. A retried sample keeps its rollout_id: the
    producer regenerates the reset group under the same ids.
    """

    def __init__(self) -> None:
        self._open: dict[str, Fate] = {}
        self._final: Counter[Fate] = Counter()
        self.taken = 0  # samples taken from the dataset, ever
        self.retries = 0  # moves into RETRY, ever (a sample may retry more than once)

    def add(self, rollout_ids: Iterable[str]) -> None:
        """Samples just taken from the dataset: PENDING."""
        for rid in rollout_ids:
            if rid in self._open:
                raise ValueError(
                    f"sample {rid} taken from the dataset twice; rollout_ids must be unique"
                )
            self._open[rid] = Fate.PENDING
            self.taken += 1

    def move(self, samples: Iterable[RolloutState], fate: Fate) -> None:
        """Move samples to ``fate``; ValueError on a move the table above forbids."""
        for s in samples:
            now = self._open.get(s.rollout_id)
            if now is None:
                raise ValueError(
                    f"sample {s.rollout_id} (group {s.group_id}) moved to {fate} but it is not "
                    "open: never taken from the dataset, or already trained/filtered/failed/dropped"
                )
            if fate not in _MOVES[now]:
                raise ValueError(f"sample {s.rollout_id} cannot move from {now} to {fate}")
            if fate.is_final:
                del self._open[s.rollout_id]
                self._final[fate] += 1
            else:
                self._open[s.rollout_id] = fate
            if fate == Fate.RETRY:
                self.retries += 1

    def move_groups(self, groups: Iterable[Sequence[RolloutState]], fate: Fate) -> None:
        self.move((s for g in groups for s in g), fate)

    def counts(self) -> dict[Fate, int]:
        """Samples per fate; they sum to ``taken``."""
        out = dict.fromkeys(Fate, 0)
        out.update(Counter(self._open.values()))
        out.update(self._final)
        assert sum(out.values()) == self.taken, f"accounting lost samples: {out} vs {self.taken}"
        return out

    def metrics(self) -> dict[str, float]:
        out = {f"produce/samples/{f.value}": float(n) for f, n in self.counts().items()}
        # drawn from the dataset, ever (not .../taken: that is the TAKEN fate's count)
        out["produce/samples/drawn"] = float(self.taken)
        out["produce/samples/retries"] = float(self.retries)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "open": {rid: f.value for rid, f in self._open.items()},
            "final": {f.value: n for f, n in self._final.items()},
            "taken": self.taken,
            "retries": self.retries,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._open = {rid: Fate(f) for rid, f in state["open"].items()}
        self._final = Counter({Fate(f): int(n) for f, n in state["final"].items()})
        self.taken, self.retries = int(state["taken"]), int(state["retries"])
        self.counts()  # the invariant holds for what was loaded


# ---------------------------------------------------------------- batch figures


@dataclass(frozen=True, slots=True)
class GroupError:
    """A group whose generation came back with an error, and what the producer did."""

    group_id: str
    attempt: int
    worker: str  # "" when the backend does not name workers
    error: str  # GroupOutcome.error
    retried: bool  # False: its second failure, the group is counted FAILED

    def __str__(self) -> str:
        then = "retrying it" if self.retried else "counted failed"
        return f"group {self.group_id} (attempt {self.attempt}): {self.error}; {then}"


def staleness_metrics(batch: Sequence[Group], train_step: int) -> dict[str, float]:
    """Histogram of the staleness of every response token of the batch at ``train_step``."""
    steps = [s.response_model_steps for g in batch for s in g if s.response_model_steps is not None]
    st = token_staleness(train_step, np.concatenate(steps) if steps else [])  # [N]
    return {
        mn.STALENESS_TOKENS[0]: float((st <= 0).sum()),
        mn.STALENESS_TOKENS[1]: float((st == 1).sum()),
        mn.STALENESS_TOKENS[2]: float((st >= 2).sum()),
        mn.STALENESS_MEAN: float(st.mean()) if st.size else 0.0,
        mn.STALENESS_MAX: float(st.max()) if st.size else 0.0,
    }


def rollout_metrics(groups: Iterable[Sequence[RolloutState]]) -> dict[str, float]:
    """Reward, truncation and length figures over every sample generated, before any
    filter; the reward mean is over COMPLETED samples with a finite score (NaN when none
    has one). FAILED samples are counted by ``failure_metrics``."""
    samples = [s for g in groups for s in g]
    scores = [
        s.score
        for s in samples
        if s.status == Status.COMPLETED
        and isinstance(s.score, int | float)
        and math.isfinite(s.score)
    ]
    return reward_components(samples) | {
        mn.ROLLOUT_REWARD_MEAN: float(np.mean(scores)) if scores else math.nan,
        mn.ROLLOUT_TRUNCATED_FRAC: sum(s.finish_reason == "length" for s in samples)
        / max(len(samples), 1),
        mn.ROLLOUT_RESPONSE_LEN_MEAN: float(
            np.mean([0 if s.response_ids is None else len(s.response_ids) for s in samples])
            if samples
            else 0.0
        ),
    }


def reward_components(samples: Sequence[RolloutState]) -> dict[str, float]:
    """``rollout/reward_components/<name>``: the mean of each finite number a COMPLETED
    sample's ``reward["components"]`` holds (parts of the score a reward reports, e.g.
    format and correctness), over the samples that have it; {} when none does."""
    values: dict[str, list[float]] = {}
    for s in samples:
        parts = s.reward.get("components") if s.status == Status.COMPLETED and s.reward else None
        for name, v in (parts or {}).items():
            if isinstance(v, int | float) and math.isfinite(v):
                values.setdefault(str(name), []).append(float(v))
    return {f"{mn.ROLLOUT_REWARD_COMPONENTS}{k}": float(np.mean(v)) for k, v in values.items()}


def failure_metrics(groups: Iterable[Sequence[RolloutState]]) -> dict[str, float]:
    """``failures/samples`` (FAILED samples) and ``failures/<reason>`` per short reason."""
    reasons = count_reasons(s for g in groups for s in g)
    out = {mn.FAILURES_SAMPLES: float(sum(reasons.values()))}
    return out | {f"{mn.FAILURES}{r}": float(n) for r, n in reasons.items()}


def produced_totals(groups: Iterable[Sequence[RolloutState]]) -> tuple[int, int]:
    """Samples and generated tokens (``response_ids``, environment tokens included)."""
    samples = [s for g in groups for s in g]
    return len(samples), sum(0 if s.response_ids is None else len(s.response_ids) for s in samples)


def time_stats(seconds: Sequence[float]) -> tuple[float, float, float]:
    """Mean, p50 and p99 (linear interpolation); zeros when nothing was timed."""
    if len(seconds) == 0:
        return 0.0, 0.0, 0.0
    t = np.asarray(seconds, dtype=np.float64)  # [G]
    p50, p99 = np.percentile(t, [50, 99])
    return float(t.mean()), float(p50), float(p99)


@dataclass(slots=True)
class ProduceBatchResult:
    """One produce call: the groups to train and the figures around them.

    ``leftover_*`` count GROUPS that were produced or held but are not in
    ``groups``, by status: init = in flight (submitted, not back yet);
    completed / aborted = waiting in the buffer; expired = groups that expired this
    call, too stale on arrival or when served (with ``expired: retry`` reset and sent
    back for regeneration, so they are also in flight; with ``drop``, dropped);
    failed / filtered = produced this call and never trained.
    ``failed_groups`` holds the FAILED groups themselves (their samples keep ``error``),
    so a dump of the step can show why they never trained.
    """

    groups: list[Group]  # [G][group size], one inner list per prompt
    failed_groups: list[Group] = field(default_factory=list)  # [F][group size], never trained
    leftover_init: int = 0
    leftover_completed: int = 0
    leftover_aborted: int = 0
    leftover_expired: int = 0
    leftover_failed: int = 0
    leftover_filtered: int = 0
    produced_samples: int = 0  # generated this call, whatever their fate
    produced_tokens: int = 0  # response tokens generated this call
    produce_time_s: float = 0.0
    group_time_mean: float = 0.0  # seconds to generate one group
    group_time_p50: float = 0.0
    group_time_p99: float = 0.0
    extra_metrics: dict[str, float] = field(default_factory=dict)  # e.g. buffer.metrics()

    def metrics(self) -> dict[str, float]:
        out = {
            "produce/groups": float(len(self.groups)),
            "produce/samples": float(sum(len(g) for g in self.groups)),
            "produce/produced_samples": float(self.produced_samples),
            "produce/produced_tokens": float(self.produced_tokens),
            "produce/time_s": self.produce_time_s,
            "produce/group_time/mean": self.group_time_mean,
            "produce/group_time/p50": self.group_time_p50,
            "produce/group_time/p99": self.group_time_p99,
        }
        for status in ("init", "completed", "aborted", "expired", "failed", "filtered"):
            out[f"produce/leftover/{status}"] = float(getattr(self, f"leftover_{status}"))
        return out | self.extra_metrics
