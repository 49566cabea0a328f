"""The charts of ``rltool report`` over hand-written runs: which traces each run gives,
their colours (run) and dashes (metric), per-task breakdowns, and the notes for what a
run did not record."""

from __future__ import annotations

from metrics_files import eval_line, train_line, write_run

from rltool.app.run_reader import read_runs
from rltool.report.charts import CHARTS, build_chart, build_charts
from rltool.report.html_report import COLOURS, figure

SPECS = {spec.id: spec for spec in CHARTS}


def _runs(tmp_path):
    two_tasks = [
        eval_line(0, {"eval/accuracy": 0.2, "eval/a/accuracy": 0.1, "eval/b/accuracy": 0.3}),
        train_line(
            1,
            {
                "rollout/reward_mean": 0.5,
                "task/a/reward_mean": 0.25,
                "task/b/reward_mean": 0.75,
                "actor/kl": 0.01,
                "actor/rollout_kl": 0.002,
            },
        ),
    ]
    one_task = [train_line(1, {"rollout/reward_mean": 0.4, "task/gsm8k/reward_mean": 0.4})]
    return read_runs([write_run(tmp_path / "A", two_tasks), write_run(tmp_path / "B", one_task)])


def _view(chart):
    return [(t.run, t.run_index, t.label, t.dash_index, t.series.key) for t in chart.traces]


def test_reward_breaks_down_by_task_only_where_there_are_two(tmp_path):
    chart = build_chart(SPECS["reward"], _runs(tmp_path))
    assert _view(chart) == [
        ("A", 0, "all tasks", 0, "rollout/reward_mean"),
        ("A", 0, "a", 1, "task/a/reward_mean"),
        ("A", 0, "b", 2, "task/b/reward_mean"),
        ("B", 1, "all tasks", 0, "rollout/reward_mean"),
    ]
    assert chart.traces[2].series.values == (0.75,)
    assert chart.notes == []  # a breakdown that is not drawn is not missing


def test_a_metric_a_run_lacks_is_a_note(tmp_path):
    kl = build_chart(SPECS["kl"], _runs(tmp_path))
    assert _view(kl) == [
        ("A", 0, "policy vs reference", 0, "actor/kl"),
        ("A", 0, "rollout vs trainer", 1, "actor/rollout_kl"),
    ]
    assert kl.notes == [
        "B: no actor/kl in its train lines",
        "B: no actor/rollout_kl in its train lines",
    ]
    accuracy = build_chart(SPECS["accuracy"], _runs(tmp_path))
    assert [t.label for t in accuracy.traces] == ["all tasks", "a", "b"]
    assert accuracy.notes == ["B: no eval/accuracy in its eval lines"]


def test_charts_no_run_recorded_are_left_out_with_a_note(tmp_path):
    drawn, skipped = build_charts(_runs(tmp_path))
    assert [c.spec.id for c in drawn] == ["reward", "accuracy", "kl"]
    assert len(skipped) == len(CHARTS) - 3
    assert "Time per step: not drawn, no run recorded time/generate, time/train, time/overlap" in (
        skipped
    )


def test_every_chart_the_issue_asks_for_is_there():
    keys = {t.pattern for spec in CHARTS for t in spec.traces}
    for key in (
        "rollout/reward_mean",  # sampled reward
        "eval/accuracy",  # held-out accuracy
        "actor/kl",
        "actor/entropy",
        "actor/clip_frac",
        "rollout/response_len/mean",  # response length
        "rollout/truncated_frac",
        "staleness/mean",
        "failures/samples",
        "time/generate",
        "time/train",
        "time/overlap",
        "mismatch/kl_k3",  # rollout vs trainer mismatch (issue 20)
        "mismatch/kl_k1",
        "mismatch/log_ppl_ratio",
        "mismatch/abs_diff_p99",
    ):
        assert key in keys


def test_the_mismatch_chart_overlays_runs(tmp_path):
    lines = {
        "mismatch/kl_k3": 0.001,
        "mismatch/kl_k1": 0.002,
        "mismatch/log_ppl_ratio": -0.01,
        "mismatch/abs_diff_p99": 0.2,
    }
    runs = read_runs(
        [
            write_run(tmp_path / "sync", [train_line(1, lines), train_line(2, lines)]),
            write_run(tmp_path / "bf16", [train_line(1, {"mismatch/kl_k3": 0.05})]),
        ]
    )
    chart = build_chart(SPECS["mismatch"], runs)
    assert _view(chart)[:2] == [
        ("sync", 0, "KL k3 (rollout || trainer)", 0, "mismatch/kl_k3"),
        ("sync", 0, "KL k1", 1, "mismatch/kl_k1"),
    ]
    assert _view(chart)[4] == ("bf16", 1, "KL k3 (rollout || trainer)", 0, "mismatch/kl_k3")
    assert chart.traces[0].series.values == (0.001, 0.001)
    assert chart.notes == [
        "bf16: no mismatch/kl_k1 in its train lines",
        "bf16: no mismatch/log_ppl_ratio in its train lines",
        "bf16: no mismatch/abs_diff_p99 in its train lines",
    ]


