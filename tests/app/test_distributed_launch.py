"""The ``distributed`` section: when ``rltool train`` relaunches itself, when it joins the
group torchrun gave it, and the errors that name the key."""

from __future__ import annotations

import sys

import pytest
import torch

from rltool.app.distributed import is_follower, relaunch_command
from rltool.config.checks import check_values
from rltool.config.schema import DistributedConfig, RecipeConfig
from rltool.training.sharding import check_distributed, init_shard


def _recipe(**distributed) -> RecipeConfig:
    return RecipeConfig(distributed=DistributedConfig(**distributed))


def test_one_process_trains_itself(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert relaunch_command(_recipe(), ["train", "r.yaml"]) is None
    assert init_shard(DistributedConfig()) is None


def test_nproc_per_node_relaunches_the_same_command_through_torch_distributed_run(
    monkeypatch,
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["train", "r.yaml", "distributed.nproc_per_node=2", "--quiet"]
    assert relaunch_command(_recipe(nproc_per_node=2), argv) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "rltool.cli.app",
        *argv,
    ]


def test_under_torchrun_a_process_joins_instead_of_relaunching(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert relaunch_command(_recipe(nproc_per_node=2), ["train"]) is None
    assert is_follower()
    monkeypatch.setenv("RANK", "0")
    assert not is_follower()


def test_several_nodes_need_torchrun_on_each(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"distributed.nnodes=2: .*torchrun --nnodes 2"):
        relaunch_command(_recipe(nnodes=2), ["train"])


def test_bad_values_name_the_key() -> None:
    assert check_values(_recipe(strategy="ddp")) == [
        "distributed.strategy = 'ddp': must be one of: full_shard, shard_grad_op"
    ]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"mixed_precision: bf16 needs CUDA"):
            check_distributed(DistributedConfig(mixed_precision="bf16"))
    assert check_values(_recipe(nproc_per_node=0)) == [
        "distributed.nproc_per_node = 0: must be >= 1"
    ]
