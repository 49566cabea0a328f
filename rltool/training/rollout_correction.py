"""Rollout correction: importance weights and rejection masks between the engine's logprobs
(``rollout``) and the trainer's (``old``), and the mismatch metrics of a step.

Shape legend: N = positions of one packed row, S = samples in it, T = eligible positions of
the whole step. A position is *eligible* when it is supervised and its sample carries engine
logprobs; every other position gets weight 1 and is never rejected (data-contract 6b).

Per eligible token t of a sample s, with ``lr_t = old_t - rollout_t`` (log of r = old/rollout)
clamped to [-20, 20] wherever it is exponentiated (verl's safety bound):

    token weights     w_t = exp(lr_t)
    sequence weights  w_t = exp(sum_{u in s} lr_u)             every token of s
    truncation (TIS)  w_t = min(w_t, upper)
    IcePop            w_t = w_t if lower <= w_t <= upper else 0
    batch normalise   w_t = w_t / mean(w)                       over the step's eligible tokens
                                                                (token) or samples (sequence)
    rejection         k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr per token; token_kX keeps
                      a token, seq_sum/seq_mean/seq_max_kX a whole sample, when the statistic
                      is <= upper (k2, k3) or in [log lower, log upper] (k1; seq_max_k1: every
                      token of the sample in those bounds). Criteria chain: all must keep.
    OPSM              drop sample s when its advantage < 0 and mean_t (old_t - logp_t) > delta

A rejected token leaves the loss but stays in every count the aggregation divides by.
``correct_row`` is the whole correction of one row (or one sample: ``cu_seq_lens = [0, N]``)
before batch normalisation; ``mismatch_metrics`` the step's figures, each under one name below.
Design: docs/losses.md#rollout-correction
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.config.correction import CorrectionSpec, Criterion
from rltool.training.losses import MAX_LOG_RATIO, sequence_ids

SAFETY_BOUND = MAX_LOG_RATIO  # verl's bound too: exp() beyond it overflows or means garbage

# --- metric names, each spelled once -----------------------------------------------------
TRAINING_PPL = "mismatch/training_ppl"  # mean over samples of exp(-mean old logprob)
ROLLOUT_PPL = "mismatch/rollout_ppl"  # the same from the engine's logprobs
LOG_PPL_RATIO = "mismatch/log_ppl_ratio"  # mean over samples of log(training ppl / rollout ppl)
KL_K1 = "mismatch/kl_k1"  # KL(rollout || old), k1: mean(rollout - old)
KL_K3 = "mismatch/kl_k3"  # KL(rollout || old), k3: mean(exp(lr) - 1 - lr)
CHI2_TOKEN = "mismatch/chi2_token"  # mean(r^2) - 1 over tokens
CHI2_SEQ = "mismatch/chi2_seq"  # mean((prod r)^2) - 1 over samples
EXP_ABS_DIFF = "mismatch/exp_abs_diff_mean"  # mean(exp|lr|): ~1.0 healthy, > 1.05 worth a look
ABS_DIFF_P50 = "mismatch/abs_diff_p50"  # |lr| quantiles and max over tokens
ABS_DIFF_P99 = "mismatch/abs_diff_p99"
ABS_DIFF_MAX = "mismatch/abs_diff_max"
WEIGHT_MEAN = "mismatch/is_weight_mean"  # applied weights (before batch normalisation)
WEIGHT_MIN = "mismatch/is_weight_min"
WEIGHT_MAX = "mismatch/is_weight_max"
WEIGHT_ESS = "mismatch/is_ess"  # effective sample size, (sum w)^2 / (T sum w^2), in (0, 1]
BATCH_NORM_FACTOR = "mismatch/is_batch_norm_factor"  # the mean the weights were divided by
CAPPED_FRAC = "mismatch/is_capped_frac"  # tokens whose raw weight is above upper
CAPPED_SEQ_FRAC = "mismatch/is_capped_seq_frac"  # samples with such a token
ZEROED_FRAC = "mismatch/is_zeroed_frac"  # tokens IcePop set to 0 (raw weight out of bounds)
ZEROED_SEQ_FRAC = "mismatch/is_zeroed_seq_frac"
REJECTED_FRAC = "mismatch/rejected_frac"  # tokens some criterion rejects
REJECTED_SEQ_FRAC = "mismatch/rejected_seq_frac"  # samples with a rejected token
OPSM_FRAC = "mismatch/opsm_frac"  # tokens OPSM dropped (averaged over the step's updates)
OPSM_SEQ_FRAC = "mismatch/opsm_seq_frac"
TOKENS = "mismatch/tokens"  # eligible tokens of the step
SAMPLES_WITHOUT_LOGPROBS = "mismatch/samples_without_logprobs"  # weight 1, never rejected


def rejected_frac_key(criterion: str) -> str:
    """Tokens one criterion rejects (``mismatch/rejected_frac/seq_mean_k1``)."""
    return f"{REJECTED_FRAC}/{criterion}"


def rejected_seq_frac_key(criterion: str) -> str:
    return f"{REJECTED_SEQ_FRAC}/{criterion}"


@dataclass(slots=True)
class RowCorrection:
    """The correction of one packed row, before batch normalisation. Detached."""

    old: torch.Tensor  # [N] trainer logprobs
    rollout: torch.Tensor  # [N] engine logprobs (0 where none)
    eligible: torch.Tensor  # [N] bool, supervised and its sample has engine logprobs
    seq: torch.Tensor  # [N] long, sample of each position (S past the last sample)
    num_samples: int  # S
    no_logprobs: int  # samples with a supervised token but no engine logprobs
    log_ratio: torch.Tensor  # [N] old - rollout where eligible, else 0
    raw_weight: torch.Tensor  # [N] exp(clamped log ratio), token or sequence; 1 elsewhere
    weight: torch.Tensor  # [N] truncated / IcePop weight; 1 where not eligible
    rejected: dict[str, torch.Tensor]  # criterion -> [N] bool, True where it drops the token
    keep: torch.Tensor  # [N] bool, False where some criterion rejects

    def cpu(self) -> RowCorrection:
        moved = {k: v.cpu() for k, v in self.rejected.items()}
        return RowCorrection(
            **{
                f: (getattr(self, f).cpu() if isinstance(getattr(self, f), torch.Tensor)
                    else getattr(self, f))
                for f in self.__slots__ if f != "rejected"
            },
            rejected=moved,
        )  # fmt: skip


def _seq_sum(x: torch.Tensor, seq: torch.Tensor, num_samples: int) -> torch.Tensor:
    return x.new_zeros(num_samples + 1).index_add(0, seq, x)[:num_samples]  # [S]


def _seq_max(x: torch.Tensor, eligible: torch.Tensor, seq: torch.Tensor, s: int) -> torch.Tensor:
    """Max of x over each sample's eligible tokens; 0 for a sample without one (as verl)."""
    neg = torch.full((s + 1,), -torch.inf, dtype=x.dtype, device=x.device)
    masked = torch.where(eligible, x, torch.full_like(x, -torch.inf))  # [N]
    out = neg.scatter_reduce(0, seq, masked, reduce="amax")[:s]  # [S]
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)


