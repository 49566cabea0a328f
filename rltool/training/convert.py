"""Step-level conversion (data-contract section 5): groups of RolloutStates in, TrainBatch out.

Shape legend: S = samples (candidates, then training samples), T_s = len(input_ids)
of sample s, L_s = T_s - 1 its shifted length, F = sum of T_s (every field of
every sample concatenated once, unshifted), N = sum of L_s over the training
samples (all shifted positions, packed order), K = width of a per-position
extra, B = packs, C = clusters.

The steps, in order:

1. screen each group: every member COMPLETED (else skipped, reason = the group
   status lowercased), a reward wherever the task's ``task_adv_weight`` > 0
   (else a ValueError), every section-4 invariant (else skipped as "invalid",
   detail = the first violation from ``rltool.rollout.contract.check_group``);
2. bake token staleness into the labels, in place, when a limit is set (a group
   with an expired member is skipped as "expired");
3. session-clustered advantages over the whole batch, times the task weight;
4. the one shift and the packing into the row layout the updater trains on
   (``rltool.training.layout``: plain rows, or shared-prefix rows with
   ``prefix_sharing``);
5. ``data_info``.

A Python loop runs over groups and samples, never over tokens. The token-level
invariants are checked once on the concatenated arrays (``token_errors_S``, the
vectorised twin of ``check_sample``, kept equal to it by a property test);
``check_group`` runs only on the groups that fail, to name the violation.

Reading Python lists into arrays dominates the cost of plain-list samples (about
15 ns a number). Samples canonicalized by an agent loop carry ``CachedList``s
(``rltool.rollout.cached_list``): their fields are copied from the arrays the
loop built them from, and their prefix invariant holds by construction; a list
mutated since (the staleness bake) has lost its array and is read like any other.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rltool.config.schema import RecipeConfig
from rltool.packing import padding_waste
from rltool.rollout.staleness import StalenessLimits, bake_staleness, token_staleness
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status, group_status
from rltool.training.advantages import cluster_mean_scores, get_estimator
from rltool.training.batch import SHARED_ROW_ATTENTION, SampleInfo, SkippedGroup, TrainBatch
from rltool.training.flat import (
    Flat,
    flatten,
    identity_ok,
    invalid_skip,
    segments,
    shape_ok,
    token_errors_S,
)
from rltool.training.layout import pack_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConversionConfig:
    estimator: str = "grpo"  # a name in rltool.training.advantages.ESTIMATORS
    pack_max_length: int = 2048  # tokens per packed row
    prefix_sharing: bool = False  # shared-prefix rows (training/layout); recipes default to on
    task_adv_weight: dict[str, float] = field(default_factory=dict)  # task -> weight, default 1
    max_staleness: int | None = None  # None = samples never expire by age
    max_token_staleness: int | None = None  # None = tokens never cleared by age
    sync_interval: int = 1  # train steps between weight syncs

    def __post_init__(self) -> None:
        get_estimator(self.estimator)  # raises with the known names
        if self.pack_max_length < 1:
            raise ValueError(f"trainer.pack_max_length must be >= 1, got {self.pack_max_length}")
        self.staleness  # noqa: B018 - raises on a bad sync_interval or limit
        for task, w in self.task_adv_weight.items():
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(
                    f"algorithm.task_adv_weight.{task} must be finite and >= 0, got {w}"
                )

    @classmethod
    def from_recipe(cls, recipe: RecipeConfig) -> ConversionConfig:
        a = recipe.algorithm
        return cls(
            estimator=a.estimator,
            pack_max_length=recipe.trainer.pack_max_length,
            prefix_sharing=recipe.trainer.prefix_sharing
            and recipe.model.attn_implementation in SHARED_ROW_ATTENTION,
            task_adv_weight={k: float(v) for k, v in a.task_adv_weight.items()},
            max_staleness=a.max_staleness,
            max_token_staleness=a.max_token_staleness,
            sync_interval=a.sync_interval,
        )

    def task_weight(self, task_name: str) -> float:
        return float(self.task_adv_weight.get(task_name, 1.0))

    @property
    def staleness(self) -> StalenessLimits:
        return StalenessLimits(self.max_staleness, self.max_token_staleness, self.sync_interval)

    @property
    def bakes_staleness(self) -> bool:
        return self.staleness.bakes


# ---------------------------------------------------------------- status and rewards


def _status_skip(group: Sequence[RolloutState]) -> SkippedGroup | None:
    status = group_status(s.status for s in group)
    if status == Status.COMPLETED:
        return None
    culprit = next(s for s in group if s.status == status)
    detail = f"{culprit.rollout_id}: {status.value}"
    if culprit.error:
        detail += f" ({culprit.error})"
    return SkippedGroup(group[0].group_id, status.value.lower(), detail)


def _require_rewards(group: Sequence[RolloutState], cfg: ConversionConfig) -> None:
    """Contract 5.1: a missing reward is an error wherever the task's weight is > 0."""
    for s in group:
        w = cfg.task_weight(s.task_name)
        if w > 0 and s.score is None:
            raise ValueError(
                f"sample {s.rollout_id} (task {s.task_name!r}, group {s.group_id}) is COMPLETED "
                f"without reward['score'], but task_adv_weight[{s.task_name!r}] = {w} > 0 "
                "needs one. Fix the reward function, or set "
                f"algorithm.task_adv_weight.{s.task_name}: 0 to train it without advantage."
            )


