"""What ``rltool report`` draws: the charts, the metrics each one plots, and the traces
of the runs given (one colour per run, one dash per metric). Pure: no plotting here.
Design: docs/app.md#the-report
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltool import metric_names as mn
from rltool.app.run_reader import (
    EVAL,
    TRAIN,
    RunRecord,
    Series,
    match_key,
    matching_keys,
    series,
)
from rltool.training.rollout_correction import ABS_DIFF_P99, KL_K1, KL_K3, LOG_PPL_RATIO


@dataclass(frozen=True, slots=True)
class TraceSpec:
    kind: str  # the metrics lines it reads: "train" or "eval"
    pattern: str  # a metrics key; a ``*`` in it matches a task name (one trace per task)
    label: str  # the legend's metric label; ``{match}`` is what the ``*`` matched
    # a per-task breakdown: drawn only when the pattern matches two keys or more (with one
    # task it repeats the all-task figure), and never noted as missing
    breakdown: bool = False
    # (low, high) keys, ``*`` as in ``pattern``: an interval drawn as a band around the
    # line where the run recorded both
    band: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ChartSpec:
    id: str
    title: str
    y_title: str
    traces: tuple[TraceSpec, ...]
    percent: bool = False  # a fraction in [0, 1], shown as a percentage


CHARTS: tuple[ChartSpec, ...] = (
    ChartSpec(
        "reward",
        "Sampled reward (training rollouts)",
        "mean reward",
        (
            TraceSpec(TRAIN, mn.ROLLOUT_REWARD_MEAN, "all tasks"),
            TraceSpec(TRAIN, "task/*/reward_mean", "{match}", breakdown=True),
        ),
    ),
    ChartSpec(
        "accuracy",
        "Held-out accuracy",
        "accuracy",
        (
            TraceSpec(
                EVAL,
                mn.EVAL_ACCURACY,
                "all tasks",
                band=(mn.EVAL_ACCURACY_CI_LOW, mn.EVAL_ACCURACY_CI_HIGH),
            ),
            TraceSpec(
                EVAL,
                mn.eval_of_task(mn.EVAL_ACCURACY, "*"),
                "{match}",
                breakdown=True,
                band=(
                    mn.eval_of_task(mn.EVAL_ACCURACY_CI_LOW, "*"),
                    mn.eval_of_task(mn.EVAL_ACCURACY_CI_HIGH, "*"),
                ),
            ),
        ),
        percent=True,
    ),
    ChartSpec(
        "kl",
        "KL divergence",
        "KL",
        (
            TraceSpec(TRAIN, mn.ACTOR_KL, "policy vs reference"),
            TraceSpec(TRAIN, mn.ACTOR_ROLLOUT_KL, "rollout vs trainer"),
        ),
    ),
    ChartSpec(
        "mismatch",
        "Rollout vs trainer mismatch (engine logprobs against the trainer's)",
        "nats",
        (
            TraceSpec(TRAIN, KL_K3, "KL k3 (rollout || trainer)"),
            TraceSpec(TRAIN, KL_K1, "KL k1"),
            TraceSpec(TRAIN, LOG_PPL_RATIO, "log perplexity ratio"),
            TraceSpec(TRAIN, ABS_DIFF_P99, "|Δlogp| p99"),
        ),
    ),
    ChartSpec(
        "entropy", "Policy entropy", "nats / token", (TraceSpec(TRAIN, mn.ACTOR_ENTROPY, ""),)
    ),
    ChartSpec(
        "clip",
        "Clip fraction",
        "tokens clipped",
        (TraceSpec(TRAIN, mn.ACTOR_CLIP_FRAC, ""),),
        percent=True,
    ),
    ChartSpec(
        "length",
        "Response length",
        "tokens",
        (
            TraceSpec(TRAIN, mn.ROLLOUT_RESPONSE_LEN_MEAN, "sampled"),
            TraceSpec(EVAL, mn.EVAL_RESPONSE_LEN_MEAN, "held-out"),
        ),
    ),
    ChartSpec(
        "truncation",
        "Truncated at max_new_tokens",
        "responses truncated",
        (
            TraceSpec(TRAIN, mn.ROLLOUT_TRUNCATED_FRAC, "sampled"),
            TraceSpec(EVAL, mn.EVAL_TRUNCATED_FRAC, "held-out"),
        ),
        percent=True,
    ),
    ChartSpec(
        "staleness",
        "Staleness of trained tokens",
        "policy versions behind",
        (
            TraceSpec(TRAIN, mn.STALENESS_MEAN, "mean"),
            TraceSpec(TRAIN, mn.STALENESS_MAX, "max"),
        ),
    ),
    ChartSpec(
        "failures",
        "Failed samples",
        "samples",
        (
            TraceSpec(TRAIN, mn.FAILURES_SAMPLES, "sampled"),
            TraceSpec(EVAL, mn.EVAL_FAILED, "held-out"),
        ),
    ),
    ChartSpec(
        "time",
        "Time per step",
        "seconds",
        (
            TraceSpec(TRAIN, mn.TIME_GENERATE, "generate"),
            TraceSpec(TRAIN, mn.TIME_TRAIN, "train"),
            TraceSpec(TRAIN, mn.TIME_OVERLAP, "overlap"),
        ),
    ),
)


# the charts each health alarm (app/alarms.py) is marked on: its figure's chart; the
# alarms whose figure has no chart of its own go on the sampled reward's
ALARM_CHARTS: dict[str, tuple[str, ...]] = {
    "length": ("length",),
    "truncation": ("truncation",),
    "entropy": ("entropy",),
    "reward_hacking": ("reward", "accuracy"),
    "reward_component": ("reward",),
    "mismatch": ("mismatch",),
    "grad_norm": ("reward",),
}


@dataclass(frozen=True, slots=True)
class Marker:
    """A vertical line at the first step of a run's streak of one alarm."""

    run: str
    run_index: int  # its colour
    step: int
    alarm: str


