"""Rich and JSON rendering of a ``ValidationReport`` (``rltool validate-rollouts``).

The rich view is one table per file (line, severity, rollout_id, field[position],
invariant, message) and a summary. It caps the rows it draws; the JSON view
always holds every violation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import groupby

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rltool.rollout.validate import FileViolation, ValidationReport
from rltool.rollout.violation import Severity

MAX_ROWS = 200  # rows drawn by the rich view; --format json has them all

_MARK = {Severity.ERROR: ("✗ error", "error"), Severity.WARNING: ("! warning", "warning")}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _shown(violations: Sequence[FileViolation], max_rows: int) -> list[FileViolation]:
    """The rows to draw: all of them, or when capped errors first, each in file order."""
    if len(violations) <= max_rows:
        return list(violations)
    ranked = sorted(violations, key=lambda v: v.severity != Severity.ERROR)  # stable
    keep = {id(v) for v in ranked[:max_rows]}
    return [v for v in violations if id(v) in keep]


def _table(file: str, rows: list[FileViolation]) -> Table:
    table = Table(title=Text(file, style="path"), title_justify="left", expand=False)
    table.add_column("line", justify="right", style="path")
    table.add_column("severity", no_wrap=True)
    table.add_column("rollout_id", overflow="fold")
    table.add_column("field", style="field", overflow="fold")
    table.add_column("inv", justify="right", style="muted")
    table.add_column("message", overflow="fold")
    for v in rows:
        label, style = _MARK[v.severity]
        where = v.field or "-"
        if v.position is not None:
            where = f"{where}[{v.position}]"
        table.add_row(
            str(v.line),
            Text(label, style=style),
            v.rollout_id or "-",
            where,
            "-" if v.invariant is None else str(v.invariant),
            Text(v.message, style=style if v.severity == Severity.ERROR else ""),
        )
    return table


def summary_text(report: ValidationReport) -> Text:
    checked = (
        f"checked {_plural(report.samples, 'sample')} in {_plural(report.groups, 'group')} "
        f"from {_plural(report.files, 'file')}: "
    )
    found = f"{_plural(report.errors, 'error')}, {_plural(report.warnings, 'warning')}"
    if report.errors:
        return Text.assemble(("✗ ", "error"), checked, (found, "error"))
    style = "warning" if report.warnings else "ok"
    return Text.assemble(("✓ ", "ok"), checked, (found, style))


def render_report(report: ValidationReport, console: Console, *, max_rows: int = MAX_ROWS) -> None:
    """Print the violations, one table per file, then the summary."""
    shown = _shown(report.violations, max_rows)
    for file, rows in groupby(shown, key=lambda v: v.file):
        console.print(_table(file, list(rows)))
    hidden = len(report.violations) - len(shown)
    if hidden:
        console.print(f"[muted]… {hidden} more (use --format json to see all)[/muted]")
    console.print(summary_text(report))


def report_json(report: ValidationReport) -> str:
    """The machine format: one JSON object with counts and every violation."""
    return json.dumps(report.to_dict(), ensure_ascii=False)
