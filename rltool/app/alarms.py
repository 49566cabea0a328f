"""Health alarms: signals that a run is going wrong, read from the figures every step
already logs (``trainer.alarms``; docs/metrics.md#health-alarms).

Each rule is a small pure function over the run so far (``SoFar``: the train metrics of
each step, the current step last, and the evaluations' accuracies) returning the
``Alarm`` it fires or None. ``check`` runs them all; the driver writes what
fired into the step's metrics (``alarm/<name>`` = 1, ``alarm/<name>/value``), the step
line shows it, the report marks it, and ``trainer.alarms.stop_on`` stops the run on it.

A figure's *baseline* is its mean over the run's first ``baseline_steps`` steps, or over
the steps before the current one while there are fewer: a drift is measured against how
the run began, not against a window that drifts with it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rltool import metric_names as mn
from rltool.config.schema import AlarmsConfig
from rltool.training.rollout_correction import KL_K3

Metrics = Mapping[str, float]


@dataclass(frozen=True, slots=True)
class SoFar:
    """What the rules read: the run up to the step being checked."""

    history: Sequence[Metrics]  # the train metrics of consecutive steps, ``step``'s last
    step: int  # the step of history[-1]
    evals: Sequence[tuple[int, float]] = ()  # (step, eval/accuracy) of each evaluation

    def step_of(self, i: int) -> int:
        return self.step - (len(self.history) - 1 - i)


@dataclass(frozen=True, slots=True)
class Alarm:
    name: str  # one of ALARM_NAMES
    value: float  # the figure that fired it (a ratio, a fraction, a difference)
    message: str  # what fired, with the figure and the threshold


def _figure(metrics: Metrics, key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def baseline(history: Sequence[Metrics], key: str, steps: int) -> float | None:
    """Mean of ``key`` over the first ``steps`` steps before the current (last) one, the
    steps that have the figure; None before there is any."""
    values = [_figure(m, key) for m in history[:-1][:steps]]
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def length_drift(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """The mean response length is more than ``length_ratio`` times its baseline."""
    now = _figure(run.history[-1], mn.ROLLOUT_RESPONSE_LEN_MEAN)
    base = baseline(run.history, mn.ROLLOUT_RESPONSE_LEN_MEAN, cfg.baseline_steps)
    if cfg.length_ratio is None or now is None or not base:
        return None
    if now <= cfg.length_ratio * base:  # a product: the edge is exact where the figures are
        return None
    ratio = now / base
    return Alarm(
        "length",
        ratio,
        f"response length {now:.1f} is {ratio:.2f}x its baseline {base:.1f} "
        f"(trainer.alarms.length_ratio={cfg.length_ratio:g})",
    )


def truncation(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """More than ``truncated_frac`` of the step's samples were cut at max_new_tokens."""
    now = _figure(run.history[-1], mn.ROLLOUT_TRUNCATED_FRAC)
    if cfg.truncated_frac is None or now is None or now <= cfg.truncated_frac:
        return None
    return Alarm(
        "truncation",
        now,
        f"{now:.0%} of the samples were truncated "
        f"(trainer.alarms.truncated_frac={cfg.truncated_frac:g})",
    )