def _criterion_keep(
    c: Criterion, lr: torch.Tensor, eligible: torch.Tensor, seq: torch.Tensor, s: int
) -> torch.Tensor:
    """[N] bool: the positions criterion ``c`` keeps (a sample-level one keeps whole samples)."""
    k = int(c.name[-1])
    stat_N = {1: -lr, 2: 0.5 * lr.square(), 3: torch.exp(lr) - 1.0 - lr}[k]  # [N]
    stat_N = torch.where(eligible, stat_N, torch.zeros_like(stat_N))
    lo = torch.log(torch.tensor(c.lower, dtype=lr.dtype)) if c.two_sided else None  # type: ignore[arg-type]
    hi = torch.log(torch.tensor(c.upper, dtype=lr.dtype)) if c.two_sided else c.upper

    def inside(x: torch.Tensor) -> torch.Tensor:
        return (x <= hi) & (x >= lo) if lo is not None else x <= hi

    if not c.sequence_level:
        return inside(stat_N)
    if c.name.startswith("seq_max") and lo is not None:  # every token inside the ratio bounds
        out_S = _seq_sum((~inside(stat_N) & eligible).to(lr.dtype), seq, s) > 0  # [S]
        keep_S = ~out_S
    elif c.name.startswith("seq_max"):
        keep_S = inside(_seq_max(stat_N, eligible, seq, s))  # [S]
    else:
        total = _seq_sum(stat_N, seq, s)  # [S]
        if c.name.startswith("seq_mean"):
            count = _seq_sum(eligible.to(lr.dtype), seq, s)  # [S]
            total = total / (count + 1e-8)  # verl's masked mean
        keep_S = inside(total)
    keep_S = torch.cat([keep_S, keep_S.new_ones(1)])  # [S + 1], padding kept
    return keep_S[seq]  # [N]


