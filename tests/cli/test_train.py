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

from short_runs import short_train_args
from typer.testing import CliRunner

from rltool.app.signals import StopRequest
from rltool.cli.app import app
from rltool.rollout.io import read_groups

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml")


def _small(ckpt: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return short_train_args(
        RECIPE,
        ckpt,
        run_dir,
        steps,
        "rollout.sampling.max_new_tokens=6",
        "rollout.eval_sampling.max_new_tokens=6",
        *extra,
    )


def _run(args: list[str]):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_short_run_writes_metrics_checkpoint_and_rollouts(tiny_checkpoint, tmp_path):
    result = _run([*_small(tiny_checkpoint, tmp_path, 2), "--dump-rollouts"])
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
    assert _run([*_small(tiny_checkpoint, full, 3), "--dump-rollouts"]).exit_code == 0
    assert _run([*_small(tiny_checkpoint, cut, 2), "--dump-rollouts"]).exit_code == 0
    resumed = _run(
        [*_small(tiny_checkpoint, cut, 3), "--dump-rollouts", "--resume", str(cut / "t")]
    )
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output
    a = (full / "t" / "rollouts" / "step_000003.jsonl").read_text()
    b = (cut / "t" / "rollouts" / "step_000003.jsonl").read_text()
    assert a == b  # same prompts, same sampled tokens, same logprobs


def test_misspelled_key_fails_with_suggestion(tiny_checkpoint, tmp_path):
    result = _run([*_small(tiny_checkpoint, tmp_path, 1), "optimizer.lrr=1e-3"])
    assert result.exit_code == 2
    assert "optimizer.lrr" in result.output and "optimizer.lr" in result.output


def test_unknown_agent_loop_lists_known_ones(tiny_checkpoint, tmp_path):
    result = _run([*_small(tiny_checkpoint, tmp_path, 1), "agent_loop.name=gsm8kk"])
    assert result.exit_code == 1
    assert "unknown agent loop 'gsm8kk'" in result.output and "gsm8k" in result.output


def test_print_config_shows_resolved_recipe(tmp_path):
    result = _run(["train", RECIPE, "--print-config", "trainer.steps=7"])
    assert result.exit_code == 0
    assert "steps: 7" in result.output


def test_sigterm_requests_a_clean_stop():
    stop = StopRequest()
    with stop.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not stop._handle