def entropy_collapse(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """The policy's entropy fell below ``entropy_ratio`` times its baseline."""
    now = _figure(run.history[-1], mn.ACTOR_ENTROPY)
    base = baseline(run.history, mn.ACTOR_ENTROPY, cfg.baseline_steps)
    if cfg.entropy_ratio is None or now is None or not base or base < 0:
        return None
    if now >= cfg.entropy_ratio * base:
        return None
    ratio = now / base
    return Alarm(
        "entropy",
        ratio,
        f"entropy {now:.4g} is {ratio:.2f}x its baseline {base:.4g} "
        f"(trainer.alarms.entropy_ratio={cfg.entropy_ratio:g})",
    )


def _mean_reward(run: SoFar, first: int, last: int) -> float | None:
    """Mean sampled reward of the train steps ``first..last`` that have one."""
    values = [
        _figure(m, mn.ROLLOUT_REWARD_MEAN)
        for i, m in enumerate(run.history)
        if first <= run.step_of(i) <= last
    ]
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def reward_hacking(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """Between the last two evaluations (steps a < b) held-out accuracy fell by more than
    ``accuracy_drop`` while the sampled reward rose by more than ``reward_rise``: the mean
    reward of the steps a+1..b against that of the steps since the evaluation before a
    (the first step after a when a is the first evaluation). Fires on the steps after b,
    until the next evaluation."""
    if cfg.accuracy_drop is None or cfg.reward_rise is None or len(run.evals) < 2:
        return None
    (before, _), (a, acc_a), (b, acc_b) = ((-1, 0.0), *run.evals)[-3:]
    drop = acc_a - acc_b
    after = _mean_reward(run, a + 1, b)
    earlier = _mean_reward(run, before + 1, a)
    if earlier is None:
        earlier = _mean_reward(run, a + 1, a + 1)
    if after is None or earlier is None or drop <= cfg.accuracy_drop:
        return None
    rise = after - earlier
    if rise <= cfg.reward_rise:
        return None
    return Alarm(
        "reward_hacking",
        drop,
        f"held-out accuracy fell {acc_a:.3f} -> {acc_b:.3f} (steps {a} -> {b}) while the "
        f"sampled reward rose {earlier:.3f} -> {after:.3f} (trainer.alarms.accuracy_drop="
        f"{cfg.accuracy_drop:g}, reward_rise={cfg.reward_rise:g})",
    )


def reward_component(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """One reward component (``reward["components"]``, logged as
    ``rollout/reward_components/<name>``) holds more than ``component_share`` of the
    components' total magnitude; needs two components or more."""
    means = {
        k.removeprefix(mn.ROLLOUT_REWARD_COMPONENTS): abs(v)
        for k, v in run.history[-1].items()
        if k.startswith(mn.ROLLOUT_REWARD_COMPONENTS) and _figure(run.history[-1], k) is not None
    }
    total = sum(means.values())
    if cfg.component_share is None or len(means) < 2 or total == 0:
        return None
    name, top = max(means.items(), key=lambda kv: (kv[1], kv[0]))
    share = top / total
    if share <= cfg.component_share:
        return None
    return Alarm(
        "reward_component",
        share,
        f"reward component {name!r} is {share:.0%} of the reward "
        f"(trainer.alarms.component_share={cfg.component_share:g})",
    )


def mismatch(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """The engine/trainer mismatch KL(rollout || old) (``mismatch/kl_k3``) is above
    ``mismatch_kl``."""
    now = _figure(run.history[-1], KL_K3)
    if cfg.mismatch_kl is None or now is None or now <= cfg.mismatch_kl:
        return None
    return Alarm(
        "mismatch",
        now,
        f"engine/trainer mismatch {KL_K3} = {now:.4g} (trainer.alarms.mismatch_kl="
        f"{cfg.mismatch_kl:g})",
    )


def grad_norm_spike(run: SoFar, cfg: AlarmsConfig) -> Alarm | None:
    """The gradient norm is more than ``grad_norm_ratio`` times the median of the
    ``baseline_steps`` steps before it (a window that follows the run: norms drift)."""
    now = _figure(run.history[-1], mn.ACTOR_GRAD_NORM)
    window = [_figure(m, mn.ACTOR_GRAD_NORM) for m in run.history[:-1][-cfg.baseline_steps :]]
    before = [v for v in window if v is not None]
    if cfg.grad_norm_ratio is None or now is None or not before:
        return None
    median = statistics.median(before)
    if median <= 0 or now <= cfg.grad_norm_ratio * median:
        return None
    return Alarm(
        "grad_norm",
        now / median,
        f"gradient norm {now:.3g} is {now / median:.1f}x the median {median:.3g} of the "
        f"steps before (trainer.alarms.grad_norm_ratio={cfg.grad_norm_ratio:g})",
    )


Rule = Callable[[SoFar, AlarmsConfig], "Alarm | None"]
RULES: dict[str, Rule] = {
    "length": length_drift,
    "truncation": truncation,
    "entropy": entropy_collapse,
    "reward_hacking": reward_hacking,
    "reward_component": reward_component,
    "mismatch": mismatch,
    "grad_norm": grad_norm_spike,
}


def check(run: SoFar, cfg: AlarmsConfig) -> list[Alarm]:
    """Every alarm that fires at ``run.step``, in RULES order."""
    return [a for rule in RULES.values() if (a := rule(run, cfg)) is not None]


def alarm_metrics(alarms: Sequence[Alarm]) -> dict[str, float]:
    """``alarm/<name>`` = 1 and ``alarm/<name>/value`` for each alarm fired."""
    out: dict[str, float] = {}
    for a in alarms:
        out[f"{mn.ALARM}{a.name}"] = 1.0
        out[f"{mn.ALARM}{a.name}{mn.ALARM_VALUE}"] = a.value
    return out


def stopping(alarms: Sequence[Alarm], cfg: AlarmsConfig) -> Alarm | None:
    """The first alarm fired that ``trainer.alarms.stop_on`` names (None: the run goes on)."""
    return next((a for a in alarms if a.name in cfg.stop_on), None)


class AlarmWatch:
    """The driver's one handle: the evaluations' accuracies recorded as they come, each
    train step checked against the run so far."""

    def __init__(self, cfg: AlarmsConfig, eval_lines: Sequence[Metrics] = ()) -> None:
        self.cfg = cfg
        self.evals: list[tuple[int, float]] = []
        self.last: set[str] = set()  # the alarms that fired at the previous step
        for line in eval_lines:  # a resumed run's evaluations, from metrics.jsonl
            self.evaluated(int(line["step"]), line)

    def evaluated(self, step: int, metrics: Metrics) -> None:
        accuracy = _figure(metrics, mn.EVAL_ACCURACY)
        if accuracy is not None:
            self.evals.append((step, accuracy))

    def step(self, history: Sequence[Metrics], step: int) -> tuple[list[Alarm], list[Alarm]]:
        """The alarms that fire at ``step`` and those of them that did not fire at the step
        before (their messages are worth showing; a streak's names stay on the step line)."""
        fired = check(SoFar(history, step, self.evals), self.cfg)
        new = [a for a in fired if a.name not in self.last]
        self.last = {a.name for a in fired}
        return fired, new
