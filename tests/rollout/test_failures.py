"""Short failure reasons, hand-worked."""

from __future__ import annotations

import pytest

from rltool.rollout.failures import count_reasons, failure_reason
from rltool.rollout.state import RolloutState


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (None, "unknown"),
        ("  ", "unknown"),
        ("sandbox: bwrap not found: No such file", "sandbox: bwrap not found"),
        ("reward: timeout (after 5.0 s)", "reward: timeout"),
        ("agent: ValueError: bad input", "agent: ValueError"),
        ("contract.check: labels[3] != input_ids[3]", "contract.check: labels[3] != input_ids[3]"),
        ("a prefix with spaces: detail", "a prefix with spaces: detail"),
        ("first line\nsecond line", "first line"),
        ("x" * 80, "x" * 60),
    ],
)
def test_failure_reason(error: str | None, reason: str) -> None:
    assert failure_reason(error) == reason


def test_count_reasons_counts_failed_samples_most_frequent_first() -> None:
    def s(rid: str, error: str | None) -> RolloutState:
        state = RolloutState(rollout_id=rid, group_id="g", prompt_ids=[1])
        return state.fail(error) if error is not None else state

    samples = [
        s("a", "reward: timeout"),
        s("b", "agent: ValueError: x"),
        s("c", "reward: timeout (1 s)"),
        s("d", None),  # not failed: not counted
        s("e", "agent: KeyError: y"),
    ]
    assert count_reasons(samples) == {
        "reward: timeout": 2,
        "agent: KeyError": 1,
        "agent: ValueError": 1,
    }
