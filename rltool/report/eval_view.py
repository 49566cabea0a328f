"""Rich and JSON rendering of an ``EvalReport`` (``rltool eval``): one table, a row per
task and an overall row when there are several, failures by reason below it."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rltool.app.evaluate import EvalReport, TaskFigures


def render_json(report: EvalReport) -> str:
    """The whole report as one JSON object (``--format json``)."""
    return json.dumps(report.to_dict(), indent=1)


def _row(figs: TaskFigures, ks: list[int]) -> list[str]:
    return [
        figs.task,
        str(figs.prompts),
        *(f"{figs.pass_at[k]:.3f}" for k in ks),
        f"{figs.mean_response_len:.1f}",
        f"{figs.truncated_frac:.3f}",
        str(figs.failed),
    ]


def render(report: EvalReport, console: Console) -> None:
    step = "" if report.step is None else f" (step {report.step})"
    temp = report.sampling["temperature"]
    console.print(Text(f"weights: {report.weights}{step}"))
    console.print(
        Text(
            f"{report.n} sample(s) per prompt, temperature {temp}, "
            f"max_new_tokens {report.sampling['max_new_tokens']}"
        )
    )
    for skip in report.skipped:
        console.print(Text(f"skipped damaged checkpoint {skip}"), style="warning")
    table = Table(title_justify="left", expand=False)
    table.add_column("task")
    table.add_column("prompts", justify="right")
    for k in report.ks:
        table.add_column(f"pass@{k}", justify="right", style="metric")
    table.add_column("mean len", justify="right")
    table.add_column("truncated", justify="right")
    table.add_column("failed", justify="right")
    for figs in report.tasks:
        table.add_row(*_row(figs, report.ks))
    if len(report.tasks) > 1:
        table.add_row(*_row(report.overall, report.ks), style="bold")
    console.print(table)
    for figs in [report.overall] if len(report.tasks) == 1 else report.tasks:
        for reason, count in figs.failures.items():
            where = "" if len(report.tasks) == 1 else f"{figs.task}: "
            console.print(Text(f"failed {count}: {where}{reason}"), style="warning")
