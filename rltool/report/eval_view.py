"""Rich and JSON rendering of ``rltool eval``: an ``EvalReport`` as one table, a row per
task and an overall row when there are several, each figure with its 95% interval below
it, failures by reason after it; an ``EvalComparison`` (``rltool eval A B``) as a table
per task: A, B and the paired difference B - A of each figure, and whether it is
distinguishable from noise."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rltool.app.eval_compare import EvalComparison
from rltool.app.evaluate import EvalReport, Figure, TaskFigures
from rltool.rollout.bootstrap import PairedDifference

VERDICT = "beyond noise?"
VERDICT_NOTE = (
    "beyond noise: the 95% interval of the paired difference B - A excludes 0; "
    "no: the difference is within what the draw of prompts and samples explains"
)


def render_json(report: EvalReport | EvalComparison) -> str:
    """The whole report (or comparison) as one JSON object (``--format json``)."""
    return json.dumps(report.to_dict(), indent=1)


def _figure(fig: Figure) -> str:
    """The value, and its interval on the line below (narrow columns on any terminal)."""
    return f"{fig.value:.3f}\n[{fig.low:.3f}, {fig.high:.3f}]"


def _row(figs: TaskFigures, names: list[str]) -> list[str]:
    return [
        figs.task,
        str(figs.prompts),
        *(_figure(figs.figures[x]) if x in figs.figures else "–" for x in names),
        f"{figs.mean_response_len:.1f}",
        f"{figs.truncated_frac:.3f}",
        str(figs.failed),
    ]


def _figure_names(report: EvalReport) -> list[str]:
    """Every figure some task has, in the order computed (pass@k, mean@n, maj@n)."""
    return list(dict.fromkeys(x for f in [*report.tasks, report.overall] for x in f.figures))


def _header(report: EvalReport, console: Console, label: str = "") -> None:
    step = "" if report.step is None else f" (step {report.step})"
    console.print(Text(f"{label}weights: {report.weights}{step}"))
    for skip in report.skipped:
        console.print(Text(f"skipped damaged checkpoint {skip}"), style="warning")


def _sampling(report: EvalReport, console: Console) -> None:
    console.print(
        Text(
            f"{report.n} sample(s) per prompt, temperature {report.sampling['temperature']}, "
            f"max_new_tokens {report.sampling['max_new_tokens']}, seed {report.seed}; "
            "[low, high]: 95% bootstrap interval over prompts"
        )
    )


def _notes(report: EvalReport, console: Console, label: str = "") -> None:
    one = len(report.tasks) == 1
    for figs in [report.overall] if one else report.tasks:
        where = "" if one else f"{figs.task}: "
        if figs.maj_missing is not None:
            console.print(Text(f"{label}{where}{figs.maj_missing}"), style="muted")
        for reason, count in figs.failures.items():
            console.print(Text(f"{label}failed {count}: {where}{reason}"), style="warning")


def render(report: EvalReport, console: Console) -> None:
    _header(report, console)
    _sampling(report, console)
    names = _figure_names(report)
    table = Table(title_justify="left", expand=False)
    table.add_column("task")
    table.add_column("prompts", justify="right")
    for name in names:
        table.add_column(name, justify="right", style="metric")
    table.add_column("mean len", justify="right")
    table.add_column("truncated", justify="right")
    table.add_column("failed", justify="right")
    for figs in report.tasks:
        table.add_row(*_row(figs, names))
    if len(report.tasks) > 1:
        table.add_row(*_row(report.overall, names), style="bold")
    console.print(table)
    _notes(report, console)


def _difference(d: PairedDifference) -> str:
    return f"{d.mean:+.3f}\n[{d.interval.low:+.3f}, {d.interval.high:+.3f}]"


def render_comparison(comp: EvalComparison, console: Console) -> None:
    """A table per task (and overall): each figure of A and B with its interval, the
    paired difference B - A with its interval, and the verdict."""
    _header(comp.a, console, "A ")
    _header(comp.b, console, "B ")
    _sampling(comp.a, console)
    figs_a = {f.task: f for f in [*comp.a.tasks, comp.a.overall]}
    figs_b = {f.task: f for f in [*comp.b.tasks, comp.b.overall]}
    for task, diffs in comp.differences.items():
        a, b = figs_a[task], figs_b[task]
        table = Table(title=f"{task}: {a.prompts} prompts, B - A per prompt", title_justify="left")
        for column in ("figure", "A", "B", "B - A"):
            table.add_column(column, justify="left" if column == "figure" else "right")
        table.add_column(VERDICT)
        for name, d in diffs.items():
            verdict = "yes" if d.distinguishable else "no"
            table.add_row(
                name, _figure(a.figures[name]), _figure(b.figures[name]), _difference(d), verdict
            )
        console.print(table)
    console.print(Text(VERDICT_NOTE), style="muted")
    _notes(comp.a, console, "A ")
    _notes(comp.b, console, "B ")
