"""The health alarms' rules on hand-worked series: each fires past its threshold and not at
it, and ignores a step without its figure."""

from __future__ import annotations

import math

import pytest

from rltool import metric_names as mn
from rltool.app import alarms
from rltool.app.alarms import AlarmWatch, SoFar, alarm_metrics, check, stopping
from rltool.config.schema import ALARM_NAMES, AlarmsConfig
from rltool.training.rollout_correction import KL_K3

CFG = AlarmsConfig()


def _run(key: str, values: list[float], evals=()) -> SoFar:
    """Steps 1..n with one figure each."""
    return SoFar([{key: v} for v in values], len(values), list(evals))


def test_the_rules_are_the_recipes_alarm_names():
    assert tuple(alarms.RULES) == ALARM_NAMES


def test_baseline_is_the_mean_of_the_first_steps_before_the_current_one():
    history = [{"x": v} for v in (1.0, 3.0, 5.0, 100.0)]
    assert alarms.baseline(history, "x", steps=10) == pytest.approx(3.0)  # (1+3+5)/3
    assert alarms.baseline(history, "x", steps=2) == pytest.approx(2.0)  # the first 2 only
    assert alarms.baseline(history[:1], "x", steps=10) is None  # nothing before step 1
    # a step without the figure (or with NaN) does not count
    assert alarms.baseline([{"x": math.nan}, {}, {"x": 4.0}, {"x": 1}], "x", 10) == 4.0


def test_length_fires_above_twice_its_baseline():
    # baseline (10+14)/2 = 12: 24 is exactly 2x (no alarm), 24.5 is 2.04x
    assert alarms.length_drift(_run(mn.ROLLOUT_RESPONSE_LEN_MEAN, [10, 14, 24]), CFG) is None
    alarm = alarms.length_drift(_run(mn.ROLLOUT_RESPONSE_LEN_MEAN, [10, 14, 24.5]), CFG)
    assert alarm is not None and alarm.name == "length"
    assert alarm.value == pytest.approx(24.5 / 12)
    assert "length_ratio=2" in alarm.message
    # step 1 has no baseline; the baseline stops at baseline_steps (the first 10)
    assert alarms.length_drift(_run(mn.ROLLOUT_RESPONSE_LEN_MEAN, [100]), CFG) is None
    series = [10.0] * 10 + [30.0] * 5 + [20.5]  # baseline 10 however long the run
    assert alarms.length_drift(_run(mn.ROLLOUT_RESPONSE_LEN_MEAN, series), CFG).value == 2.05
    off = AlarmsConfig(length_ratio=None)
    assert alarms.length_drift(_run(mn.ROLLOUT_RESPONSE_LEN_MEAN, [10, 100]), off) is None


def test_truncation_fires_above_its_fraction():
    assert alarms.truncation(_run(mn.ROLLOUT_TRUNCATED_FRAC, [0.3]), CFG) is None
    alarm = alarms.truncation(_run(mn.ROLLOUT_TRUNCATED_FRAC, [0.0, 0.3125]), CFG)
    assert alarm is not None and alarm.value == 0.3125 and "31%" in alarm.message
    assert alarms.truncation(_run("other", [1.0]), CFG) is None


def test_entropy_fires_below_its_ratio_of_the_baseline():
    # baseline (1.0 + 0.5)/2 = 0.75; with ratio 0.25, 0.1875 is exactly 0.25x (no alarm)
    quarter = AlarmsConfig(entropy_ratio=0.25)
    assert alarms.entropy_collapse(_run(mn.ACTOR_ENTROPY, [1.0, 0.5, 0.1875]), quarter) is None
    alarm = alarms.entropy_collapse(_run(mn.ACTOR_ENTROPY, [1.0, 0.5, 0.18]), quarter)
    assert alarm is not None and alarm.value == pytest.approx(0.24)
    # the default, 0.2: 0.16 is above 0.2 x 0.75 = 0.15, 0.14 below
    assert alarms.entropy_collapse(_run(mn.ACTOR_ENTROPY, [1.0, 0.5, 0.16]), CFG) is None
    assert alarms.entropy_collapse(_run(mn.ACTOR_ENTROPY, [1.0, 0.5, 0.14]), CFG) is not None
    assert alarms.entropy_collapse(_run(mn.ACTOR_ENTROPY, [0.0, 0.0]), CFG) is None  # no base


def _hacking_run(rewards: list[float], evals: list[tuple[int, float]]) -> SoFar:
    return _run(mn.ROLLOUT_REWARD_MEAN, rewards, evals)


def test_reward_hacking_fires_when_reward_rises_and_accuracy_falls():
    # evaluations at 0 (0.5) and 4 (0.375): accuracy fell 0.125 > 0.05. The reward before is
    # step 1's (0.125; no step precedes the first evaluation), after is the mean of steps
    # 1..4 = (0.125 + 0.25 + 0.375 + 0.5)/4 = 0.3125: it rose 0.1875 > 0.05
    rewards, evals = [0.125, 0.25, 0.375, 0.5, 0.625], [(0, 0.5), (4, 0.375)]
    alarm = alarms.reward_hacking(_hacking_run(rewards, evals), CFG)
    assert alarm is not None and alarm.value == 0.125
    assert "steps 0 -> 4" in alarm.message and "0.125 -> 0.312" in alarm.message
    # at either edge, no alarm: accuracy fell exactly accuracy_drop, reward rose exactly reward_rise
    edge_drop, edge_rise = AlarmsConfig(accuracy_drop=0.125), AlarmsConfig(reward_rise=0.1875)
    assert alarms.reward_hacking(_hacking_run(rewards, evals), edge_drop) is None
    assert alarms.reward_hacking(_hacking_run(rewards, evals), edge_rise) is None
    # accuracy rose: none; one evaluation only: none
    rose = _hacking_run(rewards, [(0, 0.375), (4, 0.5)])
    assert alarms.reward_hacking(rose, CFG) is None
    assert alarms.reward_hacking(_hacking_run(rewards, [(0, 0.5)]), CFG) is None


