"""The one way tests run `rltool` and read what rich printed: on a fixed wide terminal.

rich wraps at the terminal's width (``COLUMNS``, else 80 off a terminal), so the same
message breaks at a different place under a narrower terminal or a longer temporary path,
and a test that reads it would pass or fail by the machine. Every command here runs with
``COLUMNS=WIDTH``, whatever the caller's environment says, so a line a test reads is one
line; tests that need structure read ``--format json`` instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from click.testing import Result
from typer.testing import CliRunner

from rltool.cli.app import app

# wider than any line a test reads: a message with two paths under a 100-character TMPDIR
WIDTH = 1000
WIDE = {"COLUMNS": str(WIDTH)}


def run_cli(
    args: Sequence[str | Path],
    *,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    catch_exceptions: bool = False,
) -> Result:
    """``rltool ARGS`` in-process on a ``WIDTH``-column terminal; ``env`` adds variables.

    The process's torch thread count is restored afterwards: an async run splits it
    between the producer and the trainer.
    """
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(
            app,
            [str(a) for a in args],
            env={**(env or {}), **WIDE},
            input=input,
            catch_exceptions=catch_exceptions,
        )
    finally:
        torch.set_num_threads(threads)


def wide_environ(**extra: str) -> dict[str, str]:
    """The environment for `rltool` in a subprocess: this one, on a ``WIDTH``-column terminal."""
    return {**os.environ, **extra, **WIDE}
