"""SIGTERM to an async run whose rollout workers are Ray actors, before its first step:
a clean stop (exit 143, the message, no Ray crash dump), not Ray's abort (exit 134)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from short_runs import short_train_args

import rltool
from rltool.produce.ray_reaper import ray_descendants

ROOT = Path(rltool.__file__).parents[1]
ASYNC = ROOT / "recipes" / "gsm8k_tiny_async.yaml"


def _has_worker(pid: int) -> bool:
    for child in ray_descendants(pid):
        try:
            if b"_WorkerActor" in Path(f"/proc/{child}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds Ray's workers in /proc")
def test_sigterm_in_the_first_evaluation_of_a_ray_run_is_a_clean_stop(tiny_checkpoint, tmp_path):
    args = short_train_args(
        ASYNC,
        tiny_checkpoint,
        tmp_path,
        3,
        "rollout.sampling.max_new_tokens=4",
        "data.eval_limit=40",  # a first evaluation long enough to be signalled in
        "rollout.eval_sampling.max_new_tokens=32",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}
    main = "from rltool.cli.app import main; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", main, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 400
    while not _has_worker(proc.pid):  # Ray is up: its handlers were installed by now
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no Ray worker within 400 s"
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted by SIGTERM before step 1, nothing new to save" in out, out[-3000:]
    assert "SIGTERM received at time" not in out and "Traceback" not in out, out[-3000:]
