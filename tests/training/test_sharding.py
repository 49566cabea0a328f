"""FSDP2 data parallelism: the step split across ranks, and two gloo processes against one.

The slow test launches ``fsdp_steps.py`` under torchrun once (2 processes) and checks,
against one process on the same packs: the parameters after 3 steps for each loss
aggregation, and a run saved at step 2 and resumed (2 -> 2, 2 -> 1, 1 -> 2) against the
uninterrupted one after step 4, all to 1e-5 in fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_steps import CASES, CKPT_CASE, new_updater, params, save, train
from transformers import AutoModelForCausalLM

from rltool.app.sharded_checkpoint import is_sharded, restore_updater
from rltool.training.optim import save_moments
from rltool.training.sharding import Shard, rank_slots
from rltool.training.updater import split_mini_batches

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _shard(rank: int, world: int) -> Shard:
    return Shard(rank, world, torch.device("cpu"), None)


def test_rank_slots_balance_tokens_and_pad_to_one_count() -> None:
    sizes = [50, 10, 30, 20, 40]  # tokens per row
    buckets = split_mini_batches(sizes, 2)  # 50+20+10=80 | 40+30=70
    assert buckets == [[0, 1, 3], [2, 4]]
    assert rank_slots(buckets, _shard(0, 2)) == [(0, True), (1, True), (3, True)]
    # rank 1 has 2 rows: a third, not-live slot keeps its forward count equal to rank 0's
    assert rank_slots(buckets, _shard(1, 2)) == [(2, True), (4, True), (0, False)]


def test_fewer_rows_than_ranks_leaves_a_rank_only_padding() -> None:
    buckets = split_mini_batches([7], 2)  # one row: one bucket
    assert rank_slots(buckets, _shard(0, 2)) == [(0, True)]
    assert rank_slots(buckets, _shard(1, 2)) == [(0, False)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_processes_train_and_resume_as_one(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    # one process: 2 steps, a one-process checkpoint, 2 more steps (the uninterrupted run)
    single = train(new_updater(*CKPT_CASE, None), range(2))
    at_step2 = params(single)
    single_ckpt = save(single, tmp_path / "single" / "checkpoints", 2, None)
    save_moments(single.optimizer, single_ckpt)  # a warm start's optimizer.pt
    moments = {
        n: single.optimizer.state[p]["exp_avg"].clone() for n, p in single.model.named_parameters()
    }
    lr0 = new_updater(*CKPT_CASE, None).optimizer.param_groups[0]["lr"]
    uninterrupted = params(train(single, range(2, 4)))

    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    script = str(Path(__file__).with_name("fsdp_steps.py"))
    done = subprocess.run(
        [*launch, script, str(tmp_path), str(single_ckpt)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("[rank")]
    assert done.returncode == 0, "\n".join(errors[-30:]) or done.stderr[-4000:]

    ones = {}
    for case, (loss_agg, mini_batches, algo) in CASES.items():
        ones[case] = one = params(train(new_updater(loss_agg, mini_batches, None, algo), range(3)))
        two = torch.load(tmp_path / f"{case}.pt")
        assert _max_diff(one, two) < TOL, case
        assert _max_diff(one, params(new_updater(loss_agg, mini_batches, None, algo))) > 1e-3
    # the loss and the correction change the update: these cases test something of their own
    assert _max_diff(ones["gspo"], ones["seq-mean-token-mean"]) > 1e-4
    assert _max_diff(ones["batch-normalized-weights"], ones["token-mean"]) > 1e-4

    ckpt = tmp_path / "run2" / "checkpoints" / "step_000002"
    assert is_sharded(ckpt) and (ckpt / "manifest.json").is_file()
    # the Hugging Face export: the full policy at step 2, loadable by model.path
    exported = AutoModelForCausalLM.from_pretrained(ckpt)
    assert _max_diff(at_step2, dict(exported.named_parameters())) < TOL
    # 2 -> 1: the sharded checkpoint resumed in this one process
    resumed = new_updater(*CKPT_CASE, None)
    restore_updater(ckpt, resumed.model, resumed.optimizer, resumed.scheduler, None)
    assert _max_diff(uninterrupted, params(train(resumed, range(2, 4)))) < TOL
    # 2 -> 2 and 1 -> 2, from the processes
    assert _max_diff(uninterrupted, torch.load(tmp_path / "from2.pt")) < TOL
    assert _max_diff(uninterrupted, torch.load(tmp_path / "from1.pt")) < TOL
    # the warm start: the moments by name, the new optimizer's own learning rate
    assert _max_diff(moments, torch.load(tmp_path / "warm.pt")) == 0.0
    assert float(torch.load(tmp_path / "warm_lr.pt")["lr"]) == pytest.approx(lr0)
