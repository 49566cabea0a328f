"""Health alarms in a real run: recorded in metrics.jsonl, named on the step line, and with
``trainer.alarms.stop_on`` an exit 3 naming the alarm after a checkpoint; the issue's
must-show, a reward that pays for length firing the length alarm within a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_gsm8k_args

from rltool.agent_loops import gsm8k
from rltool.rewards.gsm8k import RewardResult


def _train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


# the random tiny model never ends an answer within 4 tokens: every sample is truncated
def test_an_alarm_is_recorded_and_shown_on_every_step_it_fires(tiny_checkpoint, tmp_path):
    result = run_cli(short_gsm8k_args(tiny_checkpoint, tmp_path, 2))
    assert result.exit_code == 0, result.output
    lines = _train_lines(tmp_path / "t")
    assert [(x["alarm/truncation"], x["alarm/truncation/value"]) for x in lines] == [(1, 1), (1, 1)]
    step_lines = [x for x in result.output.splitlines() if x.startswith("step ")]
    assert len(step_lines) == 2 and all(x.endswith("alarm truncation") for x in step_lines)
    # the message once, on the streak's first step
    assert result.output.count("alarm truncation at step 1: 100% of the samples") == 1


def test_an_alarm_in_stop_on_stops_the_run_with_exit_3(tiny_checkpoint, tmp_path):
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 4, "trainer.alarms.stop_on=[truncation]")
    result = run_cli(args)
    assert result.exit_code == 3, result.output
    assert "stopped after step 1 by the alarm truncation (trainer.alarms.stop_on)" in result.output
    assert [x["step"] for x in _train_lines(tmp_path / "t")] == [1]
    assert (tmp_path / "t" / "checkpoints" / "step_000001" / "manifest.json").exists()
    # null turns the alarm off: the run trains all its steps
    off = short_gsm8k_args(
        tiny_checkpoint, tmp_path / "off", 2, "trainer.alarms.stop_on=[truncation]",
        "trainer.alarms.truncated_frac=null",
    )  # fmt: skip
    result = run_cli(off)
    assert result.exit_code == 0, result.output
    assert all("alarm/truncation" not in x for x in _train_lines(tmp_path / "off" / "t"))


def test_a_misspelt_alarm_names_the_known_ones(tiny_checkpoint, tmp_path):
    result = run_cli(
        short_gsm8k_args(tiny_checkpoint, tmp_path, 1, "trainer.alarms.stop_on=[lenght]")
    )
    assert result.exit_code == 2
    assert (
        "trainer.alarms.stop_on[0] = 'lenght': must be one of: length, truncation" in result.output
    )
    assert "did you mean 'length'?" in result.output


@pytest.fixture
def length_pays(monkeypatch):
    """A reward that pays for length: a character is worth 1/40."""
    monkeypatch.setattr(
        gsm8k, "gsm8k_reward", lambda text, truth: RewardResult(len(text) / 40, "ok")
    )


@pytest.mark.slow
def test_a_reward_for_length_fires_the_length_alarm_and_stops_the_run(length_pays, tmp_path):
    # the demo model (short answers ending in EOS), 4 prompts x 4 answers of up to 48 tokens
    # and a fast learning rate: measured, the mean length went 13.4 -> 38.9 tokens at step 2
    args = short_gsm8k_args(
        "builtin:tiny-gsm8k", tmp_path, 6, "optimizer.lr=1e-3", "optimizer.warmup_steps=0",
        "data.prompts_per_step=4", "data.group_size=4", "trainer.alarms.stop_on=[length]",
        new_tokens=48,
    )  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 3, result.output
    lines = _train_lines(tmp_path / "t")
    assert 2 <= len(lines) <= 4  # within a few steps
    assert "alarm/length" not in lines[0]  # step 1 is the baseline
    assert lines[-1]["alarm/length"] == 1 and lines[-1]["alarm/length/value"] > 2
    assert f"stopped after step {len(lines)} by the alarm length" in result.output
