"""The policy loss with hand-worked values, and exact micro-batch accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from rltool.config.correction import CorrectionSpec
from rltool.training.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    count_tokens_and_seqs,
    kl_penalty,
    ppo_policy_loss,
    sequence_ids,
)
from rltool.training.rollout_correction import correct_row

# one token per clip case; clip 0.2 both sides, dual clip 3, old logp 0 so ratio = exp(logp)
CASES = [
    # (advantage, ratio, loss, clipped, d loss / d logp)
    (1.0, 1.5, -1.2, True, 0.0),  # A > 0, ratio above 1 + clip_high
    (-1.0, 0.5, 0.8, True, 0.0),  # A < 0, ratio below 1 - clip_low
    (-1.0, 4.0, 3.0, True, 0.0),  # A < 0, ratio above the dual clip: loss capped at -A * 3
    (1.0, 1.1, -1.1, False, -1.1),  # inside the trust region
    (1.0, 0.5, -0.5, False, -0.5),  # A > 0, ratio below 1 - clip_low: pessimistic max keeps it
    (-1.0, 2.0, 2.0, False, 2.0),  # A < 0, ratio between 1 + clip_high and the dual clip
    (-2.0, 1.0, 2.0, False, 2.0),  # on-policy: loss = -A, gradient = -A
]


def test_ppo_clip_cases_hand_worked() -> None:
    adv = torch.tensor([c[0] for c in CASES])
    logp = torch.tensor([math.log(c[1]) for c in CASES], requires_grad=True)
    out = ppo_policy_loss(logp, torch.zeros(len(CASES)), adv, 0.2, 0.2, 3.0)
    out.pg.sum().backward()
    assert out.pg.tolist() == pytest.approx([c[2] for c in CASES], abs=1e-6)
    assert out.clipped.tolist() == [c[3] for c in CASES]
    assert logp.grad.tolist() == pytest.approx([c[4] for c in CASES], abs=1e-6)
    assert out.ratio.tolist() == pytest.approx([c[1] for c in CASES], abs=1e-6)


def test_dual_clip_off_and_asymmetric_clip() -> None:
    adv = torch.tensor([-1.0, 1.0, 1.0])
    logp = torch.tensor([math.log(4.0), math.log(1.25), math.log(1.35)])
    out = ppo_policy_loss(logp, torch.zeros(3), adv, 0.2, 0.28, None)  # DAPO clip-higher
    assert out.pg.tolist() == pytest.approx([4.0, -1.25, -1.28], abs=1e-6)
    assert out.clipped.tolist() == [False, False, True]


def test_tis_weight_is_capped_detached_and_one_without_rollout_logprobs() -> None:
    old = torch.tensor([0.0, -1.0, -0.1, 0.0], requires_grad=True)
    rollout = torch.tensor([-1.0, 0.0, -0.1, -3.0])
    has = torch.tensor([True, True, True, False])
    spec = CorrectionSpec(weights="token", upper=2.0)  # token_tis with cap 2 (tis_cap)
    mask, cu_seq_lens = torch.ones(4, dtype=torch.bool), torch.tensor([0, 4])
    w = correct_row(old, rollout, mask, has, cu_seq_lens, spec).weight
    # exp(1) = 2.718 -> cap 2; exp(-1); exp(0); no rollout logprobs -> 1
    assert w.tolist() == pytest.approx([2.0, math.exp(-1.0), 1.0, 1.0], abs=1e-6)
    assert not w.requires_grad


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [1.0, -1.0, 0.0]),
        ("k2", [0.5, 0.5, 0.0]),
        ("k3", [math.exp(-1.0), math.e - 2.0, 0.0]),
    ],
)
def test_kl_estimators_hand_worked(estimator: str, expected: list[float]) -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])
    assert kl_penalty(logp, ref, estimator).tolist() == pytest.approx(expected, abs=1e-6)


def test_unknown_kl_estimator_names_the_field() -> None:
    with pytest.raises(
        ValueError, match=r"^algorithm\.kl_estimator: unknown KL estimator 'k4'; known: k1, k2, k3$"
    ):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


# two samples [0, 3) and [3, 6) plus one trailing padding position outside every sample
LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
MASK = torch.tensor([True, True, False, True, True, True, False])
CU = torch.tensor([0, 3, 6], dtype=torch.int32)


def test_sequence_ids_and_counts() -> None:
    assert sequence_ids(CU, 7).tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert count_tokens_and_seqs(MASK, CU) == (5, 2)
    no_active_in_second = torch.tensor([True, False, False, False, False, False, False])
    assert count_tokens_and_seqs(no_active_in_second, CU) == (1, 1)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 18.0 / 5),  # (1 + 2 + 4 + 5 + 6) / 5 tokens
        ("seq-mean-token-mean", (1.5 + 5.0) / 2),  # sample means 3/2 and 15/3
        ("seq-mean-token-sum-norm", (3.0 / 10 + 15.0 / 10) / 2),  # norm_len 10
    ],
)
def test_aggregate_hand_worked(mode: str, expected: float) -> None:
    tokens, seqs = count_tokens_and_seqs(MASK, CU)
    got = aggregate(LOSS, MASK, CU, mode, tokens, seqs, norm_len=10)
    assert float(got) == pytest.approx(expected, abs=1e-6)


def test_aggregate_rejects_unknown_mode_and_missing_norm() -> None:
    with pytest.raises(
        ValueError,
        match=r"^algorithm\.loss_agg: unknown loss aggregation 'sum'; known: seq-mean-token-mean, "
        r"seq-mean-token-sum-norm, token-mean$",
    ):
        aggregate(LOSS, MASK, CU, "sum", 5, 2)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(LOSS, MASK, CU, "seq-mean-token-sum-norm", 5, 2)


def _row_loss(theta: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-token loss of the parameters, like the real one."""
    out = ppo_policy_loss(torch.tanh(theta) - 0.5, torch.full_like(theta, -0.5), adv, 0.1, 0.1, 2.0)
    return out.pg + 0.1 * kl_penalty(theta, torch.zeros_like(theta), "k3")


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_two_micro_batches_give_the_full_batch_gradient(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [[4, 2, 5], [3, 6]]  # samples of row 1 and row 2
    rows = []
    for row_lens in lens:
        n = sum(row_lens)
        cu = torch.tensor([0, *torch.tensor(row_lens).cumsum(0).tolist()], dtype=torch.int32)
        mask = torch.rand(n, generator=g) > 0.3
        adv = torch.randn(n, generator=g) * mask
        rows.append((n, cu, mask, adv))
    theta0 = torch.randn(sum(r[0] for r in rows), generator=g) * 0.3

    full_cu = torch.tensor(
        [0, *torch.tensor([n for row in lens for n in row]).cumsum(0).tolist()], dtype=torch.int32
    )
    full_mask = torch.cat([r[2] for r in rows])
    full_adv = torch.cat([r[3] for r in rows])
    tokens, seqs = count_tokens_and_seqs(full_mask, full_cu)
    theta = theta0.clone().requires_grad_()
    full = aggregate(_row_loss(theta, full_adv), full_mask, full_cu, mode, tokens, seqs, 7)
    full.backward()

    theta_micro = theta0.clone().requires_grad_()
    counts = [count_tokens_and_seqs(r[2], r[1]) for r in rows]
    assert (sum(c[0] for c in counts), sum(c[1] for c in counts)) == (tokens, seqs)
    total, start = 0.0, 0
    for n, cu, mask, adv in rows:
        part = _row_loss(theta_micro[start : start + n], adv)
        micro = aggregate(part, mask, cu, mode, tokens, seqs, 7)
        micro.backward()
        total += float(micro.detach())
        start += n
    assert total == pytest.approx(float(full.detach()), abs=1e-6)
    assert torch.allclose(theta_micro.grad, theta.grad, atol=1e-7)
    assert float(theta.grad.abs().sum()) > 0
