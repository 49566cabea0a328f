"""The report as a browser shows it: Chromium (Debian's package, headless) loads the
page offline and its rendered DOM holds one plotly SVG per chart with every trace drawn:
a line through the points of each series and a marker per point."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from metrics_files import eval_line, train_line, write_run

from rltool.report.html_report import write_report

pytestmark = pytest.mark.slow


def _lines(reward: list[float], accuracy: list[float]) -> list[dict]:
    out = [eval_line(0, {"eval/accuracy": accuracy[0]})]
    for step, r in enumerate(reward, start=1):
        times = {"time/generate": 1.0 + r, "time/train": 0.5, "time/overlap": 0.0}
        out.append(train_line(step, {"rollout/reward_mean": r, **times}))
    return [*out, eval_line(len(reward), {"eval/accuracy": accuracy[1]})]


def _chart_doms(dom: str) -> dict[str, str]:
    """The rendered DOM of each chart: from its div to the next chart's."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'<div id="chart-([a-z]+)"', dom)]
    ends = [s for s, _ in starts[1:]] + [len(dom)]
    return {name: dom[start:end] for (start, name), end in zip(starts, ends, strict=True)}


def test_chromium_renders_every_chart_with_its_traces(tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium)")
    a = write_run(tmp_path / "a", _lines([0.1, 0.3, 0.2, 0.6], [0.2, 0.5]))
    b = write_run(tmp_path / "b", _lines([0.2, 0.2, 0.4], [0.3, 0.4]))
    report = write_report([a, b], tmp_path / "report.html")
    assert [c.spec.id for c in report.charts] == ["reward", "accuracy", "time"]
    argv = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        str(report.path),
    ]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    charts = _chart_doms(dom)
    assert sorted(charts) == ["accuracy", "reward", "time"]
    # chart -> (traces, points of run a's trace, points of run b's): 2 runs, time x 3 metrics
    expected = {"reward": (2, 4, 3), "accuracy": (2, 2, 2), "time": (6, 4, 3)}
    for name, (n_traces, points_a, points_b) in expected.items():
        chart = charts[name]
        assert chart.count('<svg class="main-svg"') >= 1, name  # plotly drew the chart
        # one piece per trace; the last runs on over the legend, whose markers are not points
        traces = chart.split('<g class="trace scatter')[1:]
        assert len(traces) == n_traces, name
        for i, trace in enumerate(traces):
            path = re.search(r'<path class="js-line" d="(M[^"]+)"', trace)
            assert path is not None, (name, i)  # a line drawn through the series
            points = len(re.findall(r'<path class="point"', trace))
            # traces go run by run: run a's first, then run b's
            assert points == (points_a if i < n_traces // 2 else points_b), (name, i)
    assert "Held-out accuracy" in charts["accuracy"]  # the title, drawn in the SVG
