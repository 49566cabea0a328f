"""Routing replay end to end on an agentic loop: `rltool train recipes/localhost_calculator.yaml
algorithm.routing_replay=true --dump-rollouts` on a tiny random Qwen3-MoE. The session
server records each turn's routing, the samples carry it stitched as their tokens are (tool
tokens included), they validate (invariant 9), and the synchronous run replays them with
``actor/routing_mismatch`` 0."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli
from short_runs import short_train_args
from tiny_models import random_moe

from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.rollout.io import read_groups
from rltool.rollout.routing import NOT_ROUTED

RECIPE = Path(__file__).parents[2] / "recipes" / "localhost_calculator.yaml"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe-agentic")
    tokenizer = train_demo_tokenizer()
    model = random_moe(len(tokenizer), "qwen3_moe")
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.max_position_embeddings = 2048  # a calculator episode is ~550 tokens
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_localhost_loop_records_stitches_and_replays_routing(moe_checkpoint, tmp_path):
    args = short_train_args(
        RECIPE,
        moe_checkpoint,
        tmp_path,
        2,
        "algorithm.routing_replay=true",
        "trainer.pack_max_length=2048",
        "rollout.sampling.max_new_tokens=8",
        "rollout.eval_sampling.max_new_tokens=8",
        "--dump-rollouts",
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    # sync run: the engine sampled from the weights the step trains, and replay is on
    assert all(x["actor/routing_mismatch"] == 0.0 for x in train)
    dumps = sorted((tmp_path / "t" / "rollouts").glob("*.jsonl"))
    samples = [s for path in dumps for group in read_groups(path) for s in group]
    assert len(dumps) == 2 and samples
    multi_turn = 0
    for s in samples:
        e = s.routed_experts
        assert e.shape == (len(s.input_ids), 2, 2)  # [T, L, k]
        unrouted = np.flatnonzero((e == NOT_ROUTED).all(axis=(1, 2)))
        # every token the model was fed has its routing, tool tokens too; only the last
        # token (sampled, never fed) has none
        assert unrouted.tolist() == [len(s.input_ids) - 1], s.rollout_id
        multi_turn += s.extra["num_turns"] > 1
    assert multi_turn > 0  # the calculator's check turn: routing stitched over two turns
    check = run_cli(["validate-rollouts", "--num-experts", "8", *map(str, dumps)])
    assert check.exit_code == 0, check.output
    assert "0 errors" in check.stdout