# ---------------------------------------------------------------- staleness


@dataclass(slots=True)
class _StalenessTally:
    cleared: int = 0
    expired: int = 0


def _bake_group(
    group: Sequence[RolloutState],
    first: int,
    flat: Flat,
    train_step: int,
    cfg: ConversionConfig,
    tally: _StalenessTally,
) -> SkippedGroup | None:
    """Bake every member (so the counts are whole), copy cleared labels into ``flat``;
    skip the group if any member expired."""
    expired: list[tuple[RolloutState, str]] = []
    for i, s in enumerate(group, start=first):
        r = bake_staleness(s, train_step, cfg.staleness)
        tally.cleared += r.cleared
        if r.cleared:
            span = slice(int(flat.start_S[i]), int(flat.start_S[i] + flat.T_S[i]))
            flat.labels_F[span] = s.labels
            if s.logprobs is not None:
                flat.logprobs_F[span] = s.logprobs
        if r.expired:
            expired.append((s, f"{r.reason} (oldest token staleness {r.max_staleness})"))
    tally.expired += len(expired)
    if not expired:
        return None
    s, why = expired[0]
    return SkippedGroup(group[0].group_id, "expired", f"{s.rollout_id}: {why}")


# ---------------------------------------------------------------- screening


@dataclass(frozen=True, slots=True)
class _Screened:
    flat: Flat  # every sample of the kept groups (and of groups found invalid or expired)
    kept: list[Sequence[RolloutState]]  # groups that train
    kept_S: np.ndarray  # [S_kept] their samples' indices into flat
    skipped: list[SkippedGroup]
    tally: _StalenessTally


