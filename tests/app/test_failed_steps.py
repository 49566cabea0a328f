"""The stop rule's streak, run-wide failure reasons, and the first sample of each reason."""

from __future__ import annotations

from rich.console import Console

from rltool.app.driver import _saves_at_end
from rltool.app.failed_steps import (
    all_failed,
    failed_streak,
    new_failures,
    run_failures,
    stop_message,
    trained_nothing_message,
    trained_samples,
)
from rltool.report.train_view import TrainView, failure_counts
from rltool.rollout.state import RolloutState

OK = {"data/training_samples": 6.0, "failures/samples": 0.0}
PARTLY = {"data/training_samples": 4.0, "failures/samples": 2.0, "failures/reward: timeout": 2.0}
FAILED = {"data/training_samples": 0.0, "failures/samples": 6.0, "failures/agent: ValueError": 6.0}
FILTERED = {"data/training_samples": 0.0, "failures/samples": 0.0}  # nothing failed


def test_a_step_fails_only_when_nothing_trained_and_something_failed():
    assert [all_failed(m) for m in (OK, PARTLY, FAILED, FILTERED)] == [False, False, True, False]


def test_the_streak_counts_the_trailing_failed_steps_only():
    assert failed_streak([]) == 0
    assert failed_streak([FAILED, FAILED, OK]) == 0
    assert failed_streak([FAILED, OK, FAILED, FAILED]) == 2
    assert failed_streak([PARTLY, FAILED, FAILED, FAILED]) == 3
    assert failed_streak([FAILED, FILTERED, FAILED]) == 1  # a filtered step breaks the run


def test_run_failures_sum_reasons_over_steps_most_frequent_first():
    history = [PARTLY, FAILED, FAILED, OK]
    assert run_failures(history) == {"agent: ValueError": 12, "reward: timeout": 2}
    assert trained_samples(history) == 10


def test_each_reason_is_shown_once_with_its_first_sample():
    def failed(rid: str, error: str) -> RolloutState:
        return RolloutState(rollout_id=rid, group_id="g", prompt_ids=[]).fail(error)

    done = RolloutState(rollout_id="ok", group_id="g", prompt_ids=[])
    step1 = [[failed("a", "reward: RuntimeError: x"), done, failed("b", "reward: RuntimeError: y")]]
    step2 = [[failed("c", "reward: RuntimeError: z"), failed("d", "agent: ValueError: v")]]
    seen: set[str] = set()
    first = [(r, s.rollout_id) for r, s in new_failures(step1, seen)]
    second = [(r, s.rollout_id) for r, s in new_failures(step2, seen)]
    assert first == [("reward: RuntimeError", "a")]
    assert second == [("agent: ValueError", "d")]


def test_messages_name_the_dominant_reasons():
    failures = {"a: X": 9, "b: Y": 5, "c: Z": 2, "d: W": 1}
    msg = stop_message(3, failures)
    assert "every sample failed in 3 consecutive steps" in msg
    assert msg.endswith("9 x a: X; 5 x b: Y; 2 x c: Z; 1 other reason")
    assert trained_nothing_message(2, {"a: X": 4}).endswith("reason: 4 x a: X")
    assert "no sample failed" in trained_nothing_message(2, {})


def test_the_final_save_skips_only_steps_that_all_failed():
    assert _saves_at_end([FAILED, FAILED], "failures") is False
    assert _saves_at_end([FAILED], "steps") is False
    assert _saves_at_end([OK, FAILED, FAILED], "failures") is True  # trained since last save
    assert _saves_at_end([FILTERED], "steps") is True
    assert _saves_at_end([FAILED], "SIGTERM") is True  # exit 143 promises a checkpoint
    assert _saves_at_end([], "steps") is True


def test_the_step_line_counts_reasons_and_a_new_reason_shows_its_whole_error():
    metrics = {"failures/samples": 6.0, "failures/b: Y": 2.0, "failures/a: X": 4.0}
    assert failure_counts(metrics) == "6 (4 a: X, 2 b: Y)"
    assert failure_counts({"failures/samples": 0.0}) is None
    view = TrainView(console=Console(record=True, width=200))
    error = "agent: ValueError: bad [input]\n  at line 2"  # markup-like text kept verbatim
    sample = RolloutState(rollout_id="g/0", group_id="g", task_name="calc", prompt_ids=[])
    view.failure("agent: ValueError", sample.fail(error))
    view.step_line(1, {**metrics, "data/training_samples": 0.0}, [])
    text = view.console.export_text()
    assert "new failure reason: agent: ValueError (sample g/0, task calc); the whole error:" in text
    assert error in text
    assert "failed samples: 6 (4 a: X, 2 b: Y)" in text
