"""The health alarms on the report's charts: a dotted vertical line and the alarm's name
at the first step of each streak, on the chart of the alarm's figure."""

from __future__ import annotations

from metrics_files import train_line, write_run

from rltool import metric_names as mn
from rltool.app.run_reader import read_runs
from rltool.config.schema import ALARM_NAMES
from rltool.report.charts import ALARM_CHARTS, CHARTS, Marker, build_chart
from rltool.report.html_report import COLOURS, figure, write_report

LENGTH = next(spec for spec in CHARTS if spec.id == "length")


def _run(tmp_path):
    # the length alarm fires at steps 2-3 and 5 (two streaks); truncation at 4
    fired = {2: ["length"], 3: ["length"], 4: ["truncation"], 5: ["length"]}
    lines = [
        train_line(
            step,
            {mn.ROLLOUT_RESPONSE_LEN_MEAN: 10.0 * step}
            | {f"alarm/{a}": 1.0 for a in fired.get(step, [])},
        )
        for step in range(1, 6)
    ]
    return write_run(tmp_path / "long", lines)


def test_every_alarm_is_marked_on_charts_that_exist():
    assert set(ALARM_CHARTS) == set(ALARM_NAMES)
    ids = {spec.id for spec in CHARTS}
    assert all(set(charts) <= ids for charts in ALARM_CHARTS.values())


def test_an_alarm_is_marked_at_the_first_step_of_each_streak_on_its_chart(tmp_path):
    runs = read_runs([_run(tmp_path)])
    chart = build_chart(LENGTH, runs)
    assert chart.markers == [Marker("long", 0, 2, "length"), Marker("long", 0, 5, "length")]
    layout = figure(chart)["layout"]
    assert [(s["x0"], s["x1"], s["line"]["color"]) for s in layout["shapes"]] == [
        (2, 2, COLOURS[0]),
        (5, 5, COLOURS[0]),
    ]
    assert [(a["x"], a["text"]) for a in layout["annotations"]] == [
        (2, "alarm: length"),
        (5, "alarm: length"),
    ]
    truncation = next(spec for spec in CHARTS if spec.id == "truncation")
    assert [m.step for m in build_chart(truncation, runs).markers] == [4]


def test_the_written_report_holds_the_markers(tmp_path):
    report = write_report([_run(tmp_path)], tmp_path / "report.html")
    html = report.path.read_text(encoding="utf-8")
    assert html.count("alarm: length") == 2 and "alarm: truncation" not in html  # no chart