def test_the_figure_gives_each_run_a_colour_and_each_metric_a_dash(tmp_path):
    fig = figure(build_chart(SPECS["kl"], _runs(tmp_path)))
    data = fig["data"]
    assert [(t["name"], t["line"]["color"], t["line"]["dash"]) for t in data] == [
        ("A", COLOURS[0], "solid"),
        ("A", COLOURS[0], "dash"),
    ]
    assert [t["showlegend"] for t in data] == [True, False]  # the legend lists runs
    assert data[1]["hovertemplate"].startswith("A · rollout vs trainer<br>")
    assert fig["layout"]["title"]["text"] == (
        "KL divergence<br><sup>—— policy vs reference   – – rollout vs trainer</sup>"
    )
    assert (data[0]["x"], data[0]["y"]) == ([1], [0.01])
    assert fig["layout"]["yaxis"]["rangemode"] == "nonnegative"
    accuracy = figure(build_chart(SPECS["accuracy"], _runs(tmp_path)))
    assert accuracy["layout"]["yaxis"]["tickformat"] == ".0%"
    reward = figure(build_chart(SPECS["reward"], _runs(tmp_path)))
    assert [(t["name"], t["showlegend"], t["line"]["color"]) for t in reward["data"]] == [
        ("A", True, COLOURS[0]),
        ("A", False, COLOURS[0]),
        ("A", False, COLOURS[0]),
        ("B", True, COLOURS[1]),
    ]
    one_metric = figure(build_chart(SPECS["entropy"], _runs(tmp_path)))
    assert one_metric["data"] == [] and one_metric["layout"]["title"]["text"] == "Policy entropy"


def test_a_run_written_with_the_old_names_is_drawn_under_the_new_ones(tmp_path):
    """Runs from before the names were unified (rltool/metric_names.py) still chart: the
    reader maps each old name to the new one (run_reader.OLD_NAMES)."""
    old = [
        train_line(1, {"rollout/response_tokens_mean": 12.0, "staleness/stale_tokens_masked": 3}),
        train_line(2, {"rollout/response_tokens_mean": 14.0, "staleness/stale_tokens_masked": 0}),
        eval_line(2, {"eval/mean_response_len": 9.0, "eval/add/mean_response_len": 8.0}),
    ]
    (run,) = read_runs([write_run(tmp_path / "old", old)])
    length = build_chart(SPECS["length"], [run])
    assert [(t.label, t.series.key, t.series.values) for t in length.traces] == [
        ("sampled", "rollout/response_len/mean", (12.0, 14.0)),
        ("held-out", "eval/response_len/mean", (9.0,)),
    ]
    assert length.notes == []
    assert [line.get("staleness/stale_tokens") for line in run.lines["train"]] == [3, 0]
    assert run.lines["eval"][0]["eval/add/response_len/mean"] == 8.0
    assert "rollout/response_tokens_mean" not in run.keys("train")


def test_a_figure_written_under_both_names_keeps_the_new_one(tmp_path):
    both = [train_line(1, {"staleness/stale_tokens_masked": 3, "staleness/stale_tokens": 5})]
    (run,) = read_runs([write_run(tmp_path / "both", both)])
    assert run.lines["train"][0]["staleness/stale_tokens"] == 5


def test_held_out_accuracy_is_drawn_with_its_interval_as_a_band(tmp_path):
    lines = [
        eval_line(s, {"eval/accuracy": a, "eval/accuracy_ci_low": lo, "eval/accuracy_ci_high": hi})
        for s, a, lo, hi in [(0, 0.2, 0.1, 0.3), (5, 0.4, 0.3, 0.5), (10, 0.5, None, 0.6)]
    ]
    older = [eval_line(0, {"eval/accuracy": 0.2})]  # a run without intervals: no band
    runs = read_runs([write_run(tmp_path / "A", lines), write_run(tmp_path / "B", older)])
    chart = build_chart(SPECS["accuracy"], runs)
    assert [t.band is not None for t in chart.traces] == [True, False]
    data = figure(chart)["data"]
    assert [d["mode"] for d in data] == ["lines", "lines+markers", "lines+markers"]
    band = data[0]
    # along the highs and back along the lows; step 10 lacks its low, so it is left out
    assert band["x"] == [0, 5, 5, 0] and band["y"] == [0.3, 0.5, 0.3, 0.1]
    assert band["fill"] == "toself" and band["showlegend"] is False
    assert band["legendgroup"] == "A" and band["fillcolor"].startswith("rgba(99, 110, 250,")
