"""`rltool report` through the CLI: a real one-step run gives every chart (the metric
names the driver writes are the ones the report reads), several runs in one page, the
default output paths, and the errors with exit 2."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from cli_runner import run_cli
from metrics_files import eval_line, train_line, write_run
from short_runs import short_gsm8k_args

from rltool.report.charts import CHARTS


@pytest.fixture(scope="module")
def run_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """A one-step run of the demo recipe on the tiny checkpoint (evaluated at 0 and 1)."""
    root = tmp_path_factory.mktemp("report-run")
    result = run_cli(short_gsm8k_args(tiny_checkpoint, root, 1, "-q"))
    assert result.exit_code == 0, result.output
    return root / "t"


@pytest.mark.slow
def test_a_real_run_draws_every_chart(run_dir):
    result = run_cli(["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert f"wrote {run_dir / 'report.html'}: 1 run(s), {len(CHARTS)} charts" in result.output
    assert "note:" not in result.output  # the run recorded every metric the report reads
    html = (run_dir / "report.html").read_text()
    for spec in CHARTS:
        assert f'id="chart-{spec.id}"' in html
    assert (run_dir / "config.yaml").read_text().splitlines()[0] in html


def _hand_runs(tmp_path) -> list[Path]:
    a = write_run(
        tmp_path / "a" / "demo",
        [
            eval_line(0, {"eval/accuracy": 0.25}),
            train_line(1, {"rollout/reward_mean": 0.5, "time/generate": 1.0}),
            eval_line(1, {"eval/accuracy": 0.5}),
        ],
        config="model:\n  path: <mine>\n",
    )
    b = write_run(tmp_path / "b" / "demo", [train_line(1, {"rollout/reward_mean": 0.25})])
    return [a, b]


def test_several_runs_in_one_self_contained_page(tmp_path):
    out = tmp_path / "out" / "cmp.html"
    result = run_cli(["report", *map(str, _hand_runs(tmp_path)), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = result.output
    assert f"wrote {out}: 2 run(s), 3 charts" in text
    assert "note: b/demo: no eval/accuracy in its eval lines" not in text  # a chart's note
    assert "note: KL divergence: not drawn, no run recorded actor/kl, actor/rollout_kl" in text
    html = out.read_text()
    assert not re.search(r"<script[^>]*\ssrc=", html)  # opens offline: nothing fetched
    assert "Plotly" in html and len(html) > 1_000_000  # plotly.js inlined
    assert html.count('class="plotly-graph-div') == 3
    assert "<li>b/demo: no eval/accuracy in its eval lines</li>" in html
    assert "a/demo: the resolved recipe (config.yaml)" in html
    assert "path: &lt;mine&gt;" in html  # the recipe, escaped
    assert "<td>50.0% <small>(step 1)</small></td>" in html  # a/demo's final accuracy


def test_several_runs_default_to_report_html_here(tmp_path, monkeypatch):
    runs = _hand_runs(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = run_cli(["report", *map(str, runs)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.html").is_file()


def test_a_directory_without_metrics_is_exit_2(tmp_path):
    good = _hand_runs(tmp_path)[0]
    (tmp_path / "notarun").mkdir()
    result = run_cli(["report", str(good), str(tmp_path / "notarun")])
    assert result.exit_code == 2
    assert f"error: {tmp_path / 'notarun'}: no metrics.jsonl in it" in result.output
    assert not (good / "report.html").exists()


def test_no_run_directory_is_a_usage_error():
    assert run_cli(["report"]).exit_code == 2


def test_without_plotly_the_error_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a)
    )
    result = run_cli(["report", str(_hand_runs(tmp_path)[0])])
    assert result.exit_code == 2
    assert "pip install 'rltool[report]'" in result.output
