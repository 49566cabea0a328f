"""``rltool train ... distributed.nproc_per_node=2``: the command relaunches itself on two
gloo processes, trains, records the world size, saves a sharded checkpoint, and the run
resumes on one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from short_runs import short_gsm8k_args

ROOT = Path(__file__).resolve().parents[2]


def _rltool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "rltool.cli.app", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def _lines(run_dir: Path, kind: str) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == kind]


@pytest.mark.slow
def test_two_processes_train_save_sharded_and_resume_on_one(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 2, "distributed.nproc_per_node=2")
    done = _rltool(*args, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "t"
    train = _lines(run_dir, "train")
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["dist/world_size"] == 2.0 for x in train)
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert (ckpt / "sharded" / ".metadata").is_file()
    assert sorted(p.name for p in (ckpt / "sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "manifest.json").is_file()

    again = _rltool(
        "train", "--resume", str(run_dir), "distributed.nproc_per_node=1", "trainer.steps=3"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    train = _lines(run_dir, "train")
    assert [x["step"] for x in train] == [1, 2, 3]
    assert "dist/world_size" not in train[-1]  # one process
