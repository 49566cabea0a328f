"""FSDP2 train steps on several gloo processes, for tests/training/test_sharding.py.

``torchrun --nproc_per_node 2 fsdp_steps.py OUT_DIR SINGLE_CKPT`` writes, from rank 0:
``OUT_DIR/<case>.pt`` (full parameters after 3 steps, one file per case of ``CASES``),
a sharded checkpoint at step 2 under ``OUT_DIR/run2``, and the parameters after steps
3-4 resumed from it (``from2.pt``) and from the one-process checkpoint ``SINGLE_CKPT``
(``from1.pt``). The test computes the same on one process and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models

from tiny_models import random_qwen2

from rltool.app.checkpoint import TrainerState, capture_rng, save_checkpoint
from rltool.app.sharded_checkpoint import (
    SHARDED,
    load_full_moments,
    restore_updater,
    write_sharded,
)
from rltool.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltool.config.schema import DistributedConfig, OptimizerConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.training.batch import Pack
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.sharding import (
    Shard,
    announce,
    close_shard,
    full_parameters,
    init_shard,
    receive,
    shard_model,
)
from rltool.training.updater import PolicyUpdater

# case -> (loss aggregation, mini-batches (2: the old-logprob forwards and padded rank slots
# run), the rest of algorithm): a sequence-level loss over rows split across ranks, and
# token IS weights normalised over the whole batch (every rank's rows gathered)
CASES = {
    "token-mean": ("token-mean", 1, {}),
    "seq-mean-token-mean": ("seq-mean-token-mean", 2, {}),
    "seq-mean-token-sum-norm": ("seq-mean-token-sum-norm", 1, {}),
    "gspo": ("seq-mean-token-mean", 2, {"policy_loss": "gspo"}),
    "batch-normalized-weights": (
        "token-mean",
        1,
        {"rollout_correction": RolloutCorrectionConfig(weights="token", batch_normalize=True)},
    ),
}
CKPT_CASE = ("token-mean", 2)
VOCAB = 491  # the demo tokenizer's, so that a checkpoint's tokenizer fits its model
SIZES = (3, 1, 2, 4, 1)  # samples per pack: rows of unequal token counts


def step_packs(step: int) -> list[Pack]:
    """The packs of train step ``step``: 5 rows, fixed by the step alone."""
    g = torch.Generator().manual_seed(100 + step)
    packs = []
    for n_samples in SIZES:
        lens = [int(torch.randint(5, 14, (1,), generator=g)) for _ in range(n_samples)]
        ids, targets, adv, lp = [], [], [], []
        for n in lens:
            seq = torch.randint(1, VOCAB, (n + 1,), generator=g)
            prompt = int(torch.randint(1, 4, (1,), generator=g))
            t = torch.cat([torch.full((prompt,), -100), seq[prompt + 1 :]])
            active = t != -100
            ids.append(seq[:-1])
            targets.append(t)
            adv.append(float(torch.randn((), generator=g)) * active.float())
            lp.append(torch.where(active, -torch.rand(n, generator=g) - 1.0, torch.zeros(n)))
        packs.append(
            Pack(
                input_ids=torch.cat(ids),
                targets=torch.cat(targets),
                advantages=torch.cat(adv),
                rollout_logprobs=torch.cat(lp),
                has_rollout_logprobs=torch.ones(sum(lens), dtype=torch.bool),
                position_ids=torch.cat([torch.arange(n) for n in lens]),
                cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).int(),
                max_seq_len=max(lens),
                sample_index=list(range(len(lens))),
            )
        )
    return packs


def new_updater(
    loss_agg: str, mini_batches: int, shard: Shard | None, algo: dict | None = None
) -> PolicyUpdater:
    model = random_qwen2(VOCAB, seed=0)
    if shard is not None:
        shard_model(model, DistributedConfig())
    cfg = OptimizerConfig(lr=1e-3, warmup_steps=2, schedule="linear", weight_decay=0.01)
    optimizer = build_optimizer(model, cfg)
    algorithm = AlgorithmConfig(loss_agg=loss_agg, mini_batches=mini_batches, **(algo or {}))
    return PolicyUpdater(
        model, optimizer, build_scheduler(optimizer, cfg, 10), algorithm, norm_len=16, shard=shard
    )


def train(updater: PolicyUpdater, steps: range) -> PolicyUpdater:
    for step in steps:
        updater.step(step_packs(step))
    return updater


def params(updater: PolicyUpdater) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in full_parameters(updater.model)}


def save(updater: PolicyUpdater, root: Path, step: int, shard: Shard | None) -> Path:
    """A checkpoint as the driver writes it (sharded when ``shard`` is set)."""
    optimizer = updater.optimizer.state_dict() if shard is None else SHARDED
    state = TrainerState(step, optimizer, updater.scheduler.state_dict(), capture_rng(), {}, {})
    if shard is None:
        return save_checkpoint(root, updater.model, train_demo_tokenizer(), state)

    def write(tmp: Path) -> None:  # the leader's side of the app's "save" message
        announce(shard, str(tmp))
        write_sharded(tmp, updater.model, updater.optimizer, shard)

    return save_checkpoint(root, updater.model, train_demo_tokenizer(), state, write_model=write)


def main(out: Path, single_ckpt: Path) -> None:
    torch.set_num_threads(1)
    shard = init_shard(DistributedConfig())
    assert shard is not None, "run under torchrun"
    results: dict[str, dict] = {}
    for case, (loss_agg, mini_batches, algo) in CASES.items():
        results[case] = params(train(new_updater(loss_agg, mini_batches, shard, algo), range(3)))
    updater = train(new_updater(*CKPT_CASE, shard), range(2))
    if shard.leader:
        ckpt = save(updater, out / "run2" / "checkpoints", 2, shard)
        announce(shard, str(ckpt))
    else:
        write_sharded(Path(receive(shard)), updater.model, updater.optimizer, shard)
        ckpt = Path(receive(shard))
    for name, source in (("from2", ckpt), ("from1", single_ckpt)):
        resumed = new_updater(*CKPT_CASE, shard)
        restore_updater(source, resumed.model, resumed.optimizer, resumed.scheduler, shard)
        results[name] = params(train(resumed, range(2, 4)))
    # warm-start moments saved by one process (optimizer.pt beside SINGLE_CKPT's weights)
    warm = new_updater(*CKPT_CASE, shard)
    load_full_moments(warm.model, warm.optimizer, single_ckpt / "optimizer.pt")
    full = get_optimizer_state_dict(
        warm.model, warm.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    results["warm"] = {n: s["exp_avg"] for n, s in full["state"].items()}
    results["warm_lr"] = {"lr": torch.tensor(full["param_groups"][0]["lr"])}
    if shard.leader:
        for name, p in results.items():
            torch.save(p, out / f"{name}.pt")
    close_shard(shard)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
