"""recipes/reasoning_gym_sums.yaml trains 3 steps with --dump-rollouts; the dumps validate
and hold COMPLETED samples scored by the generator, and inspect-batch converts them.

Runs only where reasoning-gym is installed (``bash scripts/envs_env.sh``); the warm start
``builtin:tiny-rg-sums`` is built into the cache on first use (about a minute on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")

from cli_runner import run_cli

from rltool.rollout.io import read_groups
from rltool.rollout.state import Status

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "reasoning_gym_sums.yaml"


@pytest.mark.slow
def test_the_recipe_trains_three_steps_and_its_dumps_validate(tmp_path):
    args = ["train", RECIPE, f"logging.run_dir={tmp_path}", "logging.name=t",
            "trainer.steps=3", "trainer.eval_every=0", "trainer.time_budget_s=null",
            "data.prompts_per_step=4", "data.group_size=4", "data.eval_limit=8",
            "--dump-rollouts"]  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    dumps = sorted((tmp_path / "t" / "rollouts").glob("step_*.jsonl"))
    assert [d.name for d in dumps] == [f"step_00000{i}.jsonl" for i in (1, 2, 3)]
    valid = run_cli(["validate-rollouts", *dumps])
    assert valid.exit_code == 0, valid.output
    assert "checked 48 samples in 12 groups from 3 files: 0 errors" in valid.output
    samples = [s for d in dumps for g in read_groups(d) for s in g]
    assert {s.status for s in samples} == {Status.COMPLETED}
    for s in samples:  # scored by basic_arithmetic's score_answer on the text after ####
        raw = s.reward["extra"]["raw_score"]
        assert s.reward["score"] == raw and 0.0 <= raw <= 1.0
        assert s.reward["correct"] == (raw == 1.0)
        assert s.reward["extra"]["extracted"] == s.reward["extracted"]
    shown = run_cli(["inspect-batch", dumps[0], "--format", "json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["data_info"]["data/training_samples"] == 16
