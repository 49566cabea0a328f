"""The ``rltool`` command: what it can answer before torch and transformers are imported.

Importing the commands costs seconds (torch, transformers); a ``train --resume RUN`` of a
run that another process trains is refused before that, in the time the interpreter takes
to start (the train command checks again, and the driver holds the lock for the run). And
OpenMP's wait policy must be in the environment before torch loads its OpenMP runtime.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path


def main() -> None:
    passive_openmp_waits(os.environ)
    refuse_run_in_use(sys.argv[1:])
    from rltool.cli.app import main as app_main

    app_main()


def passive_openmp_waits(environ: MutableMapping[str, str]) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy: torch's OpenMP threads then
    sleep between parallel regions instead of spinning. On cores another job also uses, a
    spinning thread holds a core the others wait for (the demo step 10.3 s against 6.0 s
    passive, two busy processes on 2 cores); on idle cores the two are alike
    (docs/foundations.md). Child processes (Ray workers, torchrun ranks) inherit it."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def refuse_run_in_use(args: list[str]) -> None:
    """Exit 2 with the holder's pid when ``args`` resume a run whose lock is held."""
    run_dir = _resumed_run(args)
    if run_dir is None or not run_dir.is_dir():
        return
    from rltool.app.run_lock import RunInUseError, RunLock

    try:
        RunLock(run_dir).check_free()
    except RunInUseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _resumed_run(args: list[str]) -> Path | None:
    """RUN of ``train ... --resume RUN`` (or ``--resume=RUN``); None for anything else."""
    if not args or args[0] != "train" or "--print-config" in args:
        return None
    for i, arg in enumerate(args):
        if arg == "--resume" and i + 1 < len(args):
            return Path(args[i + 1])
        if arg.startswith("--resume="):
            return Path(arg.removeprefix("--resume="))
    return None
