"""recipes/openenv_guess.yaml end to end (issue 22's must-show): 3 training steps with
--dump-rollouts on the demo model, the loop serving the guess-number game itself; the dumps
validate with 0 errors and hold COMPLETED samples, and the game's turns are masked in what
inspect-batch shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv", reason="openenv-core is not installed (bash scripts/envs_env.sh)")

from transformers import AutoTokenizer

from rltool.builtin import demo_cache_dir

REPO = Path(__file__).resolve().parents[2]
RLTOOL = [sys.executable, "-c", "from rltool.cli.app import main; main()"]
GAME = ("My number is", "Answer with one number")  # what the game says between guesses


@pytest.mark.slow
def test_train_dump_validate_inspect_openenv_recipe(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: the shared CPU stays usable
    train = subprocess.run(
        [*RLTOOL, "train", "recipes/openenv_guess.yaml", "trainer.steps=3",
         "data.prompts_per_step=2", "data.group_size=2", "data.eval_limit=2",
         "agent_loop.options.max_turns=2", "rollout.sampling.max_new_tokens=8",
         "rollout.eval_sampling.max_new_tokens=8", "trainer.eval_every=0",
         f"logging.run_dir={tmp_path}", "--dump-rollouts", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    dumps = sorted(tmp_path.glob("openenv_guess/rollouts/step_*.jsonl"))
    assert len(dumps) == 3
    validate = subprocess.run(
        [*RLTOOL, "validate-rollouts", *map(str, dumps)], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert validate.returncode == 0, validate.stdout[-3000:]
    assert " 0 errors" in validate.stdout, validate.stdout[-3000:]
    rows = [json.loads(line) for d in dumps for line in d.read_text().splitlines()]
    assert rows and all(r["status"] == "COMPLETED" for r in rows)
    assert all(r["agent_loop"] == "openenv" and r["task_name"] == "guess_number" for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(demo_cache_dir(), local_files_only=True)
    gaps_seen = 0
    for dump in dumps:  # shifted targets: a guess, the game's masked answer, a guess
        inspect = subprocess.run(
            [*RLTOOL, "inspect-batch", str(dump), "--format", "json"], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        for sample in json.loads(inspect.stdout)["samples"]:
            ids, sup = np.asarray(sample["input_ids"]), np.asarray(sample["targets"]) != -100
            edges = np.flatnonzero(np.diff(np.r_[0, sup.astype(int), 0]))  # start, end, ...
            for end, start in zip(edges[1:-1:2], edges[2::2], strict=True):
                masked = tokenizer.decode(ids[end + 1 : start + 1].tolist())
                assert any(g in masked for g in GAME), masked
                gaps_seen += 1
    assert gaps_seen > 0  # a lost first guess is answered by the game, masked