def _screen(
    groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig, train_step: int
) -> _Screened:
    skipped: dict[int, SkippedGroup] = {}  # by group index, so the log keeps the step's order
    shaped: list[int] = []  # COMPLETED, lengths and rewards right
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {g} of the step is empty; every group needs its samples")
        skip = _status_skip(group)
        if skip is None:
            _require_rewards(group, cfg)
            needs_reward = cfg.task_weight(group[0].task_name) > 0
            if not (identity_ok(group) and all(shape_ok(s, needs_reward) for s in group)):
                skip = invalid_skip(group, needs_reward)
        if skip is None:
            shaped.append(g)
        else:
            skipped[g] = skip

    samples = [s for g in shaped for s in groups[g]]
    flat = flatten(samples)
    token_bad_S = token_errors_S(samples, flat)  # [S]
    tally = _StalenessTally()
    kept, kept_S, first = [], [], 0
    for g in shaped:
        group = groups[g]
        members = np.arange(first, first + len(group))
        skip = None
        if token_bad_S[members].any():
            skip = invalid_skip(group, cfg.task_weight(group[0].task_name) > 0)
        elif cfg.bakes_staleness:
            skip = _bake_group(group, first, flat, train_step, cfg, tally)
        if skip is None:
            kept.append(group)
            kept_S.append(members)
        else:
            skipped[g] = skip
        first += len(group)
    if tally.cleared:
        flat.count_supervised()
    in_order = [skipped[g] for g in sorted(skipped)]
    for skip in in_order:
        log.warning("skipping group %s: %s (%s)", skip.group_id, skip.reason, skip.detail)
    kept_idx = np.concatenate(kept_S) if kept_S else np.zeros(0, dtype=np.int64)
    return _Screened(flat, kept, kept_idx, in_order, tally)


# ---------------------------------------------------------------- advantages


@dataclass(frozen=True, slots=True)
class _Advantages:
    sample_S: np.ndarray  # [S] float64, cluster advantage times task weight
    rewards_C: np.ndarray  # [C] float64, NaN where no member has a score


def _clusters(groups: Sequence[Sequence[RolloutState]]) -> tuple[np.ndarray, np.ndarray]:
    """``cluster_rewards`` of every group in one pass: clusters keyed by (group,
    session_id or rollout_id), in order of first appearance.

    Returns rewards_C [C] (mean member score, NaN when no member has one) and
    cluster_S [S], the cluster of each sample.
    """
    index: dict[tuple[int, str], int] = {}
    cluster = [
        index.setdefault((g, s.session_id or s.rollout_id), len(index))
        for g, group in enumerate(groups)
        for s in group
    ]
    cluster_S = np.array(cluster, dtype=np.int64)  # [S]
    scores = [s.score for group in groups for s in group]
    return cluster_mean_scores(cluster_S, scores, len(index)), cluster_S


def _advantages(groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig) -> _Advantages:
    """One estimator call over every cluster of every group with weight > 0."""
    rewards_C, cluster_S = _clusters(groups)
    n_S = np.array([len(g) for g in groups], dtype=np.int64)  # [G]
    group_S = np.repeat(np.arange(len(groups)), n_S)  # [S]
    group_C = np.zeros(rewards_C.size, dtype=np.int64)  # [C]
    group_C[cluster_S] = group_S
    weight_G = np.array([cfg.task_weight(g[0].task_name) for g in groups], dtype=np.float64)
    weight_C = weight_G[group_C]  # [C]
    active_C = weight_C > 0  # weight 0: no reward needed, advantage 0
    adv_C = np.zeros_like(rewards_C)  # [C]
    estimate = get_estimator(cfg.estimator)
    adv_C[active_C] = estimate(rewards_C[active_C], group_C[active_C]) * weight_C[active_C]
    return _Advantages(adv_C[cluster_S], rewards_C)


# ---------------------------------------------------------------- data_info


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/min": float(values.min()),
        f"{prefix}/max": float(values.max()),
    }


def _supervised_staleness(flat: Flat, train_step: int) -> np.ndarray:
    """Staleness of every supervised response token of the samples that carry model steps."""
    w = flat.steps_start_S >= 0  # [S]
    R_W = (flat.T_S - flat.P_S)[w]  # [W]
    label_pos = segments((flat.start_S + flat.P_S)[w], R_W)  # [sum R_W] flat response positions
    step_pos = segments(flat.steps_start_S[w], R_W)  # [sum R_W]
    supervised = flat.labels_F[label_pos] != IGNORE_INDEX
    return token_staleness(train_step, flat.steps[step_pos[supervised]])


