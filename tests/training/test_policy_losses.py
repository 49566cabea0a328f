"""The policy losses with hand-worked values; every loss with every aggregation mode."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rltool.config.algorithm import POLICY_LOSS_NAMES, AlgorithmConfig
from rltool.training.losses import LOSS_AGGREGATIONS, aggregate, ppo_policy_loss
from rltool.training.policy_losses import (
    POLICY_LOSSES,
    ClipSettings,
    LossInputs,
    build_policy_loss,
    cispo,
    gspo,
)

LN = math.log


def inputs(
    log_ratio: list[float],
    adv: list[float],
    cu: list[int],
    logp: list[float] | None = None,
    mask: list[bool] | None = None,
    w: list[float] | None = None,
) -> LossInputs:
    """A row with old logprobs = logp - log_ratio (logp defaults to -1 everywhere)."""
    n = len(log_ratio)
    lp = torch.tensor(logp if logp is not None else [-1.0] * n, dtype=torch.float32)
    lp.requires_grad_()
    old = (lp - torch.tensor(log_ratio)).detach()
    return LossInputs(
        logp=lp,
        old_logp=old,
        advantages=torch.tensor(adv),
        mask=torch.tensor(mask if mask is not None else [a != 0 for a in adv]),
        cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
        is_weights=None if w is None else torch.tensor(w),
    )


def test_the_registry_and_the_recipes_names_agree() -> None:
    assert POLICY_LOSSES.names() == sorted(POLICY_LOSS_NAMES)
    with pytest.raises(ValueError, match=r"algorithm.policy_loss: unknown policy loss 'nope'"):
        build_policy_loss(AlgorithmConfig(policy_loss="nope"))


def test_ppo_is_the_old_loss_times_the_is_weight_bit_for_bit() -> None:
    x = inputs([LN(1.5), LN(0.5), LN(4.0), 0.1], [1.0, -1.0, -1.0, 2.0], [0, 4], w=[0.5, 1, 2, 1])
    out = build_policy_loss(AlgorithmConfig())(x)
    plain = ppo_policy_loss(x.logp, x.old_logp, x.advantages, 0.2, 0.2, 3.0)
    assert torch.equal(out.pg, plain.pg * x.is_weights)
    assert torch.equal(out.clipped, plain.clipped) and torch.equal(out.ratio, plain.ratio)


def test_gspo_clips_the_samples_geometric_mean_ratio_hand_worked() -> None:
    # three samples in one row, then a padding position:
    #   a (A = 1):  log ratios 0.2, 0.0     -> s = exp(0.1)  = 1.10517, inside the clip
    #   b (A = -1): log ratios 0.5, 0.3, 0.1 -> s = exp(0.3) = 1.34986, A < 0: unclipped kept
    #   c (A = 1):  log ratios 0.4, 0.2, and an untrained token (log ratio 5, not counted)
    #               -> s = exp(0.3), A > 0: clipped to 1.2, no gradient
    x = inputs(
        [0.2, 0.0, 0.5, 0.3, 0.1, 0.4, 0.2, 5.0, 0.0],
        [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 0.0],
        [0, 2, 5, 8],
    )
    out = gspo(x, ClipSettings(0.2, 0.2))
    s_a, s_b = math.exp(0.1), math.exp(0.3)
    expected = [-s_a, -s_a, s_b, s_b, s_b, -1.2, -1.2]
    assert out.pg[:7].tolist() == pytest.approx(expected, abs=1e-6)
    assert out.clipped[:7].tolist() == [False] * 5 + [True] * 2
    assert out.ratio[:7].tolist() == pytest.approx([s_a] * 2 + [s_b] * 5, abs=1e-6)
    # each token's gradient is -A s_i (the stop-gradient form), 0 where clipped
    loss = aggregate(out.pg, x.mask, x.cu_seq_lens, "token-mean", 7, 3)
    loss.backward()
    grad = [-s_a / 7, -s_a / 7, s_b / 7, s_b / 7, s_b / 7, 0.0, 0.0, 0.0, 0.0]
    assert x.logp.grad.tolist() == pytest.approx(grad, abs=1e-6)
    # seq-mean-token-mean: the paper's mean over samples of each sample's token mean
    seq_loss = aggregate(out.pg, x.mask, x.cu_seq_lens, "seq-mean-token-mean", 7, 3)
    assert float(seq_loss.detach()) == pytest.approx((-s_a + s_b - 1.2) / 3, abs=1e-6)


def test_cispo_keeps_every_gradient_with_a_clipped_detached_weight_hand_worked() -> None:
    # ratio 1.5 (A = 1) -> weight 1.2; ratio 0.5 (A = -1) -> 0.8; ratio 1 (A = 2) -> 1
    x = inputs([LN(1.5), LN(0.5), 0.0], [1.0, -1.0, 2.0], [0, 3], logp=[-0.5, -2.0, -1.0])
    out = cispo(x, ClipSettings(0.2, 0.2))
    # pg = -w A logp
    assert out.pg.tolist() == pytest.approx([-1.2 * -0.5, -0.8 * 2.0, 2.0], abs=1e-6)
    assert out.clipped.tolist() == [True, True, False]
    out.pg.sum().backward()
    assert x.logp.grad.tolist() == pytest.approx([-1.2, 0.8, -2.0], abs=1e-6)  # -w A


def test_sapo_gate_has_ppos_slope_on_policy_hand_worked() -> None:
    x = inputs([0.0, 0.0], [1.0, -1.0], [0, 2])
    out = build_policy_loss(AlgorithmConfig(policy_loss="sapo"))(x)
    # gate(1) = sigmoid(0) 4 / tau: 2 for tau_pos = 1, 1.904762 for tau_neg = 1.05
    assert out.pg.tolist() == pytest.approx([-2.0, 4 * 0.5 / 1.05], abs=1e-6)
    out.pg.sum().backward()
    assert x.logp.grad.tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)  # -A, as PPO


def test_geo_mean_hand_worked() -> None:
    # A = 1, log ratios 0.3 (clipped to 0.2) and -0.1: L = -exp((0.2 - 0.1) / 2)
    x = inputs([0.3, -0.1], [1.0, 1.0], [0, 2])
    out = build_policy_loss(AlgorithmConfig(policy_loss="geo_mean"))(x)
    value = -math.exp(0.05)
    assert out.pg.tolist() == pytest.approx([value, value], abs=1e-6)
    assert out.clipped.tolist() == [True, False]
    aggregate(out.pg, x.mask, x.cu_seq_lens, "seq-mean-token-mean", 2, 1).backward()
    assert x.logp.grad.tolist() == pytest.approx([0.0, value / 2], abs=1e-6)


def test_dppo_tv_drops_tokens_whose_probability_moved_too_far_hand_worked() -> None:
    # p_old 0.5 -> p 0.8 (A > 0, moved 0.3 > 0.2: dropped), 0.5 -> 0.6 (kept),
    # 0.5 -> 0.2 (A < 0, moved -0.3 < -0.2: dropped)
    p, p_old = [0.8, 0.6, 0.2], [0.5, 0.5, 0.5]
    x = inputs(
        [LN(a / b) for a, b in zip(p, p_old, strict=True)],
        [1.0, 1.0, -1.0],
        [0, 3],
        logp=[LN(a) for a in p],
    )
    out = build_policy_loss(AlgorithmConfig(policy_loss="dppo_tv"))(x)
    assert out.pg.tolist() == pytest.approx([0.0, -1.2 * LN(0.6), 0.0], abs=1e-6)
    assert out.clipped.tolist() == [True, False, True]


def test_kl_cov_penalises_the_token_of_largest_covariance() -> None:
    # covariance (A - mean A)(logp - mean logp) is largest for token 0 (A high, logp high)
    x = inputs([0.5, 0.1, -0.2, 0.3], [2.0, 0.5, -1.0, -1.5], [0, 4], logp=[-0.1, -1, -2, -1.5])
    algo = AlgorithmConfig(policy_loss="kl_cov")
    algo.kl_cov.ratio, algo.kl_cov.coef = 0.25, 0.5
    out = build_policy_loss(algo)(x)
    ratio = [math.exp(v) for v in (0.5, 0.1, -0.2, 0.3)]
    pg = [-a * r for a, r in zip([2.0, 0.5, -1.0, -1.5], ratio, strict=True)]
    pg[0] += 0.5 * 0.5
    assert out.pg.tolist() == pytest.approx(pg, abs=1e-6)
    assert out.clipped.tolist() == [True, False, False, False]


def test_clip_cov_detaches_only_in_band_tokens_the_clip_left() -> None:
    # mean A = 0, mean logp = -1.5: cov = (3, -3, 3, 9); token 0 is the one in (1, 5) that
    # the clip left (token 2 is clipped: ratio 1.5, A > 0); at least one token is detached
    x = inputs([0.0, 0.0, LN(1.5), 0.0], [2.0, -2.0, 2.0, -2.0], [0, 4], logp=[0.0, 0.0, 0.0, -6.0])
    algo = AlgorithmConfig(policy_loss="clip_cov")
    out = build_policy_loss(algo)(x)
    assert out.clipped.tolist() == [True, False, False, False]
    out.pg.sum().backward()
    assert x.logp.grad.tolist() == pytest.approx([0.0, 2.0, 0.0, 2.0], abs=1e-6)


def _random_row(seed: int) -> LossInputs:
    """Four samples (one without a trained token) and two padding positions."""
    g = torch.Generator().manual_seed(seed)
    lens, n = [5, 3, 4, 6], 20
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    adv = torch.zeros(n)
    mask = torch.zeros(n, dtype=torch.bool)
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        if i != 1:  # sample 1 has no trained token
            mask[a + 1 : b] = True
            adv[a + 1 : b] = float(torch.randn(1, generator=g))
    logp = -torch.rand(n, generator=g) * 2 - 0.05
    old = logp + 0.3 * torch.randn(n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    return LossInputs(logp.requires_grad_(), old, adv, mask, torch.tensor(cu), w)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_every_loss_with_every_aggregation_is_finite_and_ignores_untrained_tokens(
    name: str, mode: str
) -> None:
    x = _random_row(3)
    torch.manual_seed(0)
    out = build_policy_loss(AlgorithmConfig(policy_loss=name))(x)
    assert out.pg.shape == out.ratio.shape == out.clipped.shape == x.mask.shape
    loss = aggregate(out.pg, x.mask, x.cu_seq_lens, mode, int(x.mask.sum()), 3, 20)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert bool(torch.isfinite(x.logp.grad).all())
    assert float(x.logp.grad[~x.mask].abs().max()) == 0.0  # untrained tokens get no gradient
    assert float(x.logp.grad[x.mask].abs().max()) > 0.0


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_a_row_without_trained_tokens_gives_zero_loss_and_gradient(name: str) -> None:
    x = _random_row(4)
    empty = LossInputs(x.logp, x.old_logp, x.advantages, torch.zeros_like(x.mask), x.cu_seq_lens)
    out = build_policy_loss(AlgorithmConfig(policy_loss=name))(empty)
    loss = aggregate(out.pg, empty.mask, x.cu_seq_lens, "token-mean", 5, 2)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert float(x.logp.grad.abs().max()) == 0.0
