"""Every invariant of data-contract section 4, through rltool.rollout.contract.

The broken samples are overrides of the worked example (contract section 7,
line 1 of tests/data/validate_clean.jsonl); each must raise exactly the one
violation written next to it in tests/data/validate_cases.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rltool.rollout.contract import (
    Severity,
    Violation,
    check_group,
    check_group_identity,
    check_sample,
    errors,
)
from rltool.rollout.state import RolloutState, Status

DATA = Path(__file__).parents[1] / "data"
WORKED = json.loads((DATA / "validate_clean.jsonl").read_text().splitlines()[0])
CASES = json.loads((DATA / "validate_cases.json").read_text())["cases"]


def sample(**overrides: object) -> RolloutState:
    return RolloutState.model_validate({**WORKED, **overrides})


def test_worked_example_is_clean() -> None:
    s = sample()
    assert s.input_ids == [10, 11, 12, 20, 21, 22]
    assert s.labels == [-100, -100, -100, 20, -100, 22]
    assert check_sample(s) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_invariant_names_field_and_position(name: str) -> None:
    overrides, (field, position, invariant, severity) = CASES[name]
    (v,) = check_sample(sample(**overrides))
    assert (v.rollout_id, v.field, v.position, v.invariant, v.severity) == (
        "r1",
        field,
        position,
        invariant,
        Severity(severity),
    )


def test_messages_say_what_is_wrong() -> None:
    (v,) = check_sample(sample(labels=[-100, 11, -100, 20, -100, 22]))
    assert "prompt" in v.message
    (v,) = check_sample(sample(response_model_steps=[2, 3, 1]))
    assert v.message == "decreases from 3 to 1"
    assert str(v) == "r1: response_model_steps[2]: decreases from 3 to 1 (invariant 5)"


def test_supervised_logprob_within_tolerance_is_clean() -> None:
    assert check_sample(sample(logprobs=[0.0, 0.0, 0.0, 5e-5, 0.0, -0.3])) == []
    (v,) = check_sample(sample(logprobs=[0.0, 0.0, 0.0, 2e-4, 0.0, -0.3]))
    assert (v.field, v.position) == ("logprobs", 3)


def test_absent_logprobs_and_model_steps_are_allowed() -> None:
    assert check_sample(sample(logprobs=None, response_model_steps=None)) == []


def test_reward_and_supervision_only_required_when_completed() -> None:
    failed = sample(status=Status.FAILED, reward=None, labels=[-100] * 6, logprobs=[0.0] * 6)
    assert check_sample(failed) == []
    assert check_sample(sample(reward=None), require_reward=False) == []


def test_no_supervised_token_is_a_warning_not_an_error() -> None:
    found = check_sample(sample(labels=[-100] * 6, logprobs=[0.0] * 6))
    assert [v.severity for v in found] == [Severity.WARNING]
    assert errors(found) == []


def test_group_members_share_group_id_and_task_name() -> None:
    group = [
        sample(),
        sample(rollout_id="r2", group_id="g9"),
        sample(rollout_id="r3", task_name="x"),
    ]
    found = check_group_identity(group)
    assert [(v.rollout_id, v.field, v.invariant) for v in found] == [
        ("r2", "group_id", 7),
        ("r3", "task_name", 7),
    ]
    assert "'g9' differs from the group's 'g1'" in found[0].message


def test_duplicate_rollout_id_in_a_group() -> None:
    found = check_group([sample(), sample(), sample(rollout_id="r2")])
    assert [(v.rollout_id, v.field, v.invariant) for v in found] == [("r1", "rollout_id", 7)]


def test_violation_without_position_prints_the_field() -> None:
    v = Violation("r1", "reward.score", "missing on a COMPLETED sample", 6)
    assert str(v) == "r1: reward.score: missing on a COMPLETED sample (invariant 6)"
