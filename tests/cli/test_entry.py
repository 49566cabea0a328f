"""The ``rltool`` entry point refuses a run in use before torch is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rltool
from rltool.app.run_lock import RunLock
from rltool.cli.entry import _resumed_run

# prints, at exit, whether the refusal imported torch
PROBE = (
    "import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules));"
    " from rltool.cli.entry import main; main()"
)


def test_a_resume_of_a_run_in_use_is_refused_without_importing_torch(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        for resume in (["--resume", str(run_dir)], [f"--resume={run_dir}"]):
            done = subprocess.run(
                [sys.executable, "-c", PROBE, "train", *resume, "trainer.steps=1"],
                capture_output=True,
                text=True,
                timeout=120,
                env={"PYTHONPATH": str(Path(rltool.__file__).parents[1])},
            )
            assert done.returncode == 2, done.stderr
            assert f"error: {run_dir} is in use by pid " in done.stderr
            assert "torch imported: False" in done.stdout


def test_only_a_train_resume_is_checked_early(tmp_path):
    assert _resumed_run(["train", "--resume", "r", "x=1"]) == Path("r")
    assert _resumed_run(["train", "recipe.yaml", "--resume=r"]) == Path("r")
    assert _resumed_run(["train", "--resume", "r", "--print-config"]) is None
    assert _resumed_run(["eval", "--resume", "r"]) is None
    assert _resumed_run(["train", "recipe.yaml"]) is None
    assert _resumed_run([]) is None
