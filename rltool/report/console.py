"""The one place rich consoles are made, with rltool's shared theme.

Reports go to stdout; progress bars and diagnostics go to stderr.
Design: docs/app.md#the-console
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.theme import Theme

THEME = Theme(
    {
        "error": "bold red",
        "warning": "yellow",
        "ok": "bold green",
        "path": "magenta",
        "field": "cyan",
        "muted": "dim",
        "metric": "bold",
    }
)


def make_console(
    *, stderr: bool = False, file: IO[str] | None = None, width: int | None = None
) -> Console:
    """A themed Console on stdout (default), stderr, or ``file``.

    ``highlight=False``: rich's automatic number/path highlighting would fight
    the theme's colours in tables of ids and values.
    """
    return Console(theme=THEME, stderr=stderr, file=file, width=width, highlight=False)


@contextmanager
def byte_progress(
    console: Console,
    total: int,
    *,
    description: str = "reading",
    min_total: int = 64 << 20,
    step: int = 1 << 20,
) -> Iterator[Callable[[int], None] | None]:
    """A transient bar counting ``total`` bytes; yields the callback to feed it bytes read.

    Yields None (no bar) when ``total < min_total``. The callback is cheap to call per
    line: it redraws at most every ``step`` bytes. Give it a stderr console; rich
    draws nothing when that is not a terminal, and the bar disappears when done.
    """
    if total < min_total:
        yield None
        return
    progress = Progress(
        TextColumn("[muted]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task(description, total=total)
    pending = 0

    def advance(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= step:
            progress.update(task, advance=pending)
            pending = 0

    with progress:
        yield advance