def test_reward_hacking_compares_the_two_intervals_between_the_last_evaluations():
    # evaluations at 0, 2, 4: before = mean of steps 1..2 = 0.1875, after = of steps 3..4 =
    # 0.4375 (step 5, after the last evaluation, is not in either): a rise of 0.25
    rewards = [0.125, 0.25, 0.375, 0.5, 0.0]
    run = _hacking_run(rewards, [(0, 0.5), (2, 0.625), (4, 0.5)])
    alarm = alarms.reward_hacking(run, CFG)
    assert alarm is not None and "0.188 -> 0.438" in alarm.message
    assert alarms.reward_hacking(run, AlarmsConfig(reward_rise=0.25)) is None
    assert alarms.reward_hacking(run, AlarmsConfig(reward_rise=0.24)) is not None


def test_a_component_dominates_above_its_share():
    def run(**parts):
        return SoFar([{f"{mn.ROLLOUT_REWARD_COMPONENTS}{k}": v for k, v in parts.items()}], 1)

    # 0.9 of |0.9| + |-0.1| is exactly 0.9: no alarm; 0.95 / (0.95 + 0.05) = 0.95 fires
    assert alarms.reward_component(run(format=0.9, correct=-0.1), CFG) is None
    alarm = alarms.reward_component(run(format=0.95, correct=0.05), CFG)
    assert alarm is not None and alarm.value == pytest.approx(0.95) and "'format'" in alarm.message
    assert alarms.reward_component(run(format=1.0), CFG) is None  # one component: no share
    assert alarms.reward_component(run(format=0.0, correct=0.0), CFG) is None


def test_mismatch_fires_above_its_kl():
    assert alarms.mismatch(_run(KL_K3, [0.01]), CFG) is None
    alarm = alarms.mismatch(_run(KL_K3, [0.0125]), CFG)
    assert alarm is not None and alarm.value == 0.0125 and KL_K3 in alarm.message


def test_grad_norm_fires_above_five_times_the_median_of_the_steps_before():
    # median of (1, 2, 100) = 2: 10 is exactly 5x (no alarm), 10.5 fires
    assert alarms.grad_norm_spike(_run(mn.ACTOR_GRAD_NORM, [1, 2, 100, 10]), CFG) is None
    alarm = alarms.grad_norm_spike(_run(mn.ACTOR_GRAD_NORM, [1, 2, 100, 10.5]), CFG)
    assert alarm is not None and alarm.value == pytest.approx(5.25)
    # the window is the last baseline_steps steps: median of (2, 100) = 51
    short = AlarmsConfig(baseline_steps=2)
    assert alarms.grad_norm_spike(_run(mn.ACTOR_GRAD_NORM, [1, 2, 100, 10.5]), short) is None
    assert alarms.grad_norm_spike(_run(mn.ACTOR_GRAD_NORM, [100]), CFG) is None


def test_check_writes_and_stops_on_the_named_alarms():
    run = SoFar(
        [
            {mn.ROLLOUT_RESPONSE_LEN_MEAN: 10, mn.ROLLOUT_TRUNCATED_FRAC: 0.0},
            {mn.ROLLOUT_RESPONSE_LEN_MEAN: 30, mn.ROLLOUT_TRUNCATED_FRAC: 0.5},
        ],
        2,
    )
    fired = check(run, CFG)
    assert [a.name for a in fired] == ["length", "truncation"]
    metrics = alarm_metrics(fired)
    assert metrics == {
        "alarm/length": 1.0,
        "alarm/length/value": 3.0,
        "alarm/truncation": 1.0,
        "alarm/truncation/value": 0.5,
    }
    assert mn.alarms_fired(metrics) == ["length", "truncation"]
    assert stopping(fired, CFG) is None
    assert stopping(fired, AlarmsConfig(stop_on=["truncation"])).name == "truncation"


def test_the_watch_tells_a_streak_once_and_reads_a_resumed_runs_evaluations():
    watch = AlarmWatch(CFG, [{"step": 0, mn.EVAL_ACCURACY: 0.5}, {"step": 2}])
    assert watch.evals == [(0, 0.5)]  # a line without accuracy is not an evaluation
    history: list[dict[str, float]] = []
    news = []
    for step, frac in enumerate([0.5, 0.6, 0.0, 0.4], start=1):
        history.append({mn.ROLLOUT_TRUNCATED_FRAC: frac})
        fired, new = watch.step(history, step)
        news.append(([a.name for a in fired], [a.name for a in new]))
    assert news == [
        (["truncation"], ["truncation"]),
        (["truncation"], []),  # the same streak: named on the step line, no new message
        ([], []),
        (["truncation"], ["truncation"]),
    ]
