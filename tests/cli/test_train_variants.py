"""The multi-task and distillation recipes through `rltool train`, on a tiny random checkpoint:
per-task metrics and evaluation, teacher targets reaching the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_train_args

RECIPES = Path(__file__).parents[2] / "recipes"
SMALL = [  # on top of short_train_args
    "data.prompts_per_step=4",
    "rollout.sampling.max_new_tokens=6",
    "rollout.eval_sampling.max_new_tokens=6",
]


def _train(recipe: str, ckpt: Path, run_dir: Path, *extra: str) -> list[dict]:
    args = short_train_args(RECIPES / recipe, ckpt, run_dir, 2, *SMALL, *extra)
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    return [json.loads(x) for x in (run_dir / "t" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_multitask_recipe_trains_every_task_with_its_own_metrics(tiny_checkpoint, tmp_path):
    lines = _train("gsm8k_tiny_multitask.yaml", tiny_checkpoint, tmp_path)
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    # 4 groups at weights 2:1:1 -> 2, 1, 1 groups of 2 samples
    assert [train[0][f"task/{t}/samples"] for t in ("add", "sub", "mul")] == [4.0, 2.0, 2.0]
    last_eval = [x for x in lines if x["kind"] == "eval"][-1]
    for key in ("eval/accuracy", "eval/add/accuracy", "eval/sub/accuracy", "eval/mul/accuracy"):
        assert key in last_eval, key


@pytest.mark.slow
def test_distill_recipe_puts_the_teacher_signal_in_the_loss(tiny_checkpoint, tmp_path):
    # the student is its own teacher here, so on its sampled tokens the reverse KL is 0
    teacher = f"distill.teacher_path={tiny_checkpoint}"
    lines = _train(
        "gsm8k_tiny_distill.yaml", tiny_checkpoint, tmp_path, teacher, "distill.mode=sampled"
    )
    train = [x for x in lines if x["kind"] == "train"]
    assert len(train) == 2
    assert abs(train[0]["actor/distill_kl"]) < 1e-4  # before any update: same weights
    for x in train:
        assert x["actor/pg_loss"] == 0.0  # task_adv_weight 0: the teacher signal alone
