"""``rltool train recipe.yaml [key=value ...]``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.syntax import Syntax


def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML (e.g. recipes/gsm8k_tiny.yaml)."),
    overrides: list[str] = typer.Argument(None, help="Dotlist overrides: trainer.steps=5 ..."),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the resolved recipe and exit."
    ),
    resume: Path = typer.Option(
        None, "--resume", help="Continue the run in this directory from its last checkpoint."
    ),
    dump_rollouts: bool = typer.Option(
        False, "--dump-rollouts", help="Write each step's rollouts to RUN_DIR/rollouts/*.jsonl."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary."),
) -> None:
    """Train a policy with RL as the recipe says."""
    from rltool.config.loader import load_recipe, recipe_to_yaml

    overrides = overrides or []
    if resume is not None and not recipe.exists():
        raise typer.BadParameter(f"recipe {recipe} does not exist")
    try:
        cfg = load_recipe(recipe, overrides)
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    if print_config:
        Console().print(Syntax(recipe_to_yaml(cfg), "yaml"))
        return

    from rltool.app.driver import train as run_training
    from rltool.report.train_view import TrainView

    view = TrainView(quiet=quiet)
    try:
        run_training(cfg, resume_dir=resume, dump_rollouts=dump_rollouts, view=view)
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(1) from exc
