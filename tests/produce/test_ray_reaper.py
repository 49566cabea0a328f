"""The local Ray's helpers die with the trainer, even by kill -9 (produce/ray_reaper.py):
measured with ray 2.60, the dashboard and runtime-env agents outlived a killed trainer by
about a minute."""

from __future__ import annotations

import json
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
# a trainer stand-in: a helper of its own session named like a Ray process, then the reaper
DRIVER = """
import subprocess, sys, time
from rltool.produce.ray_reaper import start_reaper
helper = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)", "ray::DashboardAgent"],
    start_new_session=True,
)
start_reaper()
time.sleep(2)  # the reaper has seen the helper
print(helper.pid, flush=True)
time.sleep(120)
"""


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie is dead, waiting for its parent to read its status
            out.add(pid)
    return out


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the reaper reads /proc")
def test_a_helper_of_a_killed_driver_is_reaped(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True
    )
    helper = int(driver.stdout.readline())
    try:
        assert _alive({helper}) == {helper}
        driver.kill()
        driver.wait(timeout=10)
        assert _gone_within({helper}, 10) == set()
    finally:
        if _alive({helper}):
            os.kill(helper, signal.SIGKILL)


@pytest.mark.slow
def test_ray_processes_end_within_10_s_of_a_kill_9_of_the_trainer(tiny_checkpoint, tmp_path):
    args = short_train_args(
        ASYNC,
        tiny_checkpoint,
        tmp_path,
        1000,
        "rollout.sampling.max_new_tokens=4",
        "rollout.eval_sampling.max_new_tokens=4",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    main = "from rltool.cli.app import main; main()"
    trainer = subprocess.Popen(
        [sys.executable, "-c", main, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    try:
        while not (metrics.is_file() and '"train"' in metrics.read_text()):
            assert trainer.poll() is None, "the trainer ended before its first step"
            assert time.monotonic() < deadline, "no train step within 400 s"
            time.sleep(0.5)
        ray = set(ray_descendants(trainer.pid))
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for p in ray}
        assert any(b"Agent" in n for n in names), names  # the ones that used to linger
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    left = _gone_within(ray, 10)
    lingering = [json.dumps(Path(f"/proc/{p}/cmdline").read_text()[:120]) for p in left]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == set(), lingering
