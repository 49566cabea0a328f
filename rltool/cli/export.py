"""``rltool export RUN_DIR OUT_DIR [--checkpoint DIR]``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rltool.report.console import make_console

EXIT_USAGE = 2  # no run config, OUT_DIR not empty, adapters that do not fit
EXIT_NO_CHECKPOINT = 3


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory that rltool train made.")],
    out_dir: Annotated[Path, typer.Argument(help="Where to write the model (new or empty).")],
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="A checkpoint directory (default: the run's newest)."),
    ] = None,
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory.

    model.path loads the directory; a LoRA run's adapters are merged into its base model.
    Exit 2: bad arguments or run; 3: no complete checkpoint."""
    from rltool.app.checkpoint import NoCheckpointError
    from rltool.app.export import export_model

    err = make_console(stderr=True)
    try:
        done = export_model(run_dir, out_dir, checkpoint)
    except NoCheckpointError as exc:
        err.print(Text.assemble(("error:", "error"), f" {exc}"))
        raise typer.Exit(EXIT_NO_CHECKPOINT) from exc
    except (ValueError, FileNotFoundError) as exc:
        err.print(Text.assemble(("error:", "error"), f" {exc}"))
        raise typer.Exit(EXIT_USAGE) from exc
    what = "base model + LoRA adapters, merged" if done.lora else "full weights"
    for line in done.skipped:
        err.print(f"skipped {line}")
    make_console().print(f"exported {done.checkpoint} ({what}) to {done.out_dir}")
