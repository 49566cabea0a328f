"""One writer per run directory: ``RUN/.lock``, an OS file lock (``flock``) held for the
run's life, the holder's pid and start time written into it.

The kernel releases the lock when its holder dies, however it dies (kill -9 included), so
a lock file left by a dead process is simply locked again: nothing stale to clean up.
Under FSDP2 only the leader (or the launcher of a resume) holds it; the launcher tells the
leader through ``HELD_ENV`` that the lock is held for it.
Design: docs/app.md#one-writer-per-run
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = ".lock"
# set by a launcher that holds RUN's lock for the processes it starts: RUN's absolute path
HELD_ENV = "RLTOOL_RUN_LOCK_HELD"


# how long ``acquire`` waits out another process's ``check_free`` (which holds for microseconds)
PROBE_WAIT_S = 1.0


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class RunInUseError(ValueError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """``flock`` on ``run_dir/.lock``; ``acquire`` raises ``RunInUseError`` when another
    run holds it. A context manager that releases it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Hold the lock for this run's life, the pid and start time written into it.

        Another process may hold it for an instant (``check_free``, a second command
        asking): that is waited out, up to ``PROBE_WAIT_S``; a run holding it is not."""
        if os.environ.get(HELD_ENV) == str(self.run_dir.resolve()):
            return self  # the launcher above this process holds it
        fd = self._open()
        deadline = time.monotonic() + PROBE_WAIT_S
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise self._in_use(fd)
            time.sleep(0.01)
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        os.write(fd, f"pid {os.getpid()} (started {started})\n".encode())
        self._fd = fd
        return self

    def check_free(self) -> None:
        """Raise ``RunInUseError`` when a run holds the lock. Takes it for an instant
        only and writes nothing, so a run starting meanwhile is not refused for it."""
        if os.environ.get(HELD_ENV) == str(self.run_dir.resolve()):
            return
        fd = self._open()
        if not _try_lock(fd):
            raise self._in_use(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _open(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited (O_CLOEXEC)

    def _in_use(self, fd: int) -> RunInUseError:
        holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
        os.close(fd)
        return RunInUseError(
            f"{self.run_dir} is in use by {holder or 'another process'}; "
            "wait for it to end or stop it first"
        )

    def release(self) -> None:
        """Unlock; the file stays (removing it would let a third process lock a new
        file while a second one waits on the old one's lock)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()
