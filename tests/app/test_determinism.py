"""``trainer.deterministic: true``: two runs of the same recipe and seed write the same
metrics (time aside) and the same weights; what cannot be deterministic is warned about."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from safetensors.torch import load_file
from short_runs import short_gsm8k_args

from rltool.app.determinism import determinism_warnings
from rltool.config.loader import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


@pytest.fixture
def restore_mode() -> Iterator[None]:
    """The process-wide switch and thread count back to what they were: other tests run
    in this process."""
    was, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(was)
    torch.set_num_threads(threads)


# wall-clock figures: the only ones two runs may differ in
CLOCK = ("time/", "produce/time_s", "produce/group_time/")


def _lines_without_time(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith(CLOCK)} for x in lines]


def test_two_deterministic_runs_write_the_same_metrics_and_weights(
    tiny_checkpoint, tmp_path, restore_mode
):
    for name in ("a", "b"):
        args = short_gsm8k_args(
            tiny_checkpoint, tmp_path / name, 3, "trainer.deterministic=true", "trainer.threads=1"
        )
        result = run_cli(args)
        assert result.exit_code == 0, result.output
        assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
        assert "trainer.deterministic:" not in result.output  # sync, in process, hf, threads
    a, b = tmp_path / "a" / "t", tmp_path / "b" / "t"
    lines = _lines_without_time(a)
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["dist/threads"] for x in train] == [1.0] * 3  # recorded for a second run
    assert lines == _lines_without_time(b)
    # bit-equal on purpose: two runs of one recipe on one machine are what the mode promises
    assert _same_weights(a, b, 3)


def _same_weights(a: Path, b: Path, step: int) -> bool:
    name = f"step_{step:06d}"
    wa = load_file(str(a / "checkpoints" / name / "model.safetensors"))
    wb = load_file(str(b / "checkpoints" / name / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_deterministic_runs_on_two_fsdp2_processes_are_equal(tiny_checkpoint, tmp_path):
    """Each run relaunches itself on two gloo processes (torchrun): the sharded update's
    all-gathers and reduce-scatters must not let the two runs drift apart."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("a", "b"):
        args = short_gsm8k_args(
            tiny_checkpoint,
            tmp_path / name,
            2,
            "trainer.deterministic=true",
            "distributed.nproc_per_node=2",
            "trainer.threads=1",
        )
        command = [sys.executable, "-m", "rltool.cli.app", *args, "--quiet"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = tmp_path / "a" / "t", tmp_path / "b" / "t"
    lines = _lines_without_time(a)
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["dist/world_size"] for x in train] == [2.0, 2.0]  # really two processes
    assert [x["dist/threads"] for x in train] == [1.0, 1.0]
    assert lines == _lines_without_time(b)
    assert _same_weights(a, b, 2)


def test_what_cannot_be_deterministic_is_named() -> None:
    async_ray = load_recipe(
        RECIPES / "gsm8k_tiny_async.yaml",
        ["trainer.deterministic=true", "rollout.engine=vllm", "trainer.threads=2"],
    )
    warnings = determinism_warnings(async_ray)
    assert [w.split(" with ")[1].split(":")[0] for w in warnings] == [
        "produce.mode=async",
        "rollout.backend=ray",
        "rollout.engine=vllm",
    ]
    assert determinism_warnings(load_recipe(RECIPES / "gsm8k_tiny_async.yaml")) == []  # off
    sync = load_recipe(RECIPES / "gsm8k_tiny.yaml", ["trainer.deterministic=true"])
    [threads] = determinism_warnings(sync)  # one machine's runs match; another's may not
    n = torch.get_num_threads()
    assert "trainer.threads=null" in threads and f"set trainer.threads={n}" in threads
    fixed = load_recipe(
        RECIPES / "gsm8k_tiny.yaml", ["trainer.deterministic=true", "trainer.threads=2"]
    )
    assert determinism_warnings(fixed) == []
    with pytest.raises(ValueError, match=r"trainer\.threads = 0: must be >= 1 or null"):
        load_recipe(RECIPES / "gsm8k_tiny.yaml", ["trainer.threads=0"])
