"""The HTML page of ``rltool report``: one self-contained file (plotly.js inlined, so it
opens offline) with the summary table, the charts, the notes and each run's recipe.
Design: docs/app.md#the-report
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from html import escape
from pathlib import Path
from typing import Any

from rltool.app.run_reader import RunRecord, RunSummary, read_runs, summarize
from rltool.report.charts import Chart, Marker, Trace, build_charts

DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
DASH_GLYPHS = ("——", "– –", "···", "–·–", "— —", "—·—")  # the dashes, in the subtitle
# plotly's qualitative "Plotly" palette, one colour per run
COLOURS = (
    "#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A",
    "#19D3F3", "#FF6692", "#B6E880", "#FF97FF", "#FECB52",
)  # fmt: skip


class MissingExtraError(ValueError):
    """plotly is not installed."""


def require_plotly() -> None:
    if importlib.util.find_spec("plotly") is None:
        raise MissingExtraError(
            "rltool report draws with plotly, which is not installed: pip install 'rltool[report]'"
        )


def figure(chart: Chart) -> dict[str, Any]:
    """The chart as a plotly figure (plain data: validating it through plotly's objects
    costs about a second a chart). One colour per run, one dash per metric: the legend
    lists the runs (a click hides all of a run's lines), the subtitle the dashes, and a
    hover names both."""
    labels = list(dict.fromkeys(t.label for t in chart.traces))
    data, shown = [], set()
    for trace in chart.traces:
        if trace.band is not None:
            data.append(band_trace(trace))
        name = f"{trace.run} · {trace.label}" if len(labels) > 1 else trace.run
        line = {
            "color": COLOURS[trace.run_index % len(COLOURS)],
            "dash": DASHES[trace.dash_index % len(DASHES)],
            "width": 2,
        }
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": list(trace.series.steps),
                "y": list(trace.series.values),
                "name": trace.run,
                "showlegend": trace.run not in shown,
                "legendgroup": trace.run,
                "line": line,
                "marker": {"size": 5},
                "hovertemplate": f"{escape(name)}<br>step %{{x}}: %{{y}}<extra></extra>",
            }
        )
        shown.add(trace.run)
    spec = chart.spec
    title = spec.title
    if len(labels) > 1:
        # build_chart numbers the dashes in the order the labels first appear
        glyphs = [DASH_GLYPHS[i % len(DASH_GLYPHS)] for i in range(len(labels))]
        key = "   ".join(f"{g} {escape(x)}" for g, x in zip(glyphs, labels, strict=True))
        title += f"<br><sup>{key}</sup>"
    values = [v for t in chart.traces for v in t.series.values if v is not None]
    yaxis = {
        "title": {"text": spec.y_title},
        # no negative axis under figures that cannot be negative (all zeros: 0 to 1)
        "rangemode": "nonnegative" if all(v >= 0 for v in values) else "normal",
    }
    if spec.percent:
        yaxis["tickformat"] = ".0%"
    shapes, notes = marker_shapes(chart.markers)
    layout = {
        "title": {"text": title, "x": 0.02, "font": {"size": 16}},
        "height": 340,
        "margin": {"l": 60, "r": 20, "t": 64, "b": 40},
        "legend": {"orientation": "h", "y": -0.2, "x": 0},
        "showlegend": True,
        "xaxis": {"title": {"text": "step"}},
        "yaxis": yaxis,
        "shapes": shapes,
        "annotations": notes,
    }
    return {"data": data, "layout": layout}


def marker_shapes(markers: list[Marker]) -> tuple[list[dict], list[dict]]:
    """Each alarm marker as a dotted vertical line in its run's colour and its name written
    along it (plotly layout shapes and annotations)."""
    shapes, notes = [], []
    for m in markers:
        colour = COLOURS[m.run_index % len(COLOURS)]
        line = {"color": colour, "dash": "dot", "width": 1.5}
        shapes.append(
            {"type": "line", "xref": "x", "yref": "paper", "x0": m.step, "x1": m.step}
            | {"y0": 0, "y1": 1, "line": line}
        )
        notes.append(
            {"x": m.step, "y": 1, "xref": "x", "yref": "paper", "showarrow": False}
            | {"text": f"alarm: {escape(m.alarm)}", "textangle": -90, "xanchor": "left"}
            | {"yanchor": "top", "font": {"size": 10, "color": colour}}
        )
    return shapes, notes


def band_trace(trace: Trace) -> dict[str, Any]:
    """A trace's interval as a filled band in the run's colour, drawn under its line:
    one closed outline, along the highs and back along the lows (points without both
    bounds left out); not in the legend, which lists runs."""
    low, high = trace.band
    highs = dict(zip(high.steps, high.values, strict=True))
    pairs = [
        (step, lo, highs[step])
        for step, lo in zip(low.steps, low.values, strict=True)
        if lo is not None and highs.get(step) is not None
    ]
    colour = COLOURS[trace.run_index % len(COLOURS)]
    return {
        "type": "scatter",
        "mode": "lines",
        "x": [s for s, _, _ in pairs] + [s for s, _, _ in reversed(pairs)],
        "y": [hi for _, _, hi in pairs] + [lo for _, lo, _ in reversed(pairs)],
        "fill": "toself",
        "fillcolor": f"rgba({int(colour[1:3], 16)}, {int(colour[3:5], 16)}, "
        f"{int(colour[5:7], 16)}, 0.15)",
        "line": {"width": 0},
        "legendgroup": trace.run,
        "showlegend": False,
        "hoverinfo": "skip",
        "name": f"{trace.run} · {trace.label} 95% interval",
    }


@cache
def _template() -> dict[str, Any]:
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def chart_div(chart: Chart) -> str:
    """The chart as a plotly ``<div>`` (its figure in a script; no plotly.js)."""
    import plotly.io as pio

    fig = figure(chart)
    fig["layout"]["template"] = _template()
    return pio.to_html(
        fig,
        validate=False,
        full_html=False,
        include_plotlyjs=False,
        div_id=f"chart-{chart.spec.id}",
        config={"displayModeBar": False, "responsive": True},
    )


def _number(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:.1%}" if percent else f"{value:.3g}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _summary_row(run: RunRecord, s: RunSummary) -> str:
    final = _number(s.final_accuracy, percent=True)
    best = _number(s.best_accuracy, percent=True)
    if s.final_accuracy_step is not None:
        final += f" <small>(step {s.final_accuracy_step})</small>"
        best += f" <small>(step {s.best_accuracy_step})</small>"
    cells = [
        f"<b>{escape(run.name)}</b><br><small>{escape(str(run.path))}</small>",
        str(s.steps),
        final,
        best,
        _duration(s.time_s),
        str(run.resumes),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _summary_table(runs: list[RunRecord]) -> str:
    head = ["run", "steps", "final accuracy", "best accuracy", "time in steps + evals", "resumes"]
    rows = "".join(_summary_row(run, summarize(run)) for run in runs)
    return (
        "<table><thead><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def _recipes(runs: list[RunRecord]) -> str:
    out = []
    for run in runs:
        body = (
            f"<pre>{escape(run.config_text)}</pre>"
            if run.config_text is not None
            else "<p class='note'>no config.yaml in this run directory</p>"
        )
        out.append(
            f"<details><summary>{escape(run.name)}: the resolved recipe (config.yaml)"
            f"</summary>{body}</details>"
        )
    return "".join(out)


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px 32px;
       color: #1f2933; background: #fafbfc; }
h1 { font-size: 22px; margin: 0 0 4px 0; } h2 { font-size: 17px; margin: 28px 0 10px 0; }
table { border-collapse: collapse; background: white; font-size: 14px; }
th, td { border: 1px solid #d9dee5; padding: 6px 12px; text-align: left; vertical-align: top; }
th { background: #eef1f5; } small { color: #66707c; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 14px; }
.card { background: white; border: 1px solid #d9dee5; border-radius: 6px; padding: 4px; }
.card ul { margin: 0 8px 6px 8px; padding-left: 18px; font-size: 12px; color: #66707c; }
.note { color: #66707c; font-size: 13px; }
details { background: white; border: 1px solid #d9dee5; border-radius: 6px; margin: 6px 0;
          padding: 6px 10px; }
summary { cursor: pointer; font-weight: 600; }
pre { font-size: 12px; max-height: 480px; overflow: auto; }
"""


def render_html(runs: list[RunRecord], charts: list[Chart], notes: list[str]) -> str:
    """The whole page; ``notes``: what was left out (charts no run has a figure for, lines
    cut short)."""
    require_plotly()
    from plotly.offline import get_plotlyjs

    cards = []
    for chart in charts:
        missing = "".join(f"<li>{escape(n)}</li>" for n in chart.notes)
        cards.append(
            f"<div class='card'>{chart_div(chart)}{f'<ul>{missing}</ul>' if missing else ''}</div>"
        )
    names = ", ".join(escape(r.name) for r in runs)
    notes_html = (
        "<h2>Notes</h2><ul class='note'>"
        + "".join(f"<li>{escape(n)}</li>" for n in notes)
        + "</ul>"
        if notes
        else ""
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>rltool report: {names}</title><style>{STYLE}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
        f"<h1>rltool report</h1><p class='note'>{len(runs)} run(s): {names}</p>"
        f"<h2>Summary</h2>{_summary_table(runs)}"
        f"<h2>Curves</h2><div class='grid'>{''.join(cards)}</div>"
        f"{notes_html}<h2>Recipes</h2>{_recipes(runs)}</body></html>"
    )


@dataclass(slots=True)
class Report:
    path: Path  # the HTML file written
    runs: list[RunRecord]
    charts: list[Chart]  # the charts drawn
    notes: list[str]  # charts left out, lines cut short


def write_report(run_dirs: list[Path], out: Path) -> Report:
    """Read the runs, draw their charts and write the page to ``out`` (its directory made
    as needed). A ValueError when a directory is not a run or plotly is missing."""
    require_plotly()
    runs = read_runs(run_dirs)
    charts, skipped = build_charts(runs)
    notes = [note for run in runs for note in run.notes] + skipped
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(runs, charts, notes), encoding="utf-8")
    return Report(out, runs, charts, notes)
