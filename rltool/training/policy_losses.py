"""The policy losses, one registry: ``algorithm.policy_loss`` picks one.

Shape legend: N = tokens in one packed row (one micro-batch), S = samples in it.
Each loss is a pure function ``(LossInputs, settings) -> PolicyLoss`` over the
per-token tensors of one row; ``settings`` is the small object it reads (built from
the recipe by the function registered beside it), so no loss takes a parameter it
ignores. The result is per token, before aggregation (``losses.aggregate``), so every
aggregation mode works with every loss; a sequence-level loss gives each of a
sample's tokens its sample's value. ``is_weights`` (a detached per-token importance
weight, the rollout correction) multiplies the per-token loss. The formulas:
docs/losses.md#the-policy-losses
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from rltool.config.algorithm import AlgorithmConfig, KlCovConfig, SapoConfig
from rltool.registry import Registry
from rltool.training.losses import MAX_LOG_RATIO, PolicyLoss, ppo_policy_loss, sequence_ids

# exp() of a log-ratio beyond this overflows float32 or means the sample is garbage


@dataclass(frozen=True, slots=True)
class LossInputs:
    logp: torch.Tensor  # [N] the current policy's logprobs of the targets, with grad
    old_logp: torch.Tensor  # [N] the policy that sampled (the trainer's recompute), detached
    advantages: torch.Tensor  # [N] the sample's advantage where the target is trained, else 0
    mask: torch.Tensor  # [N] bool, loss-active tokens
    cu_seq_lens: torch.Tensor  # [S + 1] sample boundaries of the row
    is_weights: torch.Tensor | None = None  # [N] detached importance weight, None = 1

    def weighted(self, pg: torch.Tensor) -> torch.Tensor:
        return pg if self.is_weights is None else pg * self.is_weights  # [N]


@dataclass(frozen=True, slots=True)
class ClipSettings:
    """``algorithm.clip_low`` / ``clip_high`` (and ``dual_clip`` where a loss reads it)."""

    clip_low: float
    clip_high: float
    dual_clip: float | None = None

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> ClipSettings:
        return cls(algo.clip_low, algo.clip_high, algo.dual_clip)


@dataclass(frozen=True, slots=True)
class DppoSettings:
    """DPPO: divergence thresholds (``clip_low`` / ``clip_high``), the ratio's cap."""

    low: float
    high: float
    ratio_cap: float

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> DppoSettings:
        return cls(algo.clip_low, algo.clip_high, algo.dppo.ratio_cap)


@dataclass(frozen=True, slots=True)
class ClipCovSettings:
    clip_low: float
    clip_high: float
    ratio: float  # share of the row's loss tokens detached
    cov_low: float  # candidates: cov in (cov_low, cov_high)
    cov_high: float

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> ClipCovSettings:
        c = algo.clip_cov
        return cls(algo.clip_low, algo.clip_high, c.ratio, c.low, c.high)


@dataclass(frozen=True, slots=True)
class PolicyLossKind:
    fn: Callable[[LossInputs, Any], PolicyLoss]
    settings: Callable[[AlgorithmConfig], Any]  # the recipe -> the settings ``fn`` reads


POLICY_LOSSES: Registry[PolicyLossKind] = Registry("policy loss", "algorithm.policy_loss")

PolicyLossFn = Callable[[LossInputs], PolicyLoss]


def build_policy_loss(algo: AlgorithmConfig) -> PolicyLossFn:
    """The recipe's loss with its settings bound; an unknown name names the key and the known."""
    kind = POLICY_LOSSES.get(algo.policy_loss)
    settings = kind.settings(algo)
    return lambda x: kind.fn(x, settings)


def _register(name: str, settings: Callable[[AlgorithmConfig], Any]):
    def wrap(fn: Callable[[LossInputs, Any], PolicyLoss]):
        POLICY_LOSSES.register(name)(PolicyLossKind(fn, settings))
        return fn

    return wrap


