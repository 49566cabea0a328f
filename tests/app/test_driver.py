"""The step loop around training: mid-run evaluation, periodic saves, the time budget, and
the checks that run before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from short_runs import short_gsm8k_args


def _args(ckpt: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return short_gsm8k_args(ckpt, run_dir, steps, *extra)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_mid_run_evaluation_and_periodic_saves(tiny_checkpoint, tmp_path):
    args = _args(tiny_checkpoint, tmp_path, 4, "trainer.eval_every=2", "trainer.save_every=2")
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = _lines(tmp_path / "t")
    # before step 1, after step 2, and once at the end (step 4 is not evaluated twice)
    assert [x["step"] for x in lines if x["kind"] == "eval"] == [0, 2, 4]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2, 3, 4]
    for x in (x for x in lines if x["kind"] == "eval"):  # the accuracy with its interval
        assert x["eval/accuracy_ci_low"] <= x["eval/accuracy"] <= x["eval/accuracy_ci_high"]
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000002", "step_000004"]  # every 2 steps (the end is step 4)
    assert (tmp_path / "t" / "checkpoints" / "latest").read_text().strip() == "step_000004"


def test_time_budget_stops_after_the_step_that_crossed_it(tiny_checkpoint, tmp_path):
    result = run_cli(_args(tiny_checkpoint, tmp_path, 50, "trainer.time_budget_s=0.001"))
    assert result.exit_code == 0, result.output
    lines = _lines(tmp_path / "t")
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1]
    assert [x["step"] for x in lines if x["kind"] == "eval"] == [0, 1]  # the end still evaluates
    assert (tmp_path / "t" / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert "time_budget" in result.output


def test_bad_names_fail_before_the_model_loads(tmp_path):
    # model.path names no checkpoint: loading it would fail, so the name check came first
    missing = tmp_path / "no-such-model"
    for override, named in (
        ("rollout.backend=nope", "rollout.backend"),
        ("produce.group_filter=nope", "nope"),
        ("algorithm.estimator=nope", "nope"),
        ("rollout.engine=nope", "rollout.engine = 'nope': must be a known rollout engine: hf"),
    ):
        result = run_cli(_args(missing, tmp_path, 1, override))
        assert result.exit_code == 2, result.output
        assert named in result.output and "no-such-model" not in result.output, result.output


def test_an_evaluation_where_every_sample_failed_stops_the_run_and_keeps_its_training(
    tiny_checkpoint, tmp_path, monkeypatch
):
    from rltool.agent_loops.evaluation import EvaluationFailed
    from rltool.app import driver

    calls = []
    real = driver.evaluate

    def failing_after_the_first(run):
        calls.append(run.step)
        if len(calls) > 1:
            raise EvaluationFailed("evaluation of task 'gsm8k': all 4 samples failed: x (4)")
        return real(run)

    monkeypatch.setattr(driver, "evaluate", failing_after_the_first)
    result = run_cli(_args(tiny_checkpoint, tmp_path, 4, "trainer.eval_every=2"))
    assert result.exit_code == 3, result.output
    assert "all 4 samples failed" in result.output
    assert calls == [0, 2]  # stopped at the failed evaluation after step 2
    lines = _lines(tmp_path / "t")
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2]
    # what was trained is kept: a checkpoint at step 2
    assert (tmp_path / "t" / "checkpoints" / "latest").read_text().strip() == "step_000002"