def _data_info(
    n_groups: int,
    scr: _Screened,
    samples: Sequence[RolloutState],
    flat: Flat,
    adv_S: np.ndarray,
    rewards_C: np.ndarray,
    n_packs: int,
    train_step: int,
    cfg: ConversionConfig,
) -> dict[str, float]:
    """Per-sample counts only: a sample's loss-active tokens all carry its advantage."""
    response_len_S = flat.supervised_targets()  # [S]
    n_tokens = int((flat.T_S - 1).sum())
    n_active = int(response_len_S.sum())
    trains_S = response_len_S > 0  # [S]
    adv_stats = _stats("data/advantages", adv_S[trains_S])
    if n_active:
        adv_stats["data/advantages/mean"] = float(adv_S @ response_len_S / n_active)
    staleness = _supervised_staleness(flat, train_step)
    tool_turns_S = np.array([float((s.extra or {}).get("tool_turns", 0)) for s in samples])
    info: dict[str, float] = {
        "data/groups": float(n_groups),
        "data/skipped_groups": float(len(scr.skipped)),
    }
    for reason, n in sorted(Counter(g.reason for g in scr.skipped).items()):
        info[f"data/skipped/{reason}"] = float(n)
    info |= {
        "data/training_samples": float(len(samples)),
        "data/training_tokens": float(n_tokens),
        "data/supervised_tokens": float(n_active),
        "data/packs": float(n_packs),
        "data/padding_waste": padding_waste(n_tokens, n_packs, cfg.pack_max_length),
    }
    info |= _stats("data/rewards", rewards_C[np.isfinite(rewards_C)])
    info |= adv_stats
    info |= _stats("data/prompt_len", flat.P_S.astype(np.float64))
    info |= _stats("data/response_len", response_len_S.astype(np.float64))
    info["data/tool_turns/mean"] = float(tool_turns_S.mean()) if samples else 0.0
    info["data/staleness/mean"] = float(staleness.mean()) if staleness.size else 0.0
    info["data/staleness/max"] = float(staleness.max()) if staleness.size else 0.0
    info["data/staleness/stale_tokens"] = float(scr.tally.cleared)
    info["data/staleness/expired_samples"] = float(scr.tally.expired)
    return info


# ---------------------------------------------------------------- entry point


def convert_groups(
    groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig, train_step: int = 0
) -> TrainBatch:
    """One step's groups -> packed, shifted TrainBatch with data_info.

    Bakes staleness into the members' labels in place when a limit is set.
    Raises ValueError for a missing reward with task weight > 0, for a sample
    longer than ``pack_max_length``, and for extras present on only some samples.
    """
    scr = _screen(groups, cfg, train_step)
    samples = [s for g in scr.kept for s in g]
    flat = scr.flat.take(scr.kept_S)
    adv = _advantages(scr.kept, cfg)
    packed = pack_samples(samples, flat, adv.sample_S, cfg.pack_max_length, cfg.prefix_sharing)
    infos = [
        SampleInfo(
            rollout_id=s.rollout_id,
            group_id=s.group_id,
            task_name=s.task_name,
            pack=pack,
            start=start,
            length=length,
            prefix_length=prefix,
            branch_start=branch,
            advantage=advantage,
            has_rollout_logprobs=s.logprobs is not None,
        )
        for s, pack, start, length, prefix, branch, advantage in zip(
            samples,
            packed.pack_S.tolist(),
            packed.start_S.tolist(),
            (flat.T_S - 1).tolist(),
            packed.prefix_S.tolist(),
            packed.branch_S.tolist(),
            adv.sample_S.tolist(),
            strict=True,
        )
    ]
    n_packs = packed.plain_rows
    info = _data_info(
        len(groups), scr, samples, flat, adv.sample_S, adv.rewards_C, n_packs, train_step, cfg
    )
    return TrainBatch(packs=packed.packs, samples=infos, skipped_groups=scr.skipped, data_info=info)
