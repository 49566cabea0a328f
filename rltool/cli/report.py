"""``rltool report RUN_DIR [RUN_DIR ...] [-o OUT.html]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rltool.report.console import make_console

EXIT_USAGE = 2  # a directory that is not a run, a bad metrics line, plotly missing
REPORT_FILE = "report.html"


def report_command(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories (runs/<name>), overlaid in one report.")
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help=f"The HTML file (default: RUN_DIR/{REPORT_FILE} for one run, "
            f"./{REPORT_FILE} for several).",
        ),
    ] = None,
) -> None:
    """Write a self-contained HTML report of runs (opens offline).

    Charts: sampled reward, held-out accuracy, KL, entropy, clip fraction, response length,
    truncation, staleness, failures and the time split per step, each run in its colour; a
    summary table and each run's resolved recipe. A metric a run did not record is left out
    with a note. Needs the report extra (pip install 'rltool\\[report]'). Exit 2: a directory
    without metrics.jsonl, a bad metrics line, or plotly missing."""
    # Typer renders help as rich markup: the escaped bracket keeps [report] from being a style
    from rltool.report.html_report import write_report

    out = output or (run_dirs[0] / REPORT_FILE if len(run_dirs) == 1 else Path(REPORT_FILE))
    try:
        report = write_report(run_dirs, out)
    except ValueError as exc:
        make_console(stderr=True).print(Text.assemble(("error:", "error"), f" {exc}"))
        raise typer.Exit(EXIT_USAGE) from exc
    console = make_console()
    for note in report.notes:
        console.print(Text.assemble(("note:", "warning"), f" {note}"))
    console.print(
        Text.assemble(
            "wrote ",
            (str(report.path), "path"),
            f": {len(report.runs)} run(s), {len(report.charts)} charts",
        )
    )
