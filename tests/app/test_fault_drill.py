"""The fault drill: a short run killed with SIGKILL while generating, after training, while
saving, and at a moment the test does not choose, resumed each time, ends with the weights
of an uninterrupted run and every (step, kind) once in metrics.jsonl.

The deterministic kills use the driver's ``RLTOOL_FAULT=<point>@<step>`` hook
(rltool/app/faults.py); the last one is a plain ``kill -9`` from outside.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from short_runs import short_train_args, start_cli

RECIPE = str(Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml")
STEPS = 5


def _finish(proc: subprocess.Popen, expected: int) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == expected, out
    assert "Traceback" not in out, out
    return out


def _weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{STEPS:06d}"
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def _keys(run_dir: Path) -> list[tuple[int, str]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(x["step"], x["kind"]) for x in map(json.loads, lines)]


@pytest.mark.slow
def test_kill_9_at_every_phase_then_resume_matches_an_uninterrupted_run(tiny_checkpoint, tmp_path):
    def args(root: Path) -> list[str]:
        return short_train_args(
            RECIPE,
            tiny_checkpoint,
            root,
            STEPS,
            "rollout.sampling.max_new_tokens=6",
            "rollout.eval_sampling.max_new_tokens=6",
            "trainer.save_every=1",
            "trainer.eval_every=2",
        )

    reference = start_cli(args(tmp_path / "ref"))
    _finish(reference, 0)
    ref_dir = tmp_path / "ref" / "t"

    run_dir = tmp_path / "drill" / "t"
    resume = ["train", "--resume", str(run_dir)]
    killed = -signal.SIGKILL
    _finish(start_cli(args(tmp_path / "drill"), fault="generate@2"), killed)
    _finish(start_cli(resume, fault="train@3"), killed)  # step 3 trained and logged, not saved
    _finish(start_cli(resume, fault="save@4"), killed)  # weights written, manifest not
    assert (run_dir / "checkpoints" / ".tmp-step_000004").is_dir()
    # a kill the test does not time: as soon as step 4 is saved, somewhere in step 5,
    # its evaluation or its saves (or after the run ended: then nothing is left to do)
    proc = start_cli(resume)
    while not (run_dir / "checkpoints" / "step_000004" / "manifest.json").exists():
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    out = _finish(start_cli(resume), 0)
    assert "resumed from" in out

    expected, got = _weights(ref_dir), _weights(run_dir)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert (got[name] == tensor).all(), name
    keys = _keys(run_dir)
    assert len(keys) == len(set(keys))
    assert (
        keys
        == _keys(ref_dir)
        == [
            (0, "eval"),
            (1, "train"),
            (2, "train"),
            (2, "eval"),
            (3, "train"),
            (4, "train"),
            (4, "eval"),
            (5, "train"),
            (5, "eval"),
        ]
    )
