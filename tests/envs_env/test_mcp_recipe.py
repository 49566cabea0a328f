"""recipes/mcp_calculator.yaml end to end in .venv-envs: 3 steps with --dump-rollouts exit 0,
the dumps validate with 0 errors and hold COMPLETED samples, and inspect-batch shows the
MCP calculator's turns masked between supervised answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mcp", reason="MCP tests run in .venv-envs (bash scripts/envs_env.sh)")

from transformers import AutoTokenizer

from rltool.builtin import demo_cache_dir

REPO = Path(__file__).resolve().parents[2]
RLTOOL = [sys.executable, "-c", "from rltool.cli.app import main; main()"]


@pytest.mark.slow
def test_mcp_recipe_trains_dumps_validates_and_masks_tool_turns(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    train = subprocess.run(
        [*RLTOOL, "train", "recipes/mcp_calculator.yaml", "trainer.steps=3",
         "data.prompts_per_step=2", "data.group_size=2", "data.eval_limit=2",
         "rollout.sampling.max_new_tokens=12", "rollout.eval_sampling.max_new_tokens=12",
         "trainer.eval_every=0", f"logging.run_dir={tmp_path}", "--dump-rollouts", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    run = tmp_path / "mcp_calculator"
    dumps = sorted(run.glob("rollouts/step_*.jsonl"))
    assert len(dumps) == 3
    validate = subprocess.run(
        [*RLTOOL, "validate-rollouts", *map(str, dumps)], cwd=REPO, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert validate.returncode == 0 and "0 errors" in validate.stdout, validate.stdout[-3000:]
    statuses = [json.loads(line)["status"] for d in dumps for line in d.open()]
    assert statuses.count("COMPLETED") > 0
    steps = [m for m in map(json.loads, (run / "metrics.jsonl").open()) if "mcp/tool_calls" in m]
    assert len(steps) == 3  # every step ran with its MCP server, which started and never died
    assert all(m["mcp/start_failures"] == m["mcp/server_deaths"] == 0 for m in steps)
    tokenizer = AutoTokenizer.from_pretrained(demo_cache_dir(), local_files_only=True)
    gaps = mcp_results = 0
    for dump in dumps:  # shifted targets: answer, masked MCP result or feedback, answer
        inspect = subprocess.run(
            [*RLTOOL, "inspect-batch", str(dump), "--format", "json"], cwd=REPO, env=env,
            capture_output=True, text=True,
        )  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        for sample in json.loads(inspect.stdout)["samples"]:
            ids, sup = np.asarray(sample["input_ids"]), np.asarray(sample["targets"]) != -100
            edges = np.flatnonzero(np.diff(np.r_[0, sup.astype(int), 0]))  # start, end, ...
            for end, start in zip(edges[1:-1:2], edges[2::2], strict=True):
                masked = tokenizer.decode(ids[end + 1 : start + 1].tolist())
                assert "calculator:" in masked or "<tool_response>" in masked, masked
                gaps += 1
                # an MCP answer: a tool result, or the feedback on an expression it evaluated
                tool_results = masked.count("<tool_response>")
                feedback = "calculator: " in masked and "no expression found" not in masked
                mcp_results += tool_results or int(feedback)
    assert gaps > 0
    # the dumps hold the trained groups only: at most the calls the steps made went through MCP
    assert mcp_results <= sum(m["mcp/tool_calls"] for m in steps)
