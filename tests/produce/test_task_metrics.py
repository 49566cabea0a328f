"""Per-task figures: task/<name>/... of generated samples, eval/<name>/... and their summary."""

from __future__ import annotations

import math

import pytest
from task_fakes import rows, spec

from rltool.config.schema import SamplingConfig
from rltool.produce.task_metrics import evaluate_tasks, per_task_metrics
from rltool.rollout.state import RolloutState, Status


def done(rid: str, task_name: str, reward: dict | None, finish: str = "stop") -> RolloutState:
    return RolloutState(
        rollout_id=rid,
        group_id=rid.split("/")[0],
        task_name=task_name,
        prompt_ids=[1, 2],
        reward=reward,
        finish_reason=finish,
        status=Status.COMPLETED if reward else Status.FAILED,
    )


def test_per_task_metrics_hand_worked() -> None:
    groups = [
        [
            done("g0/0", "add", {"score": 1.0, "correct": True}),
            done("g0/1", "add", {"score": 0.0, "correct": False}, "length"),
        ],
        [
            done("g1/0", "add", {"score": 1.0, "correct": True}),
            done("g1/1", "add", None, "length"),
        ],
        [done("g2/0", "calc", {"score": 0.5}), done("g2/1", "calc", {"score": 0.25})],
    ]
    m = per_task_metrics(groups)
    assert m == {
        "task/add/reward_mean": pytest.approx(2 / 3),
        "task/add/accuracy": pytest.approx(2 / 3),
        "task/add/samples": 4.0,
        "task/add/truncated_frac": 0.5,
        "task/calc/reward_mean": 0.375,  # no 'correct' in its rewards: no accuracy
        "task/calc/samples": 2.0,
        "task/calc/truncated_frac": 0.0,
    }
    assert math.isnan(per_task_metrics([[done("g/0", "x", None)]])["task/x/reward_mean"])
    assert per_task_metrics([]) == {}


def test_evaluate_tasks_weights_the_overall_figures_by_eval_rows() -> None:
    calls = []

    def evaluate_fn(name, task_rows, sampling):
        calls.append((name, len(task_rows), sampling))
        acc = {"add": 1.0, "mul": 0.0}[name]
        return {
            "eval/accuracy": acc,
            "eval/response_len/mean": 4.0 if name == "add" else 8.0,
            "eval/reward_errors": 1.0,
            "eval/n": float(len(task_rows)),
        }

    specs = [spec("add"), spec("mul"), spec("none")]
    greedy = SamplingConfig(temperature=0.0)
    m = evaluate_tasks(evaluate_fn, specs, {"add": rows(3), "mul": rows(1), "none": []}, greedy)
    assert calls == [("add", 3, greedy), ("mul", 1, greedy)]  # a task without rows is skipped
    assert m == {
        "eval/add/accuracy": 1.0,
        "eval/add/response_len/mean": 4.0,
        "eval/add/reward_errors": 1.0,
        "eval/add/n": 3.0,
        "eval/mul/accuracy": 0.0,
        "eval/mul/response_len/mean": 8.0,
        "eval/mul/reward_errors": 1.0,
        "eval/mul/n": 1.0,
        "eval/accuracy": 0.75,  # (3 * 1.0 + 1 * 0.0) / 4
        "eval/response_len/mean": 5.0,  # (3 * 4 + 1 * 8) / 4
        "eval/reward_errors": 2.0,  # summed
        "eval/n": 4.0,
    }
    with pytest.raises(ValueError, match="no task has evaluation rows"):
        evaluate_tasks(evaluate_fn, specs, {}, greedy)


def test_evaluate_tasks_sums_failures_and_their_reasons_over_tasks() -> None:
    per_task = {
        "add": {"eval/accuracy": 0.5, "eval/failed": 1.0, "eval/failures/reward: timeout": 1.0},
        "code": {
            "eval/accuracy": 0.0,
            "eval/failed": 3.0,
            "eval/failures/reward: timeout": 1.0,
            "eval/failures/sandbox: bwrap not found": 2.0,
        },
    }

    def evaluate_fn(name, task_rows, sampling):
        return {**per_task[name], "eval/n": float(len(task_rows))}

    m = evaluate_tasks(
        evaluate_fn, [spec("add"), spec("code")], {"add": rows(2), "code": rows(4)}, None
    )
    assert m["eval/failed"] == 4.0
    assert m["eval/failures/reward: timeout"] == 2.0
    assert m["eval/failures/sandbox: bwrap not found"] == 2.0  # one task's reason: still summed
    assert m["eval/accuracy"] == pytest.approx(1 / 6)  # (2 * 0.5 + 4 * 0.0) / 6
    assert m["eval/code/failures/sandbox: bwrap not found"] == 2.0


def test_the_accuracy_interval_of_one_task_is_kept_and_of_several_combined() -> None:
    per_task = {
        # add: 3 rows, 0.5 in [0.3, 0.8]; mul: 1 row, 0.0 in [0.0, 0.4]
        "add": {"eval/accuracy": 0.5, "eval/accuracy_ci_low": 0.3, "eval/accuracy_ci_high": 0.8},
        "mul": {"eval/accuracy": 0.0, "eval/accuracy_ci_low": 0.0, "eval/accuracy_ci_high": 0.4},
    }
    greedy = SamplingConfig(temperature=0.0)
    one = evaluate_tasks(
        lambda name, r, s: {**per_task[name], "eval/n": 3.0},
        [spec("add")],
        {"add": rows(3)},
        greedy,
    )
    assert (one["eval/accuracy_ci_low"], one["eval/accuracy_ci_high"]) == pytest.approx((0.3, 0.8))
    both = evaluate_tasks(
        lambda name, r, s: {**per_task[name], "eval/n": float(len(r))},
        [spec("add"), spec("mul")],
        {"add": rows(3), "mul": rows(1)},
        greedy,
    )
    assert both["eval/accuracy"] == pytest.approx(0.375)  # (3 * 0.5 + 0) / 4
    # weights 3/4 and 1/4: below sqrt((0.75 * 0.2)^2 + 0) = 0.15,
    # above sqrt((0.75 * 0.3)^2 + (0.25 * 0.4)^2) = sqrt(0.050625 + 0.01) = 0.24622
    assert both["eval/accuracy_ci_low"] == pytest.approx(0.375 - 0.15)
    assert both["eval/accuracy_ci_high"] == pytest.approx(0.375 + math.sqrt(0.060625))
    assert both["eval/add/accuracy_ci_low"] == 0.3  # each task's own interval as it was
