"""The ``algorithm`` recipe section: the advantage estimator, the per-token policy loss
(``POLICY_LOSS_NAMES``) and each loss's own options (``sapo``, ``dppo``, ``clip_cov``,
``kl_cov``), the rollout correction between the engine's and the trainer's logprobs, the
KL and entropy terms, PPO epochs and staleness limits. ``config/schema.py`` holds the other
sections and imports ``AlgorithmConfig`` from here for ``RecipeConfig`` (most modules
still import it from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class RejectionConfig:
    """One criterion of ``algorithm.rollout_correction.reject`` (docs/losses.md)."""

    criterion: str = ""  # token_k1..k3 | seq_sum_k1..k3 | seq_mean_k1..k3 | seq_max_k1..k3
    # k1 criteria bound the ratio old/rollout: both; k2/k3 bound a divergence: upper only
    lower: float | None = None
    upper: float | None = None


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: between the engine's and the trainer's logprobs.

    ``algorithm.rollout_correction=seq_mis`` is short for ``{preset: seq_mis}``; a preset
    fills the keys left empty here. Resolved and checked in ``config/correction.py``."""

    SHORTHAND: ClassVar[str] = "preset"

    preset: str = ""  # "" | token_tis | seq_tis | seq_mis | geo_rs | k3_rs | icepop (verl's)
    weights: str = ""  # "" = the preset's (none without one) | none | token | sequence
    weight_upper: float | None = None  # truncation of the weights (null = the preset's, or 2)
    weight_lower: float | None = None  # IcePop: weights outside [lower, upper] become 0
    batch_normalize: bool = False  # weights divided by their mean over the step's batch
    # chained rejection: a token stays only if every criterion keeps it; [] = the preset's
    reject: list[RejectionConfig] = field(default_factory=list)
    # OPSM: drop samples with advantage < 0 whose mean KL(old || current) exceeds it
    opsm_delta: float | None = None


# algorithm.policy_loss: the names rltool/training/policy_losses.py registers (a test keeps
# the two equal); checked when the recipe loads (config/checks.py CHOICES)
POLICY_LOSS_NAMES = (
    "ppo", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
)  # fmt: skip


@dataclass
class SapoConfig:
    """``algorithm.sapo``: the soft gate's temperatures (SAPO; verl's tau_pos / tau_neg)."""

    tau_pos: float = 1.0  # tokens with advantage > 0
    tau_neg: float = 1.05  # tokens with advantage <= 0 (a sharper gate: fewer wrong pushes)


@dataclass
class DppoConfig:
    """``algorithm.dppo``: DPPO's truncated ratio (dppo_tv, dppo_kl); the divergence
    thresholds are ``algorithm.clip_low`` / ``clip_high``."""

    ratio_cap: float = 20.0  # the detached ratio is truncated here (large: little bias)


@dataclass
class ClipCovConfig:
    """``algorithm.clip_cov``: detach a random share of the tokens whose covariance of
    advantage and logprob lies in (low, high)."""

    ratio: float = 0.0002  # share of the row's loss tokens detached (at least one)
    low: float = 1.0
    high: float = 5.0


@dataclass
class KlCovConfig:
    """``algorithm.kl_cov``: a |log ratio| penalty on the tokens of largest covariance."""

    ratio: float = 0.0002  # share of the row's loss tokens penalised (at least one)
    coef: float = 0.1  # weight of |logp - old| on them (verl's ppo_kl_coef)


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
    task_adv_weight: dict[str, float] = field(default_factory=dict)  # task -> weight, default 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0  # None = off; must be > 1
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    # the per-token policy loss (POLICY_LOSS_NAMES; docs/losses.md); ppo, gspo, cispo, geo_mean,
    # dppo_*, clip_cov read clip_low / clip_high, ppo also dual_clip
    policy_loss: str = "ppo"
    sapo: SapoConfig = field(default_factory=SapoConfig)
    dppo: DppoConfig = field(default_factory=DppoConfig)
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KlCovConfig = field(default_factory=KlCovConfig)
    kl_coef: float = 0.0  # KL to a frozen reference as a loss; 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    entropy_coef: float = 0.0
    tis_cap: float | None = 2.0  # truncated IS between rollout and trainer logprobs; None = off
    # the general form (token_tis = tis_cap); when it sets weights or rejection, tis_cap is unused
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per train step
    # staleness (data-contract section 6); None = no limit
    max_staleness: int | None = None
    max_token_staleness: int | None = None
    sync_interval: int = 1
    # train with the rollout's MoE experts (routed_experts) instead of the router's top-k
    routing_replay: bool = False
