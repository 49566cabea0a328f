"""``rltool --help``: one line per command, its docstring's first line; the detail stays in the
command's own ``--help`` (Typer shows a docstring's first paragraph in the command table)."""

from __future__ import annotations

import inspect
import re

from cli_runner import run_cli

from rltool.cli.app import app


def _summaries() -> dict[str, str]:
    out = {}
    for command in app.registered_commands:
        doc = inspect.getdoc(command.callback) or ""
        out[command.name] = doc.split("\n\n")[0]
    return out


def test_each_docstring_starts_with_a_one_line_summary() -> None:
    summaries = _summaries()
    assert set(summaries) == {
        "train", "validate-rollouts", "inspect-batch", "eval", "export", "report", "replay",
    }  # fmt: skip
    for name, summary in summaries.items():
        assert summary and "\n" not in summary, f"{name}: the first paragraph is not one line"
        assert len(summary) <= 90, f"{name}: a summary of {len(summary)} characters"


def test_top_level_help_shows_each_summary_on_one_line() -> None:
    result = run_cli(["--help"])  # a wide terminal: the test is about the docstrings
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for name, summary in _summaries().items():
        rows = [i for i, line in enumerate(lines) if re.match(rf"│ {re.escape(name)} ", line)]
        assert len(rows) == 1, f"{name} is not one row of the command table"
        assert summary in lines[rows[0]]
        following = lines[rows[0] + 1]
        # the next line is another command or the table's end: no wrapped continuation
        assert re.match(r"│ \S", following) or following.startswith("╰"), following


def test_report_help_names_the_extra() -> None:
    result = run_cli(["report", "--help"])
    assert result.exit_code == 0, result.output
    assert "pip install 'rltool[report]'" in result.stdout
