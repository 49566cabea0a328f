"""``rltool train`` with ``rollout.engine: openai_server``: everything above the engine works
unchanged (the gsm8k loop sync and async, the localhost loop and its session server, Ray
rollout workers), against the HTTP fixture of completions_fixture.py serving the same tiny
checkpoint the trainer starts from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from completions_fixture import FixtureCompletionsServer
from short_runs import GSM8K_TINY, short_gsm8k_args, short_train_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.rollout.contract import check_group, errors
from rltool.rollout.io import read_groups


@pytest.fixture
def server(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    made = FixtureCompletionsServer(model, AutoTokenizer.from_pretrained(tiny_checkpoint))
    yield made
    made.kill()


def _engine_args(server: FixtureCompletionsServer, tmp_path: Path) -> list[str]:
    return [
        "rollout.engine=openai_server",
        f"rollout.servers=[{server.url}]",
        "rollout.server.model=tiny",
        f"rollout.server.weights_dir={tmp_path / 'weights'}",
        "--dump-rollouts",
    ]


def _train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def _check_rollouts(run_dir: Path, step: int) -> list:
    groups = read_groups(run_dir / "rollouts" / f"step_{step:06d}.jsonl")
    assert groups
    for g in groups:
        assert errors(check_group(g)) == []
    return groups


def _loads(server: FixtureCompletionsServer) -> list[str]:
    return [r["args"][1] for r in server.rpcs if r["method"] == "rltool_load_weights"]


def test_a_sync_gsm8k_run_samples_from_the_synced_weights(server, tiny_checkpoint, tmp_path):
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 2, *_engine_args(server, tmp_path))
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    step2 = _check_rollouts(tmp_path / "t", 2)
    assert {m for g in step2 for s in g for m in s.response_model_steps} == {1}
    assert server.rpcs[0] == {"method": "rltool_tempered_logprobs"}
    assert _loads(server) == ["1", "2"]  # after each step, sync mode
    for x in _train_lines(tmp_path / "t"):  # the server's logprobs are the trainer's own
        assert x["actor/rollout_kl"] < 1e-5, x["actor/rollout_kl"]
        assert x["rollout/server_retries"] == 0


@pytest.mark.slow
def test_an_async_run_takes_weights_every_sync_interval(server, tiny_checkpoint, tmp_path):
    recipe = GSM8K_TINY.with_name("gsm8k_tiny_async.yaml")
    args = short_train_args(
        recipe, tiny_checkpoint, tmp_path, 3, "rollout.backend=inprocess",
        "rollout.sampling.max_new_tokens=6", *_engine_args(server, tmp_path),
    )  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    for step in (1, 2, 3):
        _check_rollouts(tmp_path / "t", step)
    assert _loads(server)[:2] == ["1", "2"]
    lines = _train_lines(tmp_path / "t")
    assert lines[1]["staleness/tokens_s1"] > 0  # step 2's tokens: generated while step 1 trained


@pytest.mark.slow
def test_the_localhost_loop_and_its_session_server(server, tiny_checkpoint, tmp_path):
    recipe = GSM8K_TINY.with_name("localhost_calculator.yaml")
    args = short_train_args(
        recipe, tiny_checkpoint, tmp_path, 2, "rollout.sampling.max_new_tokens=6",
        "trainer.pack_max_length=4096", *_engine_args(server, tmp_path),
    )  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    step2 = _check_rollouts(tmp_path / "t", 2)
    assert {m for g in step2 for s in g for m in s.response_model_steps} == {1}
    assert server.requests  # the agents' turns went through the server engine


@pytest.mark.slow
def test_ray_rollout_workers(server, tiny_checkpoint, tmp_path):
    args = short_gsm8k_args(
        tiny_checkpoint, tmp_path, 2, "rollout.backend=ray", *_engine_args(server, tmp_path)
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    step2 = _check_rollouts(tmp_path / "t", 2)
    assert {m for g in step2 for s in g for m in s.response_model_steps} == {1}
    assert _loads(server)[:1] == ["1"]
