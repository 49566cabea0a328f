"""``rltool eval A [B] [key=value ...] [--n N] [--k K ...] [--checkpoint DIR]``."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rltool.report.console import make_console

EXIT_USAGE = 2  # bad arguments, recipe or data (n < k, no eval data, no config.yaml,
# A and B on different prompts)
EXIT_NO_CHECKPOINT = 3  # nothing to evaluate: no complete checkpoint


class OutputFormat(StrEnum):
    RICH = "rich"
    JSON = "json"


def split_args(args: Sequence[str]) -> tuple[list[Path], list[str]]:
    """(the one or two sources, the dotlist overrides): an argument with ``=`` is an
    override, any other a source. ValueError unless there are one or two sources."""
    sources = [Path(a) for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if not 1 <= len(sources) <= 2:
        raise ValueError(
            f"give one source to evaluate, or two to compare (A B), got {len(sources)}: "
            + (", ".join(map(str, sources)) or "none")
        )
    return sources, overrides


def eval_command(
    args: Annotated[
        list[str],
        typer.Argument(
            help="A recipe YAML, a run directory (its config.yaml) or a checkpoint directory; "
            "a second one to compare with it (B - A); then dotlist overrides "
            "(data.eval_limit=50 ...), applied to both.",
            show_default=False,
        ),
    ],
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
    """Evaluate a checkpoint: pass@k, mean@n, maj@n with intervals; A B: their difference.

    Per task, each figure with a 95% bootstrap interval over prompts; with two sources A B,
    also the paired difference B - A and whether it is distinguishable from noise.
    Unbiased pass@k, mean reward (mean@n), majority vote over extracted answers (maj@n),
    mean response length, truncation and failures. n = 1 samples with
    rollout.eval_sampling (greedy by default), n > 1 with rollout.sampling. A run directory
    evaluates its newest complete checkpoint, a recipe its model.path. Exit 2: bad
    arguments, recipe or eval data; 3: no complete checkpoint; 1: the evaluation failed."""
    from rltool.app.checkpoint import NoCheckpointError
    from rltool.app.eval_compare import EvalSource, UnpairedError, compare, paired_sources
    from rltool.app.evaluate import NoEvalDataError, check_ks, eval_recipe, evaluate_checkpoint
    from rltool.produce.preflight import PreflightError
    from rltool.report.eval_view import render, render_comparison, render_json

    err = make_console(stderr=True)

    def fail(exc: Exception, code: int) -> typer.Exit:
        err.print(Text.assemble(("error:", "error"), f" {exc}"))
        return typer.Exit(code)

    try:
        check_ks(n, ks or [])
        sources, overrides = split_args(args)
        if len(sources) == 2:
            targets = paired_sources(*sources, overrides, checkpoint)
        else:
            recipe, run_dir, ckpt = eval_recipe(sources[0], overrides)
            targets = (EvalSource(recipe, run_dir, checkpoint or ckpt),)
    except (ValueError, FileNotFoundError) as exc:
        raise fail(exc, EXIT_USAGE) from exc
    try:
        reports = [
            evaluate_checkpoint(
                t.recipe,
                source=str(s),
                run_dir=t.run_dir,
                checkpoint=t.checkpoint,
                n=n,
                ks=ks or [],
            )
            for s, t in zip(sources, targets, strict=True)
        ]
        comparison = compare(*reports) if len(reports) == 2 else None
    except NoCheckpointError as exc:
        raise fail(exc, EXIT_NO_CHECKPOINT) from exc
    except (NoEvalDataError, PreflightError, UnpairedError) as exc:
        raise fail(exc, EXIT_USAGE) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise fail(exc, 1) from exc
    if output_format == OutputFormat.JSON:
        typer.echo(render_json(comparison or reports[0]))
    elif comparison is not None:
        render_comparison(comparison, make_console())
    else:
        render(reports[0], make_console())
