"""``rltool validate-rollouts FILE...``: check rollout files against the data contract."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rltool.models import vocab_size_at
from rltool.report.console import byte_progress, make_console
from rltool.report.validate_view import render_report, report_json
from rltool.rollout.validate import NO_SAMPLES, InputError, check_readable, validate_files

PROGRESS_MIN_BYTES = 64 << 20  # draw a progress bar only for inputs bigger than this


class OutputFormat(StrEnum):
    RICH = "rich"
    JSON = "json"


def validate_rollouts(
    files: Annotated[list[Path], typer.Argument(help="Rollout JSONL files to check.")],
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="rich: readable report; json: one object.")
    ] = OutputFormat.RICH,
    num_experts: Annotated[
        int | None,
        typer.Option(
            "--num-experts", min=1, help="The MoE model's expert count: bounds routed_experts."
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        typer.Option(
            "--vocab-size", min=1, help="The model's vocabulary (embedding rows): bounds token ids."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A checkpoint (directory, hub id or builtin:): its config's vocab_size "
            "bounds token ids.",
        ),
    ] = None,
) -> None:
    """Check rollout files against every invariant of the data contract (section 4).

    Exit code 0: clean (warnings allowed); 1: a sample breaks the contract, a
    line is unparsable or a file holds no samples; 2: a file is missing, not a
    regular file (a directory, a FIFO) or unreadable.
    """
    err_console = make_console(stderr=True)
    try:
        vocab_size = _vocab_size(vocab_size, model)
        paths = check_readable(files)
        total = sum(p.stat().st_size for p in paths)
        with byte_progress(
            err_console, total, description="validating", min_total=PROGRESS_MIN_BYTES
        ) as progress:
            report = validate_files(
                paths, progress=progress, num_experts=num_experts, vocab_size=vocab_size
            )
    except InputError as err:
        err_console.print(Text.assemble(("error:", "error"), f" {err}"))
        raise typer.Exit(2) from err
    for v in report.violations:
        if v.message == NO_SAMPLES and v.line == 0:
            err_console.print(Text.assemble(("error:", "error"), f" {v.file}: {NO_SAMPLES}"))
    if output_format == OutputFormat.JSON:
        typer.echo(report_json(report))
    else:
        render_report(report, make_console())
    raise typer.Exit(0 if report.ok else 1)


def _vocab_size(given: int | None, model: str | None) -> int | None:
    """The bound of token ids: ``--vocab-size``, or the embedding rows of ``--model``'s
    config (``len(tokenizer)`` may be smaller: ids past it still have their rows)."""
    if model is None:
        return given
    if given is not None:
        raise InputError("give --vocab-size or --model, not both")
    try:
        return vocab_size_at(model, "--model")
    except (ValueError, OSError) as exc:
        raise InputError(str(exc)) from exc