@dataclass(frozen=True, slots=True)
class Trace:
    run: str  # the run's name, the legend group
    run_index: int  # which run: its colour
    label: str  # the metric's label within the chart ("" when the chart plots one metric)
    dash_index: int  # which metric of the chart: its dash
    series: Series
    band: tuple[Series, Series] | None = None  # (low, high): the interval of each point


@dataclass(slots=True)
class Chart:
    spec: ChartSpec
    traces: list[Trace] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # metrics some run did not record
    markers: list[Marker] = field(default_factory=list)  # alarms that fired


def build_chart(spec: ChartSpec, runs: list[RunRecord]) -> Chart:
    """The chart's traces over ``runs``: each metric a run recorded, in the chart's order;
    a metric a run lacks is a note. Dashes are given per distinct label, in order."""
    chart = Chart(spec)
    dashes: dict[str, int] = {}
    for index, run in enumerate(runs):
        for trace in spec.traces:
            keys = matching_keys(run, trace.kind, trace.pattern)
            if trace.breakdown and len(keys) < 2:
                continue
            if not keys:
                chart.notes.append(f"{run.name}: no {trace.pattern} in its {trace.kind} lines")
                continue
            for key in keys:
                match = match_key(trace.pattern, key)
                label = trace.label.format(match=match)
                dash = dashes.setdefault(label, len(dashes))
                band = _band(run, trace, match) if trace.band else None
                chart.traces.append(
                    Trace(run.name, index, label, dash, series(run, trace.kind, key), band)
                )
        chart.markers += alarm_markers(run, index, spec.id)
    return chart


def alarm_markers(run: RunRecord, run_index: int, chart_id: str) -> list[Marker]:
    """The run's alarms that belong on the chart, one marker per streak (the steps in a row
    an alarm fired), at its first step."""
    out = []
    for alarm, charts in ALARM_CHARTS.items():
        if chart_id not in charts:
            continue
        fired = series(run, TRAIN, f"{mn.ALARM}{alarm}")
        steps = {s for s, v in zip(fired.steps, fired.values, strict=True) if v}
        out += [Marker(run.name, run_index, s, alarm) for s in sorted(steps) if s - 1 not in steps]
    return out


def _band(run: RunRecord, trace: TraceSpec, match: str) -> tuple[Series, Series] | None:
    """The (low, high) series of a trace's band, None when the run lacks either."""
    keys = [k.replace("*", match) for k in trace.band]
    if not all(k in run.keys(trace.kind) for k in keys):
        return None
    low, high = (series(run, trace.kind, k) for k in keys)
    return low, high


def build_charts(runs: list[RunRecord]) -> tuple[list[Chart], list[str]]:
    """(the charts that have a trace, a note for each chart no run has a figure for)."""
    drawn, skipped = [], []
    for spec in CHARTS:
        chart = build_chart(spec, runs)
        if chart.traces:
            drawn.append(chart)
        else:
            keys = ", ".join(t.pattern for t in spec.traces if not t.breakdown)
            skipped.append(f"{spec.title}: not drawn, no run recorded {keys}")
    return drawn, skipped
