"""``rltool replay RUN_DIR --from-step N [--to-step M] [key=value ...]``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape


def replay_command(
    run_dir: Path = typer.Argument(..., help="A run trained with --dump-rollouts."),
    overrides: list[str] = typer.Argument(
        None, help="Dotlist overrides on the run's config: algorithm.policy_loss=gspo ..."
    ),
    from_step: int = typer.Option(
        ..., "--from-step", help="First step to replay; starts from the checkpoint at N-1."
    ),
    to_step: int = typer.Option(
        None, "--to-step", help="Last step to replay (default: the last dumped step)."
    ),
    out: Path = typer.Option(
        None, "--out", help="Directory to write into (default: RUN_DIR/replay-N-M); must not exist."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the result."),
) -> None:
    """Train steps N..M of a run again on its dumped rollouts, generating nothing.

    Without overrides the replayed weights match the run's checkpoint at M (a
    synchronous run, same machine and thread count); with overrides, compare algorithms
    on identical rollouts. Writes metrics.jsonl, config.yaml and a checkpoint at M into
    a new directory. Exit 2 on a missing or damaged dump or checkpoint."""
    from rltool.app.replay import replay
    from rltool.report.train_view import TrainView

    try:
        outcome = replay(
            run_dir, from_step, to_step, list(overrides or []), out, TrainView(quiet=quiet)
        )
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    Console().print(
        f"replayed steps {outcome.from_step}..{outcome.to_step}: "
        f"{escape(str(outcome.out_dir))} (checkpoint {escape(outcome.checkpoint.name)})"
    )
