"""The policy loss: PPO/GRPO clipping, KL to a reference, aggregation.

Shape legend: N = tokens in one packed row (one micro-batch), S = samples in it.
Every function is pure and works on per-token tensors of one row.
Design (the algorithm, written out): docs/losses.md#the-policy-loss
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rltool.registry import Registry

# exp() of a log-ratio beyond this overflows float32 or means the sample is garbage
MAX_LOG_RATIO = 20.0

# d = ref_logp - logp [N] -> per-token KL estimate [N]
KLEstimator = Callable[[torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "algorithm.kl_estimator")

# (masked loss [N], mask [N], cu_seq_lens [S + 1], num_tokens, num_seqs, norm_len) -> this
# row's share of the mini-batch loss; the counts are the mini-batch's (see ``aggregate``)
LossAggregation = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, int | None], torch.Tensor
]
LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation", "algorithm.loss_agg")


@dataclass(slots=True)
class PolicyLoss:
    pg: torch.Tensor  # [N] per-token clipped policy-gradient loss
    ratio: torch.Tensor  # [N] exp(logp - old), detached
    clipped: torch.Tensor  # [N] bool, a clip (either side, or the dual clip) is active


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> PolicyLoss:
    """Per-token PPO clipped surrogate with verl's dual clip for negative advantages.

    The pessimistic max of the unclipped and clipped surrogate stops the gradient
    once the ratio has left ``[1 - clip_low, 1 + clip_high]`` in the direction the
    advantage pushes it. For A < 0 the unclipped term -A r grows without bound as
    r grows; the dual clip caps the loss at -A * dual_clip (gradient 0 beyond).
    """
    log_ratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [N]
    ratio = torch.exp(log_ratio)  # [N]
    pg_unclipped = -advantages * ratio  # [N]
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N]
    pg = torch.maximum(pg_unclipped, pg_clipped)  # [N]
    clipped = pg_clipped > pg_unclipped  # [N]
    if dual_clip is not None:
        pg_dual = -advantages * dual_clip  # [N]
        dual_active = (advantages < 0) & (pg > pg_dual)  # [N]
        pg = torch.where(dual_active, pg_dual, pg)  # [N]
        clipped = clipped | dual_active
    return PolicyLoss(pg=pg, ratio=ratio.detach(), clipped=clipped)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    With d = ref - logp:  k1 = -d (unbiased, can be negative), k2 = d^2 / 2,
    k3 = exp(d) - d - 1 (unbiased for the KL value, always >= 0).
    """
    return KL_ESTIMATORS.get(estimator)(ref_logp - logp)  # [N]


@KL_ESTIMATORS.register("k1")
def kl_k1(d: torch.Tensor) -> torch.Tensor:
    return -d  # [N]


@KL_ESTIMATORS.register("k2")
def kl_k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()  # [N]


@KL_ESTIMATORS.register("k3")
def kl_k3(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [N]
    return torch.exp(d) - d - 1.0  # [N]


def sequence_ids(cu_seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Index of the sample each of the n positions belongs to; S past the last sample."""
    ends = cu_seq_lens[1:].to(torch.long)  # [S]
    positions = torch.arange(n, device=ends.device)  # [N]
    return torch.searchsorted(ends, positions, right=True)  # [N] in 0..S


def count_tokens_and_seqs(mask: torch.Tensor, cu_seq_lens: torch.Tensor) -> tuple[int, int]:
    """Loss-active tokens, and samples with at least one of them, in one row."""
    num_samples = int(cu_seq_lens.shape[0]) - 1
    seq = sequence_ids(cu_seq_lens, int(mask.shape[0]))  # [N]
    per_seq = torch.bincount(seq[mask], minlength=num_samples + 1)  # [S + 1]
    assert int(per_seq[num_samples]) == 0, "a loss-active position lies outside every sample"
    return int(mask.sum()), int((per_seq[:num_samples] > 0).sum())


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    mode: str,
    num_tokens: int,
    num_seqs: int,
    norm_len: int | None = None,
) -> torch.Tensor:
    """This row's share of the mini-batch loss; summing the shares gives the full loss.

    ``num_tokens`` / ``num_seqs`` are the counts over the whole mini-batch
    (``count_tokens_and_seqs`` summed over its rows); a sample never spans rows.
    ``mode`` names a ``LOSS_AGGREGATIONS`` entry. Samples without an active token
    count in no mode.
    """
    agg = LOSS_AGGREGATIONS.get(mode)
    masked = torch.where(mask, loss, torch.zeros_like(loss))  # [N]
    return agg(masked, mask, cu_seq_lens, num_tokens, num_seqs, norm_len)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    masked: torch.Tensor,
    mask: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int,
    num_seqs: int,
    norm_len: int | None,
) -> torch.Tensor:
    """Sum of token losses / num_tokens: every token weighs the same."""
    return masked.sum() / max(num_tokens, 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    masked: torch.Tensor,
    mask: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int,
    num_seqs: int,
    norm_len: int | None,
) -> torch.Tensor:
    """Mean over samples of each sample's token mean: every sample weighs the same,
    whatever its length."""
    num_samples = int(cu_seq_lens.shape[0]) - 1
    seq = sequence_ids(cu_seq_lens, int(masked.shape[0]))  # [N]
    zeros = masked.new_zeros(num_samples + 1)  # [S + 1]
    seq_sum = zeros.index_add(0, seq, masked)  # [S + 1]
    seq_len = zeros.index_add(0, seq, mask.to(masked.dtype))  # [S + 1]
    return (seq_sum[:num_samples] / seq_len[:num_samples].clamp(min=1)).sum() / max(num_seqs, 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    masked: torch.Tensor,
    mask: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int,
    num_seqs: int,
    norm_len: int | None,
) -> torch.Tensor:
    """Dr.GRPO: sum of token losses / norm_len per sample, mean over samples; norm_len is
    a constant (the response budget) so no length bias enters."""
    if norm_len is None or norm_len <= 0:
        raise ValueError(
            "loss_agg 'seq-mean-token-sum-norm' needs a positive norm_len "
            "(the maximum response length)"
        )
    return masked.sum() / (norm_len * max(num_seqs, 1))
