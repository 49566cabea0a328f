"""One writer per run directory (app/run_lock.py): a held lock refuses a second holder at
once, naming the holder; a lock file left by a dead process is taken over."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rltool.app.run_lock import HELD_ENV, LOCK_FILE, RunInUseError, RunLock

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"pid {os.getpid()} (started then)".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_held_lock_refuses_a_second_holder_naming_the_pid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} (started ")
        with pytest.raises(RunInUseError, match=rf"{run_dir} is in use by pid {os.getpid()} "):
            RunLock(run_dir).acquire()  # flock: two open files conflict, even in one process
    with RunLock(run_dir) as again:  # released: the next one takes it
        assert again.path.is_file()


def test_a_lock_file_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / LOCK_FILE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUseError, match=f"in use by pid {holder.pid} "):
            RunLock(run_dir).acquire()
    finally:
        holder.kill()  # SIGKILL: the kernel drops its lock, the file stays
        holder.wait(timeout=10)
    assert f"pid {holder.pid}" in (run_dir / LOCK_FILE).read_text()
    with RunLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_a_launcher_holding_the_lock_lets_its_leader_in(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        monkeypatch.setenv(HELD_ENV, str(run_dir.resolve()))
        RunLock(run_dir).acquire().release()  # no error: held for it
        monkeypatch.setenv(HELD_ENV, str(tmp_path / "other"))
        with pytest.raises(RunInUseError):
            RunLock(run_dir).acquire()


def test_a_check_writes_nothing_and_a_start_waits_out_a_check(tmp_path: Path) -> None:
    """A second command asking (``check_free``) must never make a starting run fail."""
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        before = (run_dir / LOCK_FILE).read_text()
        with pytest.raises(RunInUseError, match=f"in use by pid {os.getpid()} "):
            RunLock(run_dir).check_free()
    RunLock(run_dir).check_free()  # free: no error, and the holder's line is untouched
    assert (run_dir / LOCK_FILE).read_text() == before
    # someone asking holds the lock for a moment: a run starting then waits it out
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.2, lambda: (fcntl.flock(fd, fcntl.LOCK_UN), os.close(fd))).start()
    with RunLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
