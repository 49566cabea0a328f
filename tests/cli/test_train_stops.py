"""`rltool train` stopped before its first step, a run directory another process holds,
and a new run that fails before it starts: what is printed, the exit code, and what
``--resume`` does next."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from cli_runner import run_cli
from short_runs import short_gsm8k_args

from rltool.app import driver
from rltool.app.run_lock import RunLock
from rltool.config.loader import load_recipe, recipe_to_yaml

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml")


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
