"""One policy update on a tiny Qwen2: direction, no-op, layout invariance, metrics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_models import random_qwen2

from rltool.config.schema import AlgorithmConfig, OptimizerConfig
from rltool.training.batch import Pack
from rltool.training.logprobs import forward_logprobs
from rltool.training.losses import LOSS_AGGREGATIONS
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.updater import PolicyUpdater, rollout_logprob_mask, split_mini_batches

VOCAB = 101
METRIC_KEYS = {
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/clip_frac",
    "actor/ratio_mean",
    "actor/tis_weight_mean",
    "actor/rollout_kl",
    "actor/grad_norm",
    "actor/lr",
    "actor/approx_kl_old",
    "actor/skipped_steps",
    "actor/optimizer_steps",
}


def tiny_qwen2() -> torch.nn.Module:
    return random_qwen2(VOCAB)


def make_samples(advantages: list[float], seed: int = 1) -> list[dict]:
    """Shifted samples: model input, targets (prompt of 3 unsupervised), advantage, rollout lp."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, adv in enumerate(advantages):
        n = 6 + 2 * i
        seq = torch.randint(1, VOCAB, (n + 1,), generator=g)
        targets = torch.cat([torch.full((2,), -100), seq[3:]])
        active = targets != -100
        rollout = torch.where(active, -torch.rand(n, generator=g) - 1.0, torch.zeros(n))
        out.append({"ids": seq[:-1], "targets": targets, "adv": adv * active, "lp": rollout})
    return out


def pack_of(samples: list[dict], index: list[int]) -> Pack:
    lens = [len(s["ids"]) for s in samples]
    return Pack(
        input_ids=torch.cat([s["ids"] for s in samples]),
        targets=torch.cat([s["targets"] for s in samples]),
        advantages=torch.cat([s["adv"] for s in samples]).float(),
        rollout_logprobs=torch.cat([s["lp"] for s in samples]),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        max_seq_len=max(lens),
        sample_index=index,
    )


def updater_for(model, algo: AlgorithmConfig, lr: float = 1e-3, sgd: bool = False, **kw):
    cfg = OptimizerConfig(lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if sgd else build_optimizer(model, cfg)
    return PolicyUpdater(model, opt, build_scheduler(opt, cfg, 10), algo, **kw)


def sample_logprob(model, sample: dict) -> float:
    with torch.no_grad():
        return float(forward_logprobs(model, pack_of([sample], [0]), 1.0, False)[0].sum())


def test_positive_advantage_raises_that_samples_logprob() -> None:
    model = tiny_qwen2()
    samples = make_samples([1.0, -1.0])
    before = [sample_logprob(model, s) for s in samples]
    updater = updater_for(model, AlgorithmConfig(), grad_clip=1.0)
    metrics = updater.step([pack_of(samples, [0, 1])])
    after = [sample_logprob(model, s) for s in samples]
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy
    assert metrics["actor/clip_frac"] == 0.0


def test_zero_advantage_without_kl_or_entropy_moves_nothing() -> None:
    model = tiny_qwen2()
    before = copy.deepcopy(model.state_dict())
    updater = updater_for(model, AlgorithmConfig(ppo_epochs=2), lr=1e-2, grad_clip=1.0)
    metrics = updater.step([pack_of(make_samples([0.0, 0.0, 0.0]), [0, 1, 2])])
    assert metrics["actor/pg_loss"] == 0.0
    assert metrics["actor/grad_norm"] == 0.0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    with torch.no_grad():
        pairs = zip(a.parameters(), b.parameters(), strict=True)
        return max(float((p - q).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS.names())
def test_one_row_or_two_rows_give_the_same_update(loss_agg: str) -> None:
    """Micro-batch accumulation is exact: the packing layout does not change the step."""
    samples = make_samples([1.5, -0.5, 0.7])
    algo = AlgorithmConfig(loss_agg=loss_agg, tis_cap=2.0)
    models = []
    for layout in ([[0, 1, 2]], [[0, 2], [1]]):
        model = tiny_qwen2()
        packs = [pack_of([samples[i] for i in row], row) for row in layout]
        updater_for(model, algo, lr=0.5, sgd=True, grad_clip=None, norm_len=12).step(packs)
        models.append(model)
    initial = tiny_qwen2()
    moved = _max_abs_diff(models[0], initial)
    diff = _max_abs_diff(models[0], models[1])
    assert moved > 1e-3
    assert diff < 1e-6


def test_full_algorithm_metrics_present_finite_and_schedule_counts_train_steps() -> None:
    model = tiny_qwen2()
    ref = copy.deepcopy(model).requires_grad_(False)
    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, ppo_epochs=2, mini_batches=2)
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    packs = [pack_of(samples[:2], [0, 1]), pack_of(samples[2:3], [2]), pack_of(samples[3:], [3])]
    updater = updater_for(model, algo, lr=1e-2, grad_clip=1.0, ref_model=ref, temperature=0.8)
    metrics = updater.step(packs)
    assert set(metrics) == METRIC_KEYS
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/optimizer_steps"] == 4.0  # 2 epochs x 2 mini-batches
    assert metrics["actor/kl"] > 0  # the policy left the reference after the first step
    assert metrics["actor/approx_kl_old"] > 0
    assert metrics["actor/entropy"] > 0
    assert 0 < metrics["actor/tis_weight_mean"] <= 2.0
    assert metrics["actor/rollout_kl"] > 0  # the fake engine logprobs differ from the model's
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert updater.scheduler.last_epoch == 1  # one scheduler step per train step


def test_model_mode_is_restored() -> None:
    model = tiny_qwen2().train()
    updater_for(model, AlgorithmConfig(), grad_clip=1.0).step([pack_of(make_samples([1.0]), [0])])
    assert model.training


def test_rollout_logprob_mask_marks_samples_without_engine_logprobs() -> None:
    samples = make_samples([1.0, 1.0])
    samples[1]["lp"] = torch.zeros_like(samples[1]["lp"])
    pack = pack_of(samples, [0, 1])
    first = len(samples[0]["ids"])
    assert rollout_logprob_mask(pack).tolist() == [True] * first + [False] * (len(pack) - first)


def test_split_mini_batches_balances_tokens() -> None:
    # largest first to the lightest group: 5->g0, 4->g1, 3->g1, 3->g0, 1->g1
    assert split_mini_batches([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]
    assert split_mini_batches([3], 2) == [[0]]


def test_config_errors_name_the_field() -> None:
    model = tiny_qwen2()
    with pytest.raises(ValueError, match="ref_model"):
        updater_for(model, AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="norm_len"):
        updater_for(model, AlgorithmConfig(loss_agg="seq-mean-token-sum-norm"))
    with pytest.raises(ValueError, match="dual_clip"):
        updater_for(model, AlgorithmConfig(dual_clip=0.5))
    with pytest.raises(ValueError, match="kl_estimator"):
        updater_for(model, AlgorithmConfig(kl_estimator="k9"))
