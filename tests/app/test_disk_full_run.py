"""`rltool train` on a real full disk: a small tmpfs (mounted here, so root only) holds one
checkpoint; with the disk filled the next save fails with an error naming the path and the
free space, leaves no partial directory and keeps the earlier checkpoint; once space is
back, ``--resume`` in place continues."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import short_gsm8k_args

SIZE = "3m"  # a checkpoint of the tiny model takes ~0.4 MiB
LEFT = 100 * 1024  # bytes left free: metrics lines fit, a checkpoint does not


@pytest.fixture
def small_disk(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs this test as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _fill(disk: Path, leave: int) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


@pytest.mark.slow
def test_a_full_disk_during_a_save_then_resume_once_space_is_back(tiny_checkpoint, small_disk):
    args = short_gsm8k_args(tiny_checkpoint, small_disk, 1, "trainer.save_every=1")
    assert run_cli(args).exit_code == 0
    run_dir = small_disk / "t"
    ckpts = run_dir / "checkpoints"
    filler = _fill(small_disk, LEFT)

    full = run_cli(["train", "--resume", str(run_dir), "trainer.steps=2"])
    assert full.exit_code == 1, full.output
    out = full.output  # run_cli: a 1000-column terminal, nothing wrapped
    assert f"no space left on the device of {ckpts} to save a checkpoint:" in out
    assert "MiB free; the newest checkpoint, step_000001, takes" in out
    assert f"continue with: rltool train --resume {run_dir}" in out
    assert "Traceback" not in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001"]

    filler.unlink()  # space is back
    again = run_cli(["train", "--resume", str(run_dir), "trainer.steps=2"])
    assert again.exit_code == 0, again.output
    assert f"resumed from {ckpts}/step_000001 at step 1" in again.output
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["kind"]) for x in lines] == [
        (0, "eval"),
        (1, "train"),
        (1, "eval"),
        (2, "train"),
        (2, "eval"),
    ]
