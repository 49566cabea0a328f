"""The verifiers loop in .venv-envs: a real verifiers 0.4 episode (its null harness run
through uv as a local subprocess, the vf_arith MCP tool server) against the session
server, with a scripted engine; a reward that raises; the shipped recipe through the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verifiers")

sys.path.insert(0, str(Path(__file__).parents[1] / "sessions"))
sys.path.insert(0, str(Path(__file__).parents[1]))
from cli_runner import run_cli
from session_fakes import ScriptedEngine

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.verifiers_env import VerifiersLoop, add_env_dir, task_records
from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.produce.result import reward_components
from rltool.rollout.failures import count_reasons
from rltool.rollout.io import write_rollouts
from rltool.rollout.state import Status

ROOT = Path(__file__).parents[2]
ENV_DIR = ROOT / "recipes" / "envs" / "vf_arith"
DATA_DIR = ROOT / "rltool" / "demo" / "data" / "vf_arith"  # builtin:vf_arith/
M = -100

BROKEN_ENV = """
import verifiers.v1 as vf
from vf_arith import ArithConfig, ArithData

__all__ = ["BrokenTaskset"]


class BrokenTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        raise ZeroDivisionError("the reward divides by zero")


class BrokenTaskset(vf.Taskset[BrokenTask, ArithConfig]):
    def load(self):
        yield BrokenTask(ArithData(prompt="What is 2 + 3?", answer=5), self.config.task)
"""


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()  # ChatML: the loop gives its session server the tool template


def _loop(tokenizer, replies, **options) -> tuple[VerifiersLoop, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, replies)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=64), "vf_arith")
    options = {"environment": "vf_arith", "env_dir": str(ENV_DIR), "max_turns": 3, **options}
    return VerifiersLoop(ctx, **options), engine


def test_the_shipped_data_files_are_the_tasksets_tasks():
    add_env_dir(str(ENV_DIR))
    for name, split, size in (("train", "train", 64), ("test", "eval", 16)):
        shipped = (DATA_DIR / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in shipped] == json.loads(
            json.dumps(task_records("vf_arith", {"split": split, "size": size}))
        )


def test_a_tool_episode_is_recorded_token_exact_with_its_reward_components(tokenizer, tmp_path):
    record = json.loads((DATA_DIR / "train.jsonl").read_text().splitlines()[0])
    answer = record["answer"]
    body = json.dumps({"name": "calculator_tools_add", "arguments": {"a": answer, "b": 0}})
    call = f"<tool_call>\n{body}\n</tool_call>"
    loop, engine = _loop(tokenizer, [call, f"The answer is {answer}"])
    (group,) = loop.generate_groups([record], 1, ["g0"])
    (state,) = group
    assert state.status == Status.COMPLETED, state.error
    assert state.reward == {
        "score": 1.0,
        "components": {"correct": 1.0, "uses_tool": 1.0},
        "weights": {"correct": 1.0, "uses_tool": 0.0},
    }
    assert state.extra["tool_turns"] == 1 and state.extra["num_turns"] == 2
    assert reward_components([state]) == {
        "rollout/reward_components/correct": 1.0,
        "rollout/reward_components/uses_tool": 1.0,
    }
    assert loop.pop_metrics()["agent/errors"] == 0.0
    # the tool result (the MCP server's answer) is environment tokens: label -100
    ids, labels = state.input_ids.tolist(), state.labels.tolist()
    text = loop.server_tokenizer.decode(ids)
    result = f"<tool_response>\n{answer}\n</tool_response>"
    assert result in text
    start = text.index(result)
    tool_pos = [
        i
        for i in range(len(ids))
        if start <= len(loop.server_tokenizer.decode(ids[:i])) < start + len(result)
    ]
    assert tool_pos and all(labels[i] == M for i in tool_pos)
    trained = [i for i in range(len(ids)) if labels[i] != M]
    said = loop.server_tokenizer.decode([ids[i] for i in trained])
    assert said.startswith("<tool_call>") and said.endswith(f"The answer is {answer}<|im_end|>")
    assert len(engine.calls) == 2  # two model turns, each one engine call
    # inspect-batch shows the tool tokens masked (targets are labels shifted once)
    dump = tmp_path / "rollouts.jsonl"
    write_rollouts(dump, group)
    shown = run_cli(["inspect-batch", str(dump), "--format", "json"])
    assert shown.exit_code == 0, shown.output
    (sample,) = json.loads(shown.output)["samples"]
    assert all(sample["targets"][i - 1] == M for i in tool_pos)


def test_a_reward_that_raises_fails_the_sample_and_counts_its_reason(tokenizer, tmp_path):
    (tmp_path / "vf_broken").mkdir()
    (tmp_path / "vf_broken" / "__init__.py").write_text(BROKEN_ENV)
    # vf_arith (imported by the broken env) comes from its own env_dir
    sys.path.insert(0, str(ENV_DIR))
    loop, _ = _loop(tokenizer, ["5"], environment="vf_broken", env_dir=str(tmp_path))
    record = task_records("vf_broken", {})[0]
    (group,) = loop.generate_groups([record], 1, ["g0"])
    (state,) = group
    assert state.status == Status.FAILED and state.reward is None
    assert state.error.startswith("reward: TaskError:")
    assert "ZeroDivisionError" in state.error or "correct" in state.error
    assert list(count_reasons(group)) == [state.error.split(":", 2)[0] + ": TaskError"]
    assert loop.pop_metrics()["reward/errors"] == 1.0


@pytest.mark.slow
def test_the_shipped_recipe_trains_and_its_dumps_validate(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = [
        "train", "recipes/verifiers_arith.yaml", f"logging.run_dir={tmp_path / 'run'}",
        "trainer.steps=3", "data.prompts_per_step=1", "data.group_size=2",
        "data.eval_limit=1", f"agent_loop.options.env_dir={ENV_DIR}", "--dump-rollouts",
    ]  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    dumps = sorted((tmp_path / "run" / "verifiers_arith" / "rollouts").glob("step_*.jsonl"))
    assert len(dumps) == 3
    valid = run_cli(["validate-rollouts", *map(str, dumps)])
    assert valid.exit_code == 0 and "0 errors" in valid.output, valid.output
    states = [json.loads(line) for d in dumps for line in d.read_text().splitlines()]
    assert all(s["status"] == "COMPLETED" for s in states)
    assert all(set(s["reward"]["components"]) == {"correct", "uses_tool"} for s in states)
    labels = np.concatenate([np.asarray(s["labels"]) for s in states])
    assert (labels == M).any() and (labels != M).any()
