"""``rltool eval RECIPE|RUN_DIR [key=value ...] [--n N] [--k K ...] [--checkpoint DIR]``."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rltool.report.console import make_console

EXIT_USAGE = 2  # bad arguments, recipe or data (n < k, no eval data, no config.yaml)
EXIT_NO_CHECKPOINT = 3  # nothing to evaluate: no complete checkpoint


class OutputFormat(StrEnum):
    RICH = "rich"
    JSON = "json"


def eval_command(
    source: Annotated[
        Path, typer.Argument(help="A recipe YAML, or a run directory (its config.yaml).")
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotlist overrides: data.eval_limit=50 ...")
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.")] = 1,
    ks: Annotated[
        list[int] | None, typer.Option("--k", help="pass@k to report (repeatable); default n.")
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="A checkpoint directory (default: the run's newest)."),
    ] = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="rich: a table; json: one object.")
    ] = OutputFormat.RICH,
) -> None:
    """Evaluate a checkpoint on the recipe's eval data: pass@1 and pass@k, per task.

    Unbiased pass@k, mean response length, truncation and failures. n = 1 samples with
    rollout.eval_sampling (greedy by default), n > 1 with rollout.sampling. A run directory
    evaluates its newest complete checkpoint, a recipe its model.path. Exit 2: bad
    arguments, recipe or eval data; 3: no complete checkpoint; 1: the evaluation failed."""
    from rltool.app.checkpoint import NoCheckpointError
    from rltool.app.evaluate import NoEvalDataError, check_ks, eval_recipe, evaluate_checkpoint
    from rltool.produce.preflight import PreflightError
    from rltool.report.eval_view import render, render_json

    err = make_console(stderr=True)

    def fail(exc: Exception, code: int) -> typer.Exit:
        err.print(Text.assemble(("error:", "error"), f" {exc}"))
        return typer.Exit(code)

    try:
        check_ks(n, ks or [])
        recipe, run_dir = eval_recipe(source, overrides or [])
    except (ValueError, FileNotFoundError) as exc:
        raise fail(exc, EXIT_USAGE) from exc
    try:
        report = evaluate_checkpoint(
            recipe, source=str(source), run_dir=run_dir, checkpoint=checkpoint, n=n, ks=ks or []
        )
    except NoCheckpointError as exc:
        raise fail(exc, EXIT_NO_CHECKPOINT) from exc
    except (NoEvalDataError, PreflightError) as exc:
        raise fail(exc, EXIT_USAGE) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise fail(exc, 1) from exc
    if output_format == OutputFormat.JSON:
        typer.echo(render_json(report))
    else:
        render(report, make_console())
