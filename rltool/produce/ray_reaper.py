"""The local Ray's helpers die with the process that started it, even by kill -9.

``ray.init`` ties the raylet and GCS to this process, but the raylet's own children (the
dashboard and runtime-env agents, measured with ray 2.60) notice their parent's death and
then block for about a minute reporting it to the dead GCS; workers may linger too. The
reaper, a small process of its own session (Ctrl-C does not reach it) started once per
process, records this process's Ray descendants every half second and SIGKILLs the ones
still alive once this process is gone. Linux only (reads /proc); stdlib only, so that it
runs as a plain script without importing rltool. Design: docs/production.md#starting-or-joining-ray
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

INTERVAL_S = 0.5
# in the command line of every Ray process: a renamed one (ray::DashboardAgent,
# ray::IDLE, ray::_WorkerActor) or one run from the package (.../ray/core/.../raylet)
RAY_MARKS = (b"ray::", b"/ray/")
_started: list[subprocess.Popen] = []


def start_reaper() -> None:
    """Start the reaper of this process's Ray helpers (once; not where /proc is missing)."""
    if _started or not Path("/proc/self/stat").is_file():
        return
    _started.append(
        subprocess.Popen(
            [sys.executable, __file__, str(os.getpid()), _start_time(os.getpid()) or ""],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None  # field 22, starttime: tells a reused pid apart


def ray_descendants(root: int) -> dict[int, str]:
    """Every descendant of ``root`` whose command line names ray: pid -> start time."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            parent[int(entry.name)] = int(fields[1])
    found: dict[int, str] = {}
    for pid in parent:
        up = parent.get(pid)
        while up is not None and up != root and up > 1:
            up = parent.get(up)
        if up != root or pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        start = _start_time(pid)
        if any(mark in cmdline for mark in RAY_MARKS) and start is not None:
            found[pid] = start
    return found


def reap(driver: int, driver_start: str) -> None:
    """Watch ``driver``; once it is gone, SIGKILL its Ray descendants last seen."""
    seen: dict[int, str] = {}
    while _start_time(driver) == driver_start:
        seen = ray_descendants(driver) or seen
        time.sleep(INTERVAL_S)
    for pid, start in seen.items():
        if _start_time(pid) == start:  # the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError):  # ended since the check
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    reap(int(sys.argv[1]), sys.argv[2])
