"""``rltool train`` with ``rollout.engine: openai_server`` when servers die or hang mid-run:
the run goes on with the servers left, or stops with exit 3 naming each server, keeping the
steps it trained (HTTP fixtures: completions_fixture.py, hung_server.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from completions_fixture import FixtureCompletionsServer
from hung_server import HungServer
from short_runs import short_gsm8k_args
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltool.app import driver


@pytest.fixture
def servers(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    made = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
        made.append(FixtureCompletionsServer(model.eval(), tokenizer))
    yield made
    for s in made:
        if s.httpd.socket.fileno() != -1:
            s.kill()


def _args(urls: list[str], tmp_path: Path, *extra: str) -> list[str]:
    return [
        "rollout.engine=openai_server",
        f"rollout.servers=[{','.join(urls)}]",
        "rollout.server.model=tiny",
        f"rollout.server.weights_dir={tmp_path / 'weights'}",
        *extra,
    ]


def _train_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "train"]


def test_servers_that_die_mid_run_stop_it_with_exit_3_naming_each(
    servers, tiny_checkpoint, tmp_path, monkeypatch
):
    """Both servers die after step 1's weights reached them: step 2's requests fail, its
    weight sync finds no server, and the run stops (no traceback) naming both, exit 3,
    with step 1's training saved."""
    synced = driver.sync_weights

    def sync_then_die(run, force: bool = False) -> None:
        synced(run, force)
        if run.step == 1:
            for s in servers:
                s.kill()

    monkeypatch.setattr(driver, "sync_weights", sync_then_die)
    urls = [s.url for s in servers]
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 4, *_args(urls, tmp_path))
    result = run_cli(args)
    assert result.exit_code == 3, result.output
    out = result.output  # run_cli: a 1000-column terminal, nothing wrapped
    assert "stopped after step 2: openai_server: no server left in rollout.servers" in out
    for url in urls:
        assert f"{url} (/collective_rpc: ConnectError" in out
    assert "Traceback" not in result.output
    lines = _train_lines(tmp_path / "t")
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[0]["data/training_samples"] > 0 and lines[1]["data/training_samples"] == 0
    assert [p.name for p in (tmp_path / "t" / "checkpoints").glob("step_*")] == ["step_000002"]


def test_no_server_at_start_is_exit_3_naming_it(tiny_checkpoint, tmp_path):
    dead = HungServer()
    dead.close()  # nothing listens on its port any more
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 1, *_args([dead.url], tmp_path))
    result = run_cli(args)
    assert result.exit_code == 3, result.output
    out = result.output
    assert f"no server left in rollout.servers: {dead.url} (/collective_rpc: ConnectError" in out
    assert "Traceback" not in result.output


def test_a_hung_server_out_of_two_is_dropped_and_the_run_goes_on(
    servers, tiny_checkpoint, tmp_path, caplog
):
    """The hung server takes requests of the first evaluation, is dropped after one
    rollout.server.timeout_s, counted in step 1's metrics and step line, named in a
    warning; the run trains its 2 steps on the live server."""
    hung = HungServer()
    extra = ["rollout.server.timeout_s=1", "rollout.server.deadline_s=20"]
    extra.append("rollout.server.logprobs_method=''")  # else the start-up call drops it
    args = short_gsm8k_args(
        tiny_checkpoint, tmp_path, 2, *_args([hung.url, servers[0].url], tmp_path, *extra)
    )
    with caplog.at_level(logging.WARNING, logger="rltool.engines.openai_pool"):
        result = run_cli(args)
    hung.close()
    assert result.exit_code == 0, result.output
    assert hung.accepted >= 1
    lines = _train_lines(tmp_path / "t")
    assert [x["step"] for x in lines] == [1, 2]
    assert sum(x["rollout/servers_dropped"] for x in lines) == 1.0
    assert all(x["data/training_samples"] > 0 for x in lines)
    assert "rollout servers dropped: 1" in result.output
    (record,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert hung.url in record.getMessage()
    assert [r["args"][1] for r in servers[0].rpcs] == ["1", "2"]
