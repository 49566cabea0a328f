"""`rltool train` through the CLI: a short run, resume, clean stop, clear errors.

The model is a tiny random Qwen2 saved as an ordinary HF checkpoint (the demo's
SFT warm start takes a minute; it is exercised by the slow demo test), loaded
through the same path as a user's model via ``model.path=DIR``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_gsm8k_args

from rltool.app import driver
from rltool.app.signals import SecondInterrupt, StopRequest
from rltool.config.loader import load_recipe, recipe_to_yaml
from rltool.rollout.io import read_groups

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml")


def _small(ckpt: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return short_gsm8k_args(ckpt, run_dir, steps, *extra, new_tokens=6)


def test_short_run_writes_metrics_checkpoint_and_rollouts(tiny_checkpoint, tmp_path):
    result = run_cli([*_small(tiny_checkpoint, tmp_path, 2), "--dump-rollouts"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "t"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train_lines] == [1, 2]
    for key in (
        "data/training_samples",
        "time/generate",
        "time/train",
        "time/step",
        "actor/pg_loss",
        "rollout/reward_mean",
    ):
        assert key in train_lines[0], key
    assert train_lines[0]["data/training_samples"] + 2 * train_lines[0]["data/skipped_groups"] == 6
    assert [x["kind"] for x in lines].count("eval") == 2  # before the first and after the last step
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    groups = read_groups(run_dir / "rollouts" / "step_000001.jsonl")
    assert [len(g) for g in groups] == [2, 2, 2]
    assert "held-out accuracy" in result.output


def test_resume_sees_the_batch_an_uninterrupted_run_sees(tiny_checkpoint, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli([*_small(tiny_checkpoint, full, 3), "--dump-rollouts"]).exit_code == 0
    assert run_cli([*_small(tiny_checkpoint, cut, 2), "--dump-rollouts"]).exit_code == 0
    resumed = run_cli(
        [*_small(tiny_checkpoint, cut, 3), "--dump-rollouts", "--resume", str(cut / "t")]
    )
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    a = (full / "t" / "rollouts" / "step_000003.jsonl").read_text()
    b = (cut / "t" / "rollouts" / "step_000003.jsonl").read_text()
    # same prompts, same sampled tokens, same logprobs, to the bit: the promise of a resume,
    # which reloads the exact weights, optimizer and RNG states into the same computation
    assert a == b


def test_misspelled_key_fails_with_suggestion(tiny_checkpoint, tmp_path):
    result = run_cli([*_small(tiny_checkpoint, tmp_path, 1), "optimizer.lrr=1e-3"])
    assert result.exit_code == 2
    assert "optimizer.lrr" in result.output and "optimizer.lr" in result.output


def test_unknown_agent_loop_lists_known_ones(tiny_checkpoint, tmp_path):
    result = run_cli([*_small(tiny_checkpoint, tmp_path, 1), "agent_loop.name=gsm8kk"])
    assert result.exit_code == 2  # before the model loads, like every bad recipe value
    assert "agent_loop.name = 'gsm8kk': must be a known agent loop" in result.output
    assert "gsm8k, localhost" in result.output


def test_print_config_shows_resolved_recipe(tmp_path):
    result = run_cli(["train", RECIPE, "--print-config", "trainer.steps=7"])
    assert result.exit_code == 0
    assert "steps: 7" in result.output


def test_sigterm_requests_a_clean_stop():
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_needs_no_recipe_and_records_the_overrides(tiny_checkpoint, tmp_path):
    assert run_cli(_small(tiny_checkpoint, tmp_path, 1)).exit_code == 0
    run_dir = tmp_path / "t"
    result = run_cli(["train", "--resume", str(run_dir), "trainer.steps=2", "data.eval_limit=2"])
    assert result.exit_code == 0, result.output
    assert f"resumed from {run_dir}/checkpoints/step_000001 at step 1" in result.output
    assert "trainer.steps: 1 -> 2" in result.output and "data.eval_limit: 4 -> 2" in result.output
    config = (run_dir / "config.yaml").read_text()
    assert "steps: 2" in config and "eval_limit: 2" in config
    record = json.loads((run_dir / "resumes.jsonl").read_text())
    assert record == {
        "step": 1,
        "checkpoint": "step_000001",
        "skipped": [],
        "changes": {"data.eval_limit": [4, 2], "trainer.steps": [1, 2]},
    }
    # eval at 0 (first run), train 1, eval at 1 (end of the first run), train 2, eval at 2
    assert [(x["step"], x["kind"]) for x in _lines(run_dir)] == [
        (0, "eval"),
        (1, "train"),
        (1, "eval"),
        (2, "train"),
        (2, "eval"),
    ]


def test_resume_with_a_differing_recipe_is_refused_with_the_differences(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    made = load_recipe(RECIPE, ["data.eval_limit=8", "data.prompts_per_step=8"])
    (run_dir / "config.yaml").write_text(recipe_to_yaml(made))
    result = run_cli(["train", RECIPE, "--resume", str(run_dir)])
    assert result.exit_code == 2
    out = result.output
    assert "differs from the run's" in out
    assert "data.eval_limit: 8 -> 200" in out and "data.prompts_per_step: 8 -> 32" in out
    # the same overrides make the recipe resolve to the run's config: accepted
    same = ["train", RECIPE, "data.eval_limit=8", "data.prompts_per_step=8"]
    ok = run_cli([*same, "--resume", str(run_dir), "--print-config"])
    assert ok.exit_code == 0, ok.output
    assert "eval_limit: 8" in ok.output


def test_resume_of_a_directory_without_config_is_a_clear_error(tmp_path):
    result = run_cli(["train", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "config.yaml is missing" in result.output


def test_damaged_newest_checkpoint_is_skipped_and_metrics_cut_back(tiny_checkpoint, tmp_path):
    args = _small(tiny_checkpoint, tmp_path, 3, "trainer.save_every=1", "trainer.eval_every=1")
    assert run_cli(args).exit_code == 0
    run_dir = tmp_path / "t"
    before = [(x["step"], x["kind"]) for x in _lines(run_dir)]
    newest = run_dir / "checkpoints" / "step_000003" / "model.safetensors"
    size = newest.stat().st_size
    newest.write_bytes(newest.read_bytes()[:64])  # a truncated safetensors
    (run_dir / "checkpoints" / "latest").unlink()
    result = run_cli(["train", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"skipped step_000003: model.safetensors size 64 != {size} in the manifest" in out
    assert f"resumed from {run_dir}/checkpoints/step_000002 at step 2" in out
    assert "Traceback" not in out
    # steps 1..3 trained and evaluated once each: the step-3 lines of the first run were cut
    assert [(x["step"], x["kind"]) for x in _lines(run_dir)] == before
    assert before == [
        (0, "eval"),
        (1, "train"),
        (1, "eval"),
        (2, "train"),
        (2, "eval"),
        (3, "train"),
        (3, "eval"),
    ]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_cleanly_with_the_shell_exit_code(
    tiny_checkpoint, tmp_path, monkeypatch, sig, code
):
    real_step = driver._step

    def step_then_signal(*args, **kwargs):
        out = real_step(*args, **kwargs)
        os.kill(os.getpid(), sig)  # arrives during step 1: the run finishes it and saves
        return out

    monkeypatch.setattr(driver, "_step", step_then_signal)
    result = run_cli(_small(tiny_checkpoint, tmp_path, 5))
    assert result.exit_code == code, result.output
    assert f"interrupted by {sig.name} after step 1, checkpoint saved" in result.output
    assert f"stopped by {sig.name}" in result.output
    assert (tmp_path / "t" / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_resume_without_any_complete_checkpoint_names_the_run(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)  # killed in its save
    made = load_recipe(RECIPE, [f"model.path={tiny_checkpoint}", "data.eval_limit=2"])
    (run_dir / "config.yaml").write_text(recipe_to_yaml(made))
    result = run_cli(["train", "--resume", str(run_dir)])
    assert result.exit_code == 1
    assert f"no complete checkpoint to resume from in {run_dir}" in result.output
    assert f"start a new run instead of --resume: rltool train {run_dir}/config.yaml" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_second_ctrl_c_aborts_with_130_and_no_traceback(tiny_checkpoint, tmp_path, monkeypatch):
    def abort(*args, **kwargs):
        raise SecondInterrupt  # what StopRequest raises on the second Ctrl-C

    monkeypatch.setattr(driver, "_step", abort)
    result = run_cli(_small(tiny_checkpoint, tmp_path, 2))
    assert result.exit_code == 130
    assert "aborted by a second Ctrl-C" in result.output
