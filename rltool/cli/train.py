"""``rltool train RECIPE [key=value ...]``, ``rltool train --resume RUN_DIR [key=value ...]``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

# the shell's convention for a process ended by a signal: 128 + the signal's number
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def train(
    recipe: str = typer.Argument(
        None, help="Recipe YAML (e.g. recipes/gsm8k_tiny.yaml); with --resume, optional."
    ),
    overrides: list[str] = typer.Argument(None, help="Dotlist overrides: trainer.steps=5 ..."),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the resolved recipe and exit."
    ),
    resume: Path = typer.Option(
        None,
        "--resume",
        help="Continue the run in this directory from its newest complete checkpoint, with "
        "its own config.yaml (overrides change it; a recipe given must match it).",
    ),
    dump_rollouts: bool = typer.Option(
        False, "--dump-rollouts", help="Write each step's rollouts to RUN_DIR/rollouts/*.jsonl."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary."),
) -> None:
    """Train a policy with RL as the recipe says.

    Exit 130 / 143 after a clean stop on Ctrl-C / SIGTERM (the checkpoint is saved); exit 3
    when the run trained on no sample at all, or stopped because every sample failed
    trainer.max_failed_steps steps in a row (the failure reasons are printed), or no
    rollout server is left (each one named)."""
    from rltool.app.run_lock import RunInUseError, RunLock
    from rltool.config.loader import load_recipe, recipe_to_yaml, resume_recipe

    if resume is not None and resume.is_dir() and not print_config:
        try:  # a run in use: said at once (the driver holds the lock for the run's life)
            RunLock(resume).check_free()
        except RunInUseError as exc:
            Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from exc
    overrides = list(overrides or [])
    if resume is not None and recipe is not None and "=" in recipe and not Path(recipe).exists():
        overrides.insert(0, recipe)  # `--resume RUN key=value`: no recipe, an override
        recipe = None
    try:
        if resume is not None:
            cfg = resume_recipe(resume, overrides, recipe)
        elif recipe is None:
            raise ValueError("give a recipe (rltool train RECIPE.yaml) or --resume RUN_DIR")
        else:
            cfg = load_recipe(recipe, overrides)
        # the registries' names (engines, loops, estimators, ...), before any model loads
        from rltool.app.recipe_names import check_config

        check_config(cfg, f"recipe {recipe}" if resume is None else f"--resume {resume}")
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if print_config:
        Console().print(Syntax(recipe_to_yaml(cfg), "yaml"))
        return
    argv = ["train", *([recipe] if recipe else []), *overrides]
    argv += [*(["--resume", str(resume)] if resume else []), *(["--quiet"] if quiet else [])]
    if _several_processes(cfg, argv + (["--dump-rollouts"] if dump_rollouts else []), resume):
        return

    from rltool.app.checkpoint import DiskFullError
    from rltool.app.driver import train as run_training
    from rltool.app.failed_steps import EXIT_TRAINED_NOTHING
    from rltool.app.signals import SecondInterrupt
    from rltool.engines.base import ServersDown
    from rltool.produce.preflight import PreflightError
    from rltool.report.train_view import TrainView

    view = TrainView(quiet=quiet)
    try:
        outcome = run_training(cfg, resume_dir=resume, dump_rollouts=dump_rollouts, view=view)
    except (PreflightError, RunInUseError) as exc:  # refused before the model loads
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    except (ValueError, FileNotFoundError, DiskFullError) as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from exc
    except ServersDown as exc:  # at start or resume (weights pushed); mid-run: outcome.failure
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_TRAINED_NOTHING) from exc
    except KeyboardInterrupt as exc:  # a second Ctrl-C: stop now, without a save
        how = "by a second Ctrl-C" if isinstance(exc, SecondInterrupt) else "by Ctrl-C"
        Console(stderr=True).print(
            f"[bold yellow]aborted[/] {how}; the newest complete checkpoint stays "
            "(rltool train --resume RUN_DIR continues from it)"
        )
        raise typer.Exit(EXIT_CODES["SIGINT"]) from exc
    code = EXIT_CODES.get(outcome.stopped_by)
    if code is not None:
        what = (
            f"after step {outcome.steps_done}, checkpoint saved"
            if outcome.saved is not None
            else f"before step {outcome.steps_done + 1}, nothing new to save"
        )
        Console().print(
            f"[bold yellow]interrupted by {outcome.stopped_by}[/] {what}; continue with: "
            f"rltool train --resume {escape(str(outcome.run_dir))}"
        )
        raise typer.Exit(code)
    if outcome.failure is not None:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(outcome.failure)}")
        raise typer.Exit(EXIT_TRAINED_NOTHING)


def _several_processes(cfg, argv: list[str], resume: Path | None) -> bool:
    """``distributed.nproc_per_node`` > 1: relaunch this command through
    torch.distributed.run and exit with its status; a rank other than 0 of such a group
    follows the leader and prints nothing. False: this process is the one that trains."""
    from rltool.app.distributed import follow, is_follower, relaunch_command, run_launcher

    try:
        command = relaunch_command(cfg, argv)
        if command is not None:
            status = run_launcher(command, resume)  # ValueError: the run is in use
    except ValueError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from exc
    if command is not None:
        raise typer.Exit(status)
    if is_follower():
        follow(cfg)
        return True
    return False
