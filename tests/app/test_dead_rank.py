"""A rank of a several-process run that dies: the launcher names the rank and the cause
and prints the ``--resume`` line (app/distributed.py); the run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import wide_environ
from short_runs import short_gsm8k_args

from rltool.app.distributed import root_cause

ROOT = Path(__file__).resolve().parents[2]

# the end of torchrun's output when rank 1 was killed (torch 2.13)
TORCHRUN_TAIL = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
rltool.cli.app FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_18:58:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_the_root_cause_names_the_rank_and_the_signal() -> None:
    lines = TORCHRUN_TAIL.splitlines(keepends=True)
    assert root_cause(lines) == "rank 1 was killed (exit code -9, SIGKILL)"
    failed = [x.replace("-9 (pid: 4242) (SIGKILL)", "1 (pid: 4242)") for x in lines]
    assert root_cause(failed) == "rank 1 failed (exit code 1)"
    assert root_cause(["Traceback (most recent call last):\n", "ValueError: x\n"]) is None


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of ``rank`` among the launcher's descendants (RANK in its environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            pid, up = int(entry.name), int(stat[1])
            for _ in range(4):  # launcher -> torchrun -> rank
                if up == launcher:
                    return pid
                try:
                    up = int(Path(f"/proc/{up}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except OSError:
                    break
    return None


@pytest.mark.slow
def test_a_killed_rank_is_named_with_the_resume_line(tiny_checkpoint, tmp_path) -> None:
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 2000, "distributed.nproc_per_node=2")
    run_dir = tmp_path / "t"
    ckpt_args = ["trainer.save_every=1", "--quiet"]
    env = wide_environ(PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rltool.cli.app", *args, *ckpt_args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 500
    latest = run_dir / "checkpoints" / "latest"
    while not latest.is_file():  # a checkpoint exists: the resume has one to take
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 500 s"
        time.sleep(0.5)
    follower = _rank_pid(launcher.pid, 1)
    assert follower is not None
    os.kill(follower, signal.SIGKILL)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode != 0
    assert "error: rank 1 was killed (exit code -9, SIGKILL); the group stopped." in err
    assert "Continue from the newest complete checkpoint with: rltool train --resume" in err

    one = ["distributed.nproc_per_node=1", "trainer.steps=1", "--quiet"]
    again = subprocess.run(
        [sys.executable, "-m", "rltool.cli.app", "train", "--resume", str(run_dir), *one],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert resumed["checkpoint"].startswith("step_")  # from the checkpoint before the kill
