"""`rltool train recipes/gsm8k_tiny_moe.yaml algorithm.routing_replay=true --dump-rollouts` on
a tiny random Qwen3-MoE checkpoint: the run records and replays routing, reports
``actor/routing_mismatch``, and its dumped rollouts validate with routed_experts present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_train_args
from tiny_models import random_moe

from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.rollout.io import read_groups

RECIPE = Path(__file__).parents[2] / "recipes" / "gsm8k_tiny_moe.yaml"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    tokenizer = train_demo_tokenizer()
    model = random_moe(len(tokenizer), "qwen3_moe")
    model.config.eos_token_id, model.config.pad_token_id = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_moe_recipe_replays_routing_and_its_rollouts_validate(moe_checkpoint, tmp_path):
    args = short_train_args(
        RECIPE,
        moe_checkpoint,
        tmp_path,
        3,
        "algorithm.routing_replay=true",
        "rollout.sampling.max_new_tokens=6",
        "rollout.eval_sampling.max_new_tokens=6",
        "--dump-rollouts",
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 2, 3]
    # sync run: the engine samples from the weights the step trains, so nothing differs
    assert all(x["actor/routing_mismatch"] == 0.0 for x in train)
    dumps = sorted((tmp_path / "t" / "rollouts").glob("*.jsonl"))
    assert len(dumps) == 3
    for path in dumps:
        for group in read_groups(path):
            for s in group:
                assert s.routed_experts.shape == (len(s.input_ids), 2, 2)  # [T, L, k]
    check = run_cli(["validate-rollouts", "--num-experts", "8", *dumps])
    assert check.exit_code == 0, check.output
    assert "0 errors" in check.stdout