def _per_sample(x: LossInputs, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean of ``values`` over each sample's loss tokens [S + 1], each position's
    sample [N]); a sample without one has mean 0, positions past the last sample index S."""
    n, num_samples = int(x.mask.shape[0]), int(x.cu_seq_lens.shape[0]) - 1
    seq = sequence_ids(x.cu_seq_lens, n)  # [N]
    zeros = values.new_zeros(num_samples + 1)  # [S + 1]
    total = zeros.index_add(0, seq, torch.where(x.mask, values, torch.zeros_like(values)))
    count = zeros.index_add(0, seq, x.mask.to(values.dtype)).clamp(min=1)  # [S + 1]
    return total / count, seq  # [S + 1], [N]


def _ratio(x: LossInputs) -> torch.Tensor:
    log_ratio = (x.logp - x.old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [N]
    return torch.exp(log_ratio)  # [N]


@_register("ppo", ClipSettings.of)
def ppo(x: LossInputs, s: ClipSettings) -> PolicyLoss:
    """PPO/GRPO clipped surrogate, dual clip for A < 0 (``losses.ppo_policy_loss``)::

    r = exp(logp - old);  pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg = min(pg, -A dual_clip) where A < 0;  loss_t = w_t pg_t
    """
    out = ppo_policy_loss(x.logp, x.old_logp, x.advantages, s.clip_low, s.clip_high, s.dual_clip)
    return replace(out, pg=x.weighted(out.pg))


@_register("gspo", ClipSettings.of)
def gspo(x: LossInputs, s: ClipSettings) -> PolicyLoss:
    """GSPO: the clip acts on the sample's length-normalised (geometric-mean) ratio::

    s_i   = exp(mean over the sample's loss tokens of (logp - old))
    s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])      (value s_i, gradient of token t)
    pg_t  = max(-A s_i,t, -A clip(s_i,t, 1 - clip_low, 1 + clip_high)),  log s_i,t <= 10

    GSPO's clip ranges are ~1e3 times PPO's (3e-4 / 4e-4 in the paper).
    """
    seq_log_ratio, seq = _per_sample(x, (x.logp - x.old_logp).detach())  # [S + 1], [N]
    log_s = x.logp - x.logp.detach() + seq_log_ratio[seq]  # [N]
    ratio = torch.exp(log_s.clamp(max=10.0))  # [N]
    pg1 = -x.advantages * ratio  # [N]
    pg2 = -x.advantages * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)  # [N]
    pg = torch.maximum(pg1, pg2)  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=pg2 > pg1)


@_register("cispo", ClipSettings.of)
def cispo(x: LossInputs, s: ClipSettings) -> PolicyLoss:
    """CISPO: the clipped ratio is a detached weight on the plain policy gradient, so no
    token loses its gradient (a clipped PPO token gets none)::

    pg_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A logp_t
    """
    ratio = _ratio(x)  # [N]
    clipped_ratio = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)  # [N]
    pg = -clipped_ratio.detach() * x.advantages * x.logp  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=ratio != clipped_ratio)


@_register("sapo", lambda algo: algo.sapo)
def sapo(x: LossInputs, s: SapoConfig) -> PolicyLoss:
    """SAPO: a soft gate instead of a hard clip; its slope at r = 1 is 1, as PPO's::

    tau_t = tau_pos if A > 0 else tau_neg
    pg_t  = -A sigmoid(tau_t (r_t - 1)) 4 / tau_t
    """
    ratio = _ratio(x)  # [N]
    tau = torch.where(x.advantages > 0, s.tau_pos, s.tau_neg).to(ratio.dtype)  # [N]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # [N]
    pg = -gate * x.advantages  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=torch.zeros_like(x.mask))


@_register("geo_mean", ClipSettings.of)
def geo_mean(x: LossInputs, s: ClipSettings) -> PolicyLoss:
    """GMPO: the geometric mean of the token ratios, each clipped in log space::

    l_t  = sgn(A) min(sgn(A) (logp_t - old_t), sgn(A) clip(logp_t - old_t, -clip_low, clip_high))
    L_i  = -mean_t(A) exp(mean_t l_t) * exp(mean_t log w_t)      (means over i's loss tokens)
    pg_t = L_i for every token t of sample i

    ``seq-mean-token-mean`` makes it the paper's mean over samples; the IS weights enter
    as their geometric mean over the sample.
    """
    log_ratio = x.logp - x.old_logp  # [N]
    sign = torch.sign(x.advantages)  # [N]
    clamped = log_ratio.clamp(-s.clip_low, s.clip_high)  # [N]
    log_min = sign * torch.min(sign * log_ratio, sign * clamped)  # [N]
    seq_log_ratio, seq = _per_sample(x, log_min)  # [S + 1], [N]
    seq_adv, _ = _per_sample(x, x.advantages)  # [S + 1]
    seq_ratio = torch.exp(seq_log_ratio)  # [S + 1]
    seq_pg = -seq_adv * seq_ratio  # [S + 1]
    if x.is_weights is not None:
        seq_log_w, _ = _per_sample(x, torch.log(x.is_weights + 1e-10))  # [S + 1]
        seq_pg = seq_pg * torch.exp(seq_log_w)
    clipped = (log_ratio != clamped) & (x.advantages != 0)  # [N]
    return PolicyLoss(pg=seq_pg[seq], ratio=seq_ratio.detach()[seq], clipped=clipped)


def _dppo(x: LossInputs, s: DppoSettings, valid: torch.Tensor) -> PolicyLoss:
    """The DPPO loss given the tokens the divergence keeps (``valid`` [N] bool)."""
    ratio = _ratio(x)  # [N]
    truncated = ratio.clamp(max=s.ratio_cap).detach()  # [N]
    pg = -x.advantages * truncated * x.logp * valid.to(x.logp.dtype)  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=~valid)


@_register("dppo_tv", DppoSettings.of)
def dppo_tv(x: LossInputs, s: DppoSettings) -> PolicyLoss:
    """DPPO-Binary-TV: a token trains while its probability moved less than the threshold
    in the direction its advantage pushes (p = exp(logp), p_old = exp(old))::

    keep_t = p - p_old <= clip_high  if A > 0,   p - p_old >= -clip_low  otherwise
    pg_t   = -A sg[min(r_t, ratio_cap)] logp_t keep_t
    """
    with torch.no_grad():
        moved = torch.exp(x.logp) - torch.exp(x.old_logp)  # [N]
        valid = torch.where(x.advantages > 0, moved <= s.high, moved >= -s.low)  # [N]
    return _dppo(x, s, valid)


@_register("dppo_kl", DppoSettings.of)
def dppo_kl(x: LossInputs, s: DppoSettings) -> PolicyLoss:
    """DPPO-Binary-KL: as dppo_tv, the divergence the binary KL of (p_old, p)::

    kl_t   = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    keep_t = kl_t <= clip_high or p <= p_old  if A > 0,   kl_t <= clip_low or p >= p_old  otherwise
    """
    with torch.no_grad():
        p, p_old = torch.exp(x.logp), torch.exp(x.old_logp)  # [N]
        kl = p_old * (x.old_logp - x.logp) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
        )  # [N]
        valid = torch.where(
            x.advantages > 0, (kl <= s.high) | (p <= p_old), (kl <= s.low) | (p >= p_old)
        )
    return _dppo(x, s, valid)


def _centred_cov(x: LossInputs) -> torch.Tensor:
    """(A - mean A)(logp - mean logp) per token, the means over the row's loss tokens [N]."""
    n = x.mask.sum().clamp(min=1)
    adv, logp = x.advantages.detach(), x.logp.detach()  # [N]
    zero = torch.zeros_like(adv)  # [N]
    mean_adv = torch.where(x.mask, adv, zero).sum() / n
    mean_logp = torch.where(x.mask, logp, zero).sum() / n
    return (adv - mean_adv) * (logp - mean_logp)  # [N]


@_register("clip_cov", ClipCovSettings.of)
def clip_cov(x: LossInputs, s: ClipCovSettings) -> PolicyLoss:
    """Clip-Cov: the PPO clip, and the gradient of a few tokens whose covariance of
    advantage and logprob is high (the ones that collapse entropy) detached::

    candidates = loss tokens the clip left alone with cov_t in (low, high)
    detach ``max(1, floor(ratio * loss tokens))`` candidates drawn at random (torch's RNG)
    pg_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * (0 if detached else 1)
    """
    ratio = torch.exp(x.logp - x.old_logp)  # [N]
    pg1 = -x.advantages * ratio  # [N]
    pg2 = -x.advantages * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)  # [N]
    cov = _centred_cov(x)  # [N]
    candidate = x.mask & ~(pg2 > pg1) & (cov > s.cov_low) & (cov < s.cov_high)  # [N]
    idx = torch.nonzero(candidate).squeeze(1)  # [C], in row order
    if idx.numel() > 0:
        num = max(int(s.ratio * int(x.mask.sum())), 1)
        idx = idx[torch.randperm(idx.numel())[:num].to(idx.device)]
    detached = torch.zeros_like(x.mask).index_fill(0, idx, True)  # [N]
    pg = torch.maximum(pg1, pg2) * (~detached).to(pg1.dtype)  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=detached)


@_register("kl_cov", lambda algo: algo.kl_cov)
def kl_cov(x: LossInputs, s: KlCovConfig) -> PolicyLoss:
    """KL-Cov: the unclipped surrogate, plus a |log ratio| penalty on the tokens of the
    largest covariance of advantage and logprob::

    pg_t = -A r_t + coef |logp_t - old_t|   on the max(1, floor(ratio * loss tokens)) tokens
           -A r_t                           elsewhere
    """
    log_ratio = x.logp - x.old_logp  # [N]
    ratio = torch.exp(log_ratio)  # [N]
    pg1 = -x.advantages * ratio  # [N]
    penalised = torch.zeros_like(x.mask)  # [N]
    valid = torch.nonzero(x.mask).squeeze(1)  # [V], in row order
    if valid.numel() > 0:
        cov = _centred_cov(x)[valid]  # [V]
        k = max(1, int(valid.numel() * s.ratio))
        penalised[valid[torch.topk(cov, k).indices]] = True
    pg = torch.where(penalised, pg1 + s.coef * log_ratio.abs(), pg1)  # [N]
    return PolicyLoss(pg=x.weighted(pg), ratio=ratio.detach(), clipped=penalised)
