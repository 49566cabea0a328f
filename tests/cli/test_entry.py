"""The ``rltool`` entry point, before torch is imported: refuses a run in use, sets
OpenMP's wait policy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rltool
from rltool.app.run_lock import RunLock
from rltool.cli.entry import _resumed_run, passive_openmp_waits

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


def test_openmp_waits_are_passive_unless_the_user_chose(tmp_path):
    environ: dict[str, str] = {}
    passive_openmp_waits(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    passive_openmp_waits(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_wait_policy_is_set_before_torch_loads(tmp_path):
    # the refusal exits before the commands import torch: the policy is already set then
    probe = PROBE.replace(
        "'torch' in sys.modules", "'torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY')"
    ).replace("import atexit, sys", "import atexit, os, sys")
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        done = subprocess.run(
            [sys.executable, "-c", probe, "train", "--resume", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(Path(rltool.__file__).parents[1])},
        )
    assert done.returncode == 2, done.stderr
    assert "torch imported: False PASSIVE" in done.stdout
