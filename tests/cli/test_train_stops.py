"""`rltool train` stopped before its first step, a run directory another process holds,
and a new run that fails before it starts: what is printed, the exit code, and what
``--resume`` does next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import run_cli, wide_environ
from short_runs import short_gsm8k_args

import rltool
from rltool.app import driver
from rltool.app.run_lock import LOCK_FILE, RunLock
from rltool.config.loader import load_recipe, recipe_to_yaml

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml")
MAIN = "from rltool.cli.entry import main; main()"  # what the rltool script runs


def _keys(run_dir: Path) -> list[tuple[int, str]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(x["step"], x["kind"]) for x in map(json.loads, lines)]


def test_sigterm_in_the_first_evaluation_stops_and_resume_starts_at_step_0(
    tiny_checkpoint, tmp_path, monkeypatch
):
    real = driver._evaluate

    def evaluate_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during the evaluation at step 0
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "_evaluate", evaluate_then_signal)
    run_dir = tmp_path / "t"
    result = run_cli(short_gsm8k_args(tiny_checkpoint, tmp_path, 1))
    assert result.exit_code == 143, result.output
    assert (
        "interrupted by SIGTERM before step 1, nothing new to save; continue with: "
        f"rltool train --resume {run_dir}"
    ) in result.output
    assert not (run_dir / "checkpoints").exists()
    assert _keys(run_dir) == [(0, "eval")]

    monkeypatch.undo()
    again = run_cli(["train", "--resume", str(run_dir)])
    assert again.exit_code == 0, again.output
    assert f"no checkpoint yet in {run_dir}: starting from step 0 with its config" in again.output
    assert _keys(run_dir) == [(0, "eval"), (1, "train"), (1, "eval")]  # step 0 evaluated once
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_first_ctrl_c_while_loading_is_a_clean_stop_not_the_second(
    tiny_checkpoint, tmp_path, monkeypatch
):
    real = driver.build_run

    def build_then_ctrl_c(*args, **kwargs):
        run = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, while the model loads
        return run

    monkeypatch.setattr(driver, "build_run", build_then_ctrl_c)
    result = run_cli(short_gsm8k_args(tiny_checkpoint, tmp_path, 2))
    assert result.exit_code == 130, result.output
    assert "interrupted by SIGINT before step 1, nothing new to save" in result.output
    assert "second Ctrl-C" not in result.output
    assert not (tmp_path / "t" / "metrics.jsonl").read_text()  # not even evaluated


def test_a_run_directory_in_use_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(recipe_to_yaml(load_recipe(RECIPE, [])))

    def never(*args, **kwargs):
        raise AssertionError("the model must not load for a run in use")

    monkeypatch.setattr(driver, "build_run", never)
    with RunLock(run_dir):
        result = run_cli(["train", "--resume", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert f"error: {run_dir} is in use by pid {os.getpid()} (started " in result.output


def test_a_new_run_that_fails_before_it_starts_leaves_no_directory(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("data.train_files: no such file")

    monkeypatch.setattr(driver, "build_run", broken)
    result = run_cli(["train", RECIPE, f"logging.run_dir={tmp_path}", "logging.name=t"])
    assert result.exit_code == 1
    assert "data.train_files: no such file" in result.output
    assert list(tmp_path.iterdir()) == []


def _start(*args: str) -> subprocess.Popen:
    env = wide_environ(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(rltool.__file__).parents[1]))
    return subprocess.Popen(
        [sys.executable, "-c", MAIN, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_locked(run_dir: Path, pid: int) -> None:
    deadline = time.monotonic() + 120
    lock = run_dir / LOCK_FILE
    while not (lock.is_file() and lock.read_text().startswith(f"pid {pid} ")):
        assert time.monotonic() < deadline, f"{lock} never held by {pid}"
        time.sleep(0.02)


@pytest.mark.slow
def test_real_signals_and_a_second_process_on_one_run(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "t"
    first = _start(*short_gsm8k_args(tiny_checkpoint, tmp_path, 2))
    _wait_locked(run_dir, first.pid)
    first.send_signal(signal.SIGTERM)  # while the model loads: before step 1
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 143, out
    assert "interrupted by SIGTERM before step 1, nothing new to save" in out, out
    assert "Traceback" not in out

    trainer = _start("train", "--resume", str(run_dir), "trainer.steps=100000")
    _wait_locked(run_dir, trainer.pid)
    t0 = time.monotonic()
    second = _start("train", "--resume", str(run_dir))
    out2, _ = second.communicate(timeout=120)
    took = time.monotonic() - t0
    if trainer.poll() is not None:
        raise AssertionError(f"the trainer ended before the check: {trainer.communicate()[0]}")
    trainer.kill()  # kill -9: the kernel drops its lock
    trainer.communicate(timeout=60)
    assert second.returncode == 2, out2
    assert f"{run_dir} is in use by pid {trainer.pid} (started " in out2
    print(f"second process refused in {took:.2f} s (interpreter start included)")

    third = _start("train", "--resume", str(run_dir), "trainer.steps=1")
    out3, _ = third.communicate(timeout=300)
    assert third.returncode == 0, out3  # the dead holder's lock taken over
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
