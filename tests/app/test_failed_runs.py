"""Runs in which every sample fails: the stop rule, exit 3, the reasons on screen and in
metrics.jsonl, and the FAILED samples kept in the dumped rollouts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_gsm8k_args, short_train_args

from rltool.agent_loops import gsm8k
from rltool.agents import calculator
from rltool.app import driver
from rltool.rollout.io import read_groups
from rltool.rollout.state import Status

CALCULATOR = str(Path(__file__).parents[2] / "recipes" / "localhost_calculator.yaml")


def _args(ckpt: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return short_gsm8k_args(ckpt, run_dir, steps, "produce.oversample=0", *extra)


def _train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def _failing_in_steps(monkeypatch, steps=None) -> dict[str, bool]:
    """A flag set while train steps ``steps`` run (None: every one); evaluations see it
    unset, so they score as usual and only the stop rule can end the run early."""
    failing = {"now": False}
    real_step = driver._step

    def step(run, *args):
        failing["now"] = steps is None or run.step + 1 in steps
        try:
            return real_step(run, *args)
        finally:
            failing["now"] = False

    monkeypatch.setattr(driver, "_step", step)
    return failing


def _reward_raises_in_steps(monkeypatch, steps=None) -> None:
    failing, real_reward = _failing_in_steps(monkeypatch, steps), gsm8k.gsm8k_reward

    def judge(text: str, truth: str):
        if failing["now"]:
            raise RuntimeError("judge offline")
        return real_reward(text, truth)

    monkeypatch.setattr(gsm8k, "gsm8k_reward", judge)


@pytest.fixture
def reward_raises(monkeypatch):
    _reward_raises_in_steps(monkeypatch)


@pytest.fixture
def loop_raises(monkeypatch):
    def generate_groups(self, tasks, n, group_ids, sampling=None):
        raise ValueError("agent exploded")

    monkeypatch.setattr(gsm8k.GSM8KLoop, "generate_groups", generate_groups)


def test_a_reward_that_always_errors_stops_the_run(tiny_checkpoint, tmp_path, reward_raises):
    args = _args(tiny_checkpoint, tmp_path, 10, "trainer.max_failed_steps=2", "--dump-rollouts")
    result = run_cli([*args, "trainer.save_every=1"])
    assert result.exit_code == 3, result.output
    run_dir = tmp_path / "t"
    lines = _train_lines(run_dir)
    assert [x["step"] for x in lines] == [1, 2]  # stopped by the rule, not by trainer.steps
    # 3 groups x 2 samples, then MAX_REFILLS = 4 refills of the 3 missing groups: 30 samples
    for line in lines:
        assert line["failures/samples"] == 30 and line["failures/reward: RuntimeError"] == 30
        assert line["data/training_samples"] == 0
    assert not list((run_dir / "checkpoints").glob("step_*"))  # nothing new was saved
    out = result.output
    assert "new failure reason: reward: RuntimeError" in out
    assert "reward: RuntimeError: judge offline" in out  # the whole error, once
    assert result.output.count("judge offline") == 1
    assert "failed samples: 30 (30 reward: RuntimeError)" in out  # each step line
    assert "every sample failed in 2 consecutive steps" in out
    assert "60 x reward: RuntimeError" in out  # the run's reasons: 2 steps x 30
    assert "stopped by failures" in out
    # the step's dump holds the FAILED samples, with their errors, never a 0.0 score
    samples = [s for g in read_groups(run_dir / "rollouts" / "step_000001.jsonl") for s in g]
    assert len(samples) == 30
    assert {s.status for s in samples} == {Status.FAILED}
    assert {s.error for s in samples} == {"reward: RuntimeError: judge offline"}
    assert all(s.score is None for s in samples)


def test_dumped_failures_validate_and_inspect_as_skipped(tiny_checkpoint, tmp_path, reward_raises):
    args = _args(tiny_checkpoint, tmp_path, 1, "--dump-rollouts")
    assert run_cli(args).exit_code == 3
    dump = str(tmp_path / "t" / "rollouts" / "step_000001.jsonl")
    valid = run_cli(["validate-rollouts", dump])
    assert valid.exit_code == 0, valid.output
    shown = run_cli(["inspect-batch", dump, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    batch = json.loads(shown.output)
    assert batch["data_info"]["data/training_samples"] == 0
    skipped = batch["skipped_groups"]
    assert len(skipped) == 15 and {g["reason"] for g in skipped} == {"failed"}
    table = run_cli(["inspect-batch", dump])  # the terminal view names each group's error
    assert table.exit_code == 0, table.output
    assert (
        "skipped groups" in table.output and "reward: RuntimeError: judge offline" in table.output
    )
    assert skipped[0]["group_id"] in table.output


def test_a_loop_that_always_raises_stops_the_run(tiny_checkpoint, tmp_path, loop_raises):
    result = run_cli(_args(tiny_checkpoint, tmp_path, 10, "--dump-rollouts"))
    assert result.exit_code == 3, result.output
    run_dir = tmp_path / "t"
    lines = _train_lines(run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3]  # the default trainer.max_failed_steps
    # every group fails twice (its retry too) and is then recorded FAILED: 15 groups x 2
    assert lines[0]["failures/gsm8k: ValueError"] == 30
    out = result.output
    assert "new failure reason: gsm8k: ValueError" in out
    assert "agent exploded" in result.output
    assert "every sample failed in 3 consecutive steps" in out
    assert not (run_dir / "checkpoints").exists() or not list(
        (run_dir / "checkpoints").glob("step_*")
    )
    samples = [s for g in read_groups(run_dir / "rollouts" / "step_000003.jsonl") for s in g]
    assert len(samples) == 30
    assert samples[0].error.startswith("gsm8k: ValueError: agent exploded (on worker ")
    assert "failed twice" in samples[0].error
    # no train fields on these samples: a warning each, not an error
    valid = run_cli(["validate-rollouts", str(run_dir / "rollouts" / "step_000003.jsonl")])
    assert valid.exit_code == 0, valid.output


def test_a_run_that_ends_by_steps_having_trained_nothing_exits_3(
    tiny_checkpoint, tmp_path, reward_raises
):
    result = run_cli(_args(tiny_checkpoint, tmp_path, 1))  # fewer steps than the stop rule's 3
    assert result.exit_code == 3, result.output
    assert "stopped by steps" in result.output
    assert "the run trained on no sample in 1 steps" in result.output
    assert "30 x reward: RuntimeError" in result.output
    assert not list((tmp_path / "t" / "checkpoints").glob("step_*"))


def test_failed_steps_between_trained_ones_neither_stop_nor_save(
    tiny_checkpoint, tmp_path, monkeypatch
):
    _reward_raises_in_steps(monkeypatch, steps={1, 3})  # every reward of steps 1 and 3 errors
    args = _args(tiny_checkpoint, tmp_path, 4, "trainer.max_failed_steps=2", "trainer.save_every=1")
    result = run_cli(args)
    assert result.exit_code == 0, result.output  # never 2 failed steps in a row
    lines = _train_lines(tmp_path / "t")
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [x["failures/samples"] for x in lines] == [30, 0, 30, 0]
    assert [x["data/training_samples"] > 0 for x in lines] == [False, True, False, True]
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000002", "step_000004"]  # the failed steps 1 and 3 are not saved
    assert result.output.count("new failure reason") == 1  # step 3's reason is not new
    assert re.search(r"failed samples +│ +60 │", result.output)  # the summary table's row


def test_an_agent_that_always_raises_stops_the_run(tiny_checkpoint, tmp_path, monkeypatch):
    failing, real_agent = _failing_in_steps(monkeypatch), calculator.run

    def agent(client, task):
        if failing["now"]:
            raise ValueError("agent exploded")
        return real_agent(client, task)

    monkeypatch.setattr(calculator, "run", agent)  # the recipe's agent_loop.options.agent
    args = short_train_args(
        CALCULATOR, tiny_checkpoint, tmp_path, 10, "trainer.max_failed_steps=2", "--dump-rollouts"
    )
    result = run_cli(args)
    assert result.exit_code == 3, result.output
    lines = _train_lines(tmp_path / "t")
    assert [x["step"] for x in lines] == [1, 2]
    assert all(x["failures/samples"] == 30 for x in lines)  # 15 groups of 2 sessions each
    assert "ValueError: agent exploded" in result.output  # the first one's whole error
    assert "every sample failed in 2 consecutive steps" in result.output
    samples = [s for g in read_groups(tmp_path / "t" / "rollouts" / "step_000002.jsonl") for s in g]
    assert len(samples) == 30 and all("ValueError: agent exploded" in s.error for s in samples)
