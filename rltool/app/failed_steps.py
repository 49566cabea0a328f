"""Steps that trained on nothing because every sample failed: the stop rule's streak, the
run's failure reasons, and the message a run that trained on no sample ends with.

Design: docs/app.md#loud-failures
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from rltool.metric_names import DATA_TRAINING_SAMPLES, FAILURES, FAILURES_SAMPLES
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import RolloutState, Status

EXIT_TRAINED_NOTHING = 3  # rltool train's exit code when the run trained on no sample
MAX_REASONS_SHOWN = 3


def all_failed(metrics: Mapping[str, float]) -> bool:
    """A step with no trained sample and at least one failed one."""
    return metrics.get(DATA_TRAINING_SAMPLES, 0.0) == 0 and metrics.get(FAILURES_SAMPLES, 0.0) > 0


def failed_streak(history: Sequence[Mapping[str, float]]) -> int:
    """How many of the last steps in a row trained nothing because every sample failed."""
    n = 0
    for metrics in reversed(history):
        if not all_failed(metrics):
            break
        n += 1
    return n


def run_failures(history: Iterable[Mapping[str, float]]) -> dict[str, int]:
    """Failed samples by reason over the steps of ``history``, most frequent first."""
    totals: dict[str, int] = {}
    for metrics in history:
        for key, value in metrics.items():
            if key.startswith(FAILURES) and key != FAILURES_SAMPLES:
                reason = key.removeprefix(FAILURES)
                totals[reason] = totals.get(reason, 0) + int(value)
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def trained_samples(history: Iterable[Mapping[str, float]]) -> int:
    return int(sum(m.get(DATA_TRAINING_SAMPLES, 0.0) for m in history))


def new_failures(
    groups: Iterable[Sequence[RolloutState]], seen: set[str]
) -> Iterator[tuple[str, RolloutState]]:
    """(reason, first sample) for each FAILED reason not in ``seen``; adds it to ``seen``."""
    for group in groups:
        for s in group:
            if s.status != Status.FAILED:
                continue
            reason = failure_reason(s.error)
            if reason not in seen:
                seen.add(reason)
                yield reason, s


def _reasons_text(failures: Mapping[str, int]) -> str:
    shown = [f"{n} x {reason}" for reason, n in list(failures.items())[:MAX_REASONS_SHOWN]]
    more = len(failures) - MAX_REASONS_SHOWN
    if more > 0:
        shown.append(f"{more} other reason" + ("s" if more > 1 else ""))
    return "; ".join(shown)


def stop_message(streak: int, failures: Mapping[str, int]) -> str:
    """Why the stop rule ended the run."""
    return (
        f"stopped: every sample failed in {streak} consecutive steps "
        "(trainer.max_failed_steps), so nothing was trained or saved for them; "
        f"failed samples by reason: {_reasons_text(failures)}"
    )


def trained_nothing_message(steps: int, failures: Mapping[str, int]) -> str:
    """Why a run that took ``steps`` steps and trained on no sample is not a success."""
    head = f"the run trained on no sample in {steps} steps"
    if failures:
        return f"{head}; failed samples by reason: {_reasons_text(failures)}"
    return (
        f"{head} and no sample failed: every group was filtered or skipped "
        "(see data/skipped/* and produce/leftover/* in metrics.jsonl)"
    )
