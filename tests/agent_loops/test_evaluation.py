"""Evaluation failures: counted by reason, and an error when every sample failed."""

from __future__ import annotations

import pytest

from rltool.agent_loops.evaluation import (
    EvaluationFailed,
    check_evaluation,
    failure_metrics,
    session_eval_metrics,
)
from rltool.rollout.state import RolloutState, Status


def sample(rid: str, error: str | None = None, score: float = 1.0) -> RolloutState:
    s = RolloutState(rollout_id=rid, group_id=rid.split("/")[0], prompt_ids=[1])
    if error is not None:
        return s.fail(error)
    s.reward, s.status = {"score": score}, Status.COMPLETED
    return s


def test_failure_metrics_count_failed_samples_by_reason() -> None:
    samples = [
        sample("a", "sandbox: bwrap not found: no such file"),
        sample("b"),
        sample("c", "sandbox: bwrap not found"),
        sample("d", "reward: timeout (5 s)"),
    ]
    assert failure_metrics(samples) == {
        "eval/failed": 3.0,
        "eval/failures/sandbox: bwrap not found": 2.0,
        "eval/failures/reward: timeout": 1.0,
    }
    assert failure_metrics([sample("a")]) == {"eval/failed": 0.0}


def test_check_evaluation_passes_partial_failures_and_names_the_dominant_reasons() -> None:
    partial = {"eval/accuracy": 0.0, "eval/failed": 7.0, "eval/failures/x: y": 7.0, "eval/n": 8.0}
    assert check_evaluation("t", partial) == partial
    whole = {
        "eval/accuracy": 0.0,
        "eval/failed": 8.0,
        "eval/failures/a: one": 1.0,
        "eval/failures/b: two": 2.0,
        "eval/failures/c: three": 3.0,
        "eval/failures/d: also two": 2.0,
        "eval/n": 8.0,
    }
    with pytest.raises(EvaluationFailed) as info:
        check_evaluation("gsm8k", whole)
    assert str(info.value) == (
        "evaluation of task 'gsm8k': all 8 samples failed: c: three (3), b: two (2), "
        "d: also two (2), and 1 more reason(s)"
    )
    assert isinstance(info.value, ValueError)  # the CLI reports it as a user-facing error


def test_session_eval_metrics_take_one_reason_per_failed_session() -> None:
    groups = [
        [sample("s0/seg0", score=1.0), sample("s0/seg1", score=1.0)],
        [sample("s1/seg0", "agent: ValueError: x"), sample("s1/seg1", "agent: ValueError: x")],
        [sample("s2/seg0", score=0.0)],
    ]
    # the interval of scores [1, 0, 0]: a resample is all 0 with chance 8/27 and all 1
    # with 1/27, both over 2.5%, so the 95% percentile interval is [0, 1]
    assert session_eval_metrics(groups) == {
        "eval/accuracy": 1 / 3,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/failed": 1.0,
        "eval/failures/agent: ValueError": 1.0,
        "eval/n": 3.0,
    }