def correct_row(
    old: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    has_rollout: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    spec: CorrectionSpec,
) -> RowCorrection:
    """Weights and rejection of one row: all [N] (``mask``: supervised; ``has_rollout``: the
    sample carries engine logprobs; ``cu_seq_lens`` [S + 1]). Pure, no gradient."""
    old, rollout = old.detach().float(), rollout.detach().float()
    n, s = int(old.shape[0]), int(cu_seq_lens.shape[0]) - 1
    seq = sequence_ids(cu_seq_lens.to(old.device), n)  # [N]
    eligible = mask & has_rollout  # [N]
    lr = torch.where(eligible, old - rollout, torch.zeros_like(old))  # [N]
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [N]
    ones = torch.ones_like(lr)
    if spec.weights == "sequence":
        lr_S = _seq_sum(lr, seq, s).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [S]
        raw = torch.exp(torch.cat([lr_S, lr_S.new_zeros(1)]))[seq]  # [N]
    else:
        raw = torch.exp(lr_safe)  # [N]
    raw = torch.where(eligible, raw, ones)
    if spec.weights is None:
        weight = ones
    elif spec.lower is None:
        weight = torch.where(eligible, raw.clamp(max=spec.upper), ones)  # TIS
    else:
        inside = (raw >= spec.lower) & (raw <= spec.upper)  # IcePop
        weight = torch.where(eligible, torch.where(inside, raw, torch.zeros_like(raw)), ones)
    rejected = {}
    keep = torch.ones_like(eligible)
    for c in spec.reject:
        kept = _criterion_keep(c, lr_safe, eligible, seq, s)  # [N]
        rejected[c.name] = ~kept & eligible
        keep = keep & ~rejected[c.name]
    supervised_S = _seq_sum(mask.to(lr.dtype), seq, s) > 0  # [S]
    without_S = _seq_sum((mask & ~has_rollout).to(lr.dtype), seq, s) > 0  # [S]
    return RowCorrection(
        old=old, rollout=rollout, eligible=eligible, seq=seq, num_samples=s,
        no_logprobs=int((supervised_S & without_S).sum()), log_ratio=lr, raw_weight=raw,
        weight=weight, rejected=rejected, keep=keep,
    )  # fmt: skip


def batch_norm_factor(rows: list[RowCorrection], level: str | None) -> float:
    """Mean weight over the step's eligible tokens (token level) or samples (sequence); the
    weights are divided by it. 1.0 when there is nothing to average or the mean is ~0."""
    if level is None:
        return 1.0
    total, count = 0.0, 0.0
    for r in rows:
        if level == "token":
            total += float(r.weight[r.eligible].sum())
            count += float(r.eligible.sum())
        else:
            w_S, n_S = _per_sample_mean(r.weight, r)
            total += float(w_S[n_S > 0].sum())
            count += float((n_S > 0).sum())
    mean = total / count if count else 0.0
    return mean if mean > 1e-8 else 1.0


def _per_sample_mean(x: torch.Tensor, r: RowCorrection) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean of x over each sample's eligible tokens [S], eligible count [S])."""
    count = _seq_sum(r.eligible.to(x.dtype), r.seq, r.num_samples)  # [S]
    total = _seq_sum(torch.where(r.eligible, x, torch.zeros_like(x)), r.seq, r.num_samples)
    return total / count.clamp(min=1), count


