"""Every invariant of data-contract section 4, through rltool.rollout.contract.

The broken samples are overrides of the worked example (contract section 7,
line 1 of tests/data/validate_clean.jsonl); each must raise exactly the one
violation written next to it in tests/data/validate_cases.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import rltool.rollout.fields as fields_module
from rltool.rollout.contract import (
    check_group,
    check_group_identity,
    check_sample,
    check_samples,
    errors,
)
from rltool.rollout.state import RolloutState, Status
from rltool.rollout.violation import Severity, Violation

DATA = Path(__file__).parents[1] / "data"
WORKED = json.loads((DATA / "validate_clean.jsonl").read_text().splitlines()[0])
CASES = json.loads((DATA / "validate_cases.json").read_text())["cases"]


def sample(**overrides: object) -> RolloutState:
    return RolloutState.model_validate({**WORKED, **overrides})


def test_worked_example_is_clean() -> None:
    s = sample()
    assert s.input_ids.tolist() == [10, 11, 12, 20, 21, 22]
    assert s.labels.tolist() == [-100, -100, -100, 20, -100, 22]
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


@pytest.mark.parametrize("block", [1, fields_module.BLOCK_TOKENS])
def test_every_case_in_one_batch_names_its_own_violation(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All cases checked together, clean samples between them: each sample gets exactly
    its own violation, positions counted inside it; blocks of 1 position give every
    sample a block of its own."""
    monkeypatch.setattr(fields_module, "BLOCK_TOKENS", block)
    names = sorted(CASES)
    batch = []
    for k, name in enumerate(names):
        batch += [sample(rollout_id=f"ok{k}"), sample(rollout_id=name, **CASES[name][0])]
    checked = check_samples(batch)
    for k, name in enumerate(names):
        clean, (v,) = checked.violations[2 * k], checked.violations[2 * k + 1]
        field, position, invariant, severity = CASES[name][1]
        assert clean == []
        assert (v.rollout_id, v.field, v.position, v.invariant, v.severity) == (
            name,
            field,
            position,
            invariant,
            Severity(severity),
        )
    # samples whose lengths disagree are not in the concatenated fields
    no_fields = {"labels_length", "logprobs_length", "fewer_than_2_tokens", "train_fields_missing"}
    assert {batch[i].rollout_id for i in np.flatnonzero(checked.row_S < 0)} == no_fields
    assert checked.fields.T_S.tolist() == [6] * (len(batch) - len(no_fields))


def test_model_steps_may_drop_from_one_sample_to_the_next() -> None:
    late, early = sample(response_model_steps=[5, 5, 5]), sample(rollout_id="r2")
    assert check_samples([late, early]).violations == [[], []]
    (v,) = check_samples(
        [early, sample(rollout_id="r3", response_model_steps=[0, 2, 1])]
    ).violations[1]
    assert (v.rollout_id, v.field, v.position) == ("r3", "response_model_steps", 2)


def test_every_broken_rule_of_one_sample_is_named_in_order() -> None:
    s = sample(
        prompt_ids=[10, 99, 12],  # 2: prompt_ids[1]
        labels=[-100, 11, -100, 20, -100, 7],  # 3: labels[1] in the prompt, labels[5] foreign
        logprobs=[0.0, 0.0, 0.0, 0.5, -0.2, -0.3],  # 4: [3] > 0 supervised, [4] unsupervised
        response_model_steps=[2, 1, 1],  # 5: [1]
        reward=None,  # 6
    )
    found = [(v.field, v.position, v.invariant) for v in check_sample(s)]
    assert found == [
        ("reward.score", None, 6),
        ("prompt_ids", 1, 2),
        ("labels", 5, 3),
        ("labels", 1, 3),
        ("logprobs", 3, 4),
        ("logprobs", 4, 4),
        ("response_model_steps", 1, 5),
    ]
    nan = sample(logprobs=[0.0, 0.0, 0.0, float("nan"), 0.3, 0.5])  # not finite: no more
    assert [(v.field, v.position) for v in check_sample(nan)] == [("logprobs", 3)]
