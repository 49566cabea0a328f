"""The updater with each policy loss: direction, exact accumulation over rows, metrics."""

from __future__ import annotations

import math

import pytest
import torch
from test_updater import (
    LAYOUTS,
    METRIC_KEYS,
    _max_abs_diff,
    laid_out,
    make_samples,
    pack_of,
    sample_logprob,
    tiny_qwen2,
    updater_for,
)

from rltool.config.algorithm import POLICY_LOSS_NAMES, AlgorithmConfig
from rltool.training.losses import LOSS_AGGREGATIONS

# the batch statistic of clip_cov / kl_cov (covariance, token share) is the row's, as verl's
# is the micro-batch's: how the samples fall into rows changes which tokens they pick
ROW_INDEPENDENT = [n for n in POLICY_LOSS_NAMES if n not in ("clip_cov", "kl_cov")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_each_loss_raises_a_positive_samples_logprob_and_lowers_a_negative(
    name: str, layout: str
) -> None:
    model = tiny_qwen2()
    samples = make_samples([1.0, -1.0])
    before = [sample_logprob(model, s) for s in samples]
    updater = updater_for(model, AlgorithmConfig(policy_loss=name), grad_clip=1.0)
    metrics = updater.step(laid_out([pack_of(samples, [0, 1])], layout))
    after = [sample_logprob(model, s) for s in samples]
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3
    # one set of names, whatever the loss (mismatch/* are the rollout correction's)
    assert {k for k in metrics if not k.startswith("mismatch/")} == METRIC_KEYS
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("name", ROW_INDEPENDENT)
def test_one_row_or_two_rows_give_the_same_update_with_each_loss(name: str, loss_agg: str) -> None:
    """Two epochs, so the second one is off-policy (ratios away from 1, clips active)."""
    samples = make_samples([1.5, -0.5, 0.7])
    algo = AlgorithmConfig(policy_loss=name, loss_agg=loss_agg, tis_cap=2.0, ppo_epochs=2)
    models = []
    for rows in ([[0, 1, 2]], [[0, 2], [1]]):
        model = tiny_qwen2()
        packs = [pack_of([samples[i] for i in row], row) for row in rows]
        updater_for(model, algo, lr=0.5, sgd=True, grad_clip=None, norm_len=12).step(packs)
        models.append(model)
    assert _max_abs_diff(models[0], tiny_qwen2()) > 1e-3
    assert _max_abs_diff(models[0], models[1]) < 1e-6


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_shared_prefix_rows_train_as_plain_rows_with_each_loss(name: str) -> None:
    """A sample's span in a shared row covers its tree's prefix (no trained token there):
    sequence-level losses see the same samples either way."""
    samples = make_samples([1.5, -0.5, 0.7])
    algo = AlgorithmConfig(policy_loss=name, loss_agg="seq-mean-token-mean", ppo_epochs=2)
    models = []
    for layout in LAYOUTS:
        model = tiny_qwen2()
        packs = laid_out([pack_of(samples, [0, 1, 2])], layout)
        torch.manual_seed(0)  # clip_cov draws its tokens from torch's generator
        updater_for(model, algo, lr=0.5, sgd=True, grad_clip=None).step(packs)
        models.append(model)
    assert _max_abs_diff(models[0], models[1]) < 1e-5