def opsm_keep(
    old: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    eligible: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """[N] bool, False on the tokens of samples OPSM drops: advantage < 0 and the mean over
    the sample's eligible tokens of ``old - logp`` (k1 KL(old || current)) above ``delta``."""
    n, s = int(old.shape[0]), int(cu_seq_lens.shape[0]) - 1
    seq = sequence_ids(cu_seq_lens.to(old.device), n)  # [N]
    e = eligible.to(old.dtype)
    count = _seq_sum(e, seq, s).clamp(min=1)  # [S]
    kl_S = _seq_sum((old - logp.detach()) * e, seq, s) / count  # [S]
    adv_S = _seq_sum(advantages * e, seq, s)  # [S], the sign of the sample's advantage
    drop_S = (adv_S < 0) & (kl_S > delta)  # [S]
    drop_S = torch.cat([drop_S, drop_S.new_zeros(1)])  # [S + 1]
    return ~(drop_S[seq] & eligible)  # [N]


def mismatch_metrics(
    rows: list[RowCorrection], spec: CorrectionSpec, norm_factor: float = 1.0
) -> dict[str, float]:
    """The step's ``mismatch/*`` figures over every row's eligible tokens (T) and the
    samples that have one; samples without engine logprobs are only counted."""
    out = {SAMPLES_WITHOUT_LOGPROBS: float(sum(r.no_logprobs for r in rows))}
    e = [r.eligible for r in rows]
    lr = torch.cat([r.log_ratio[m] for r, m in zip(rows, e, strict=True)]).double()  # [T]
    out[TOKENS] = float(lr.numel())
    if lr.numel() == 0:
        return out
    per_sample = [_sample_stats(r) for r in rows]
    old_S, roll_S, lrsum_S = (torch.cat([p[i] for p in per_sample]).double() for i in range(3))
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out |= {
        TRAINING_PPL: float(torch.exp(-old_S).mean()),
        ROLLOUT_PPL: float(torch.exp(-roll_S).mean()),
        LOG_PPL_RATIO: float((roll_S - old_S).mean()),
        KL_K1: float((-lr).mean()),
        KL_K3: float((torch.exp(lr_safe) - 1.0 - lr_safe).mean()),
        CHI2_TOKEN: float(torch.exp(2.0 * lr_safe).mean() - 1.0),
        CHI2_SEQ: float(torch.exp(2.0 * lrsum_S.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0),
        EXP_ABS_DIFF: float(torch.exp(lr_safe.abs()).mean()),
        ABS_DIFF_P50: float(torch.quantile(lr.abs(), 0.5)),
        ABS_DIFF_P99: float(torch.quantile(lr.abs(), 0.99)),
        ABS_DIFF_MAX: float(lr.abs().max()),
    }
    if spec.weights is not None:
        out |= _weight_metrics(rows, spec, norm_factor)
    if spec.reject:
        out |= _fractions(rows, REJECTED_FRAC, REJECTED_SEQ_FRAC, lambda r: ~r.keep)
        for c in spec.reject:
            key, seq_key = rejected_frac_key(c.name), rejected_seq_frac_key(c.name)
            out |= _fractions(rows, key, seq_key, lambda r, n=c.name: r.rejected[n])
    return out


def _sample_stats(r: RowCorrection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean old and rollout logprob, and the log-ratio sum, of each sample with an eligible
    token ([S'] each)."""
    old_S, n_S = _per_sample_mean(r.old, r)
    roll_S, _ = _per_sample_mean(r.rollout, r)
    lrsum_S = _seq_sum(r.log_ratio, r.seq, r.num_samples)
    has = n_S > 0
    return old_S[has], roll_S[has], lrsum_S[has]


def _fractions(rows: list[RowCorrection], key: str, seq_key: str, flag) -> dict[str, float]:
    """Fraction of eligible tokens where ``flag(row)`` ([N] bool) is set, and of samples
    (with an eligible token) that have such a token."""
    tokens = hit = samples = hit_samples = 0.0
    for r in rows:
        f = flag(r) & r.eligible  # [N]
        tokens += float(r.eligible.sum())
        hit += float(f.sum())
        n_S = _seq_sum(r.eligible.double(), r.seq, r.num_samples)  # [S]
        f_S = _seq_sum(f.double(), r.seq, r.num_samples)  # [S]
        samples += float((n_S > 0).sum())
        hit_samples += float((f_S > 0).sum())
    return {key: hit / max(tokens, 1.0), seq_key: hit_samples / max(samples, 1.0)}


def _weight_metrics(
    rows: list[RowCorrection], spec: CorrectionSpec, norm_factor: float
) -> dict[str, float]:
    w = torch.cat([r.weight[r.eligible] for r in rows]).double()  # [T]
    mean = w.mean()
    ess = 1.0 / float(((w / mean) ** 2).mean()) if float(mean) > 0 else 0.0
    out = {
        WEIGHT_MEAN: float(mean),
        WEIGHT_MIN: float(w.min()),
        WEIGHT_MAX: float(w.max()),
        WEIGHT_ESS: ess,
    }
    out |= _fractions(rows, CAPPED_FRAC, CAPPED_SEQ_FRAC, lambda r: r.raw_weight > spec.upper)
    if spec.lower is not None:
        lower, upper = spec.lower, spec.upper
        out |= _fractions(
            rows,
            ZEROED_FRAC,
            ZEROED_SEQ_FRAC,
            lambda r: (r.raw_weight < lower) | (r.raw_weight > upper),
        )
    if spec.batch_normalize:
        out[BATCH_NORM_FACTOR] = norm_factor
    return out
