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
   detail = the group's first violation, as ``rltool.rollout.contract.check_group``
   names it);
2. session-clustered advantages over the whole batch, times the task weight;
3. the one shift and the packing into the row layout the updater trains on
   (``rltool.training.layout``: plain rows, or shared-prefix rows with
   ``prefix_sharing``);
4. ``data_info``.

Pure: the groups are read, never written. Staleness is baked by production before
the groups get here (contract section 6); conversion only reports it. A Python loop
runs over groups and samples, never over tokens: the contract check concatenates
every sample's fields once (``check_samples``) and conversion reads those arrays.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rltool import metric_names as mn
from rltool.config.schema import RecipeConfig
from rltool.packing import padding_waste
from rltool.rollout.contract import check_samples, errors, group_violations
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import RolloutState, Status, group_status
from rltool.training.advantages import ESTIMATORS, session_clusters
from rltool.training.attention import choose_kernels
from rltool.training.batch import Pack, SampleInfo, SkippedGroup, TrainBatch, forward_positions
from rltool.training.flat import Flat
from rltool.training.layout import pack_samples

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConversionConfig:
    estimator: str = "grpo"  # a name in rltool.training.advantages.ESTIMATORS
    pack_max_length: int = 2048  # tokens per packed row
    prefix_sharing: bool = False  # shared-prefix rows (training/layout); recipes default to on
    # the attention the rows train with (training/attention.py picks the kernels from these)
    attn_implementation: str = "sdpa"  # model.attn_implementation
    device: str = "cpu"  # cpu | cuda: where the policy trains
    task_adv_weight: dict[str, float] = field(default_factory=dict)  # task -> weight, default 1
    # the policy's embedding rows: a group with a token id at or past it is skipped as
    # invalid (contract invariant 10), never an IndexError in the trainer; None: unknown
    vocab_size: int | None = None

    @classmethod
    def from_recipe(cls, recipe: RecipeConfig, vocab_size: int | None = None) -> ConversionConfig:
        a = recipe.algorithm
        return cls(
            estimator=a.estimator,
            pack_max_length=recipe.trainer.pack_max_length,
            prefix_sharing=recipe.trainer.prefix_sharing,
            attn_implementation=recipe.model.attn_implementation,
            device=_train_device(recipe.model.device),
            task_adv_weight={k: float(v) for k, v in a.task_adv_weight.items()},
            vocab_size=vocab_size,
        )

    def task_weight(self, task_name: str) -> float:
        return float(self.task_adv_weight.get(task_name, 1.0))


def _train_device(device: str) -> str:
    """cuda or cpu for ``model.device`` (auto: cuda when this machine has it)."""
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "cuda" if cuda else "cpu"


# ---------------------------------------------------------------- status and rewards


def _status_skip(group: Sequence[RolloutState]) -> SkippedGroup | None:
    status = group_status(s.status for s in group)
    if status == Status.COMPLETED:
        return None
    culprit = next(s for s in group if s.status == status)
    detail = f"{culprit.rollout_id}: {status.value}"
    if culprit.error:
        detail += f" ({culprit.error})"
    kind = failure_reason(culprit.error) if culprit.error else status.value
    return SkippedGroup(group[0].group_id, status.value.lower(), detail, kind)


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


# ---------------------------------------------------------------- screening


@dataclass(frozen=True, slots=True)
class _Screened:
    flat: Flat  # the training samples' fields
    kept: list[Sequence[RolloutState]]  # groups that train
    skipped: list[SkippedGroup]


def _screen(groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig) -> _Screened:
    skipped: dict[int, SkippedGroup] = {}  # by group index, so the log keeps the step's order
    completed: list[int] = []
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {g} of the step is empty; every group needs its samples")
        skip = _status_skip(group)
        if skip is None:
            _require_rewards(group, cfg)
            completed.append(g)
        else:
            skipped[g] = skip

    samples = [s for g in completed for s in groups[g]]
    needs_reward = [
        cfg.task_weight(groups[g][0].task_name) > 0 for g in completed for _ in groups[g]
    ]
    checked = check_samples(samples, require_reward=needs_reward, vocab_size=cfg.vocab_size)
    kept, kept_rows, first = [], [], 0
    for g in completed:
        group, members = groups[g], slice(first, first + len(groups[g]))
        bad = errors(group_violations(group, checked.violations[members]))
        if bad:
            skipped[g] = SkippedGroup(group[0].group_id, "invalid", str(bad[0]), bad[0].reason)
        else:
            kept.append(group)
            kept_rows.append(checked.row_S[members])
        first += len(group)
    in_order = [skipped[g] for g in sorted(skipped)]
    _log_skipped(in_order)
    rows = np.concatenate(kept_rows) if kept_rows else np.zeros(0, dtype=np.int64)
    return _Screened(Flat.of(checked.fields, rows), kept, in_order)


def _log_skipped(skipped: Sequence[SkippedGroup]) -> None:
    """One warning per reason and kind, with its count and the first group's detail in
    full: a step of NaN logprobs is one line, not one per group."""
    by_kind: dict[tuple[str, str], list[SkippedGroup]] = {}
    for skip in skipped:
        by_kind.setdefault((skip.reason, skip.kind), []).append(skip)
    for (reason, kind), skips in by_kind.items():
        first = skips[0]
        log.warning(
            "skipping %d group%s: %s, %s (first: group %s: %s)", len(skips),
            "" if len(skips) == 1 else "s", reason, kind, first.group_id, first.detail,
        )  # fmt: skip


# ---------------------------------------------------------------- advantages


@dataclass(frozen=True, slots=True)
class _Advantages:
    sample_S: np.ndarray  # [S] float64, cluster advantage times task weight
    rewards_C: np.ndarray  # [C] float64, NaN where no member has a score


def _advantages(groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig) -> _Advantages:
    """One estimator call over every cluster of every group with weight > 0."""
    clusters = session_clusters(groups)
    rewards_C, cluster_S, group_C = clusters.rewards_C, clusters.cluster_S, clusters.group_C
    weight_G = np.array([cfg.task_weight(g[0].task_name) for g in groups], dtype=np.float64)
    weight_C = weight_G[group_C]  # [C]
    active_C = weight_C > 0  # weight 0: no reward needed, advantage 0
    adv_C = np.zeros_like(rewards_C)  # [C]
    estimate = ESTIMATORS.get(cfg.estimator)
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


def _data_info(
    n_groups: int,
    scr: _Screened,
    samples: Sequence[RolloutState],
    flat: Flat,
    adv_S: np.ndarray,
    rewards_C: np.ndarray,
    packs: Sequence[Pack],
    train_step: int,
    cfg: ConversionConfig,
) -> dict[str, float]:
    """Per-sample counts only: a sample's loss-active tokens all carry its advantage."""
    response_len_S = flat.supervised_targets()  # [S]
    n_tokens = int((flat.T_S - 1).sum())
    row_tokens = sum(len(p) for p in packs)
    n_active = int(response_len_S.sum())
    trains_S = response_len_S > 0  # [S]
    adv_stats = _stats("data/advantages", adv_S[trains_S])
    if n_active:
        adv_stats["data/advantages/mean"] = float(adv_S @ response_len_S / n_active)
    staleness = flat.supervised_staleness(train_step)
    tool_turns_S = np.array([float((s.extra or {}).get("tool_turns", 0)) for s in samples])
    info: dict[str, float] = {
        "data/groups": float(n_groups),
        mn.DATA_SKIPPED_GROUPS: float(len(scr.skipped)),
    }
    for reason, n in sorted(Counter(g.reason for g in scr.skipped).items()):
        info[f"data/skipped/{reason}"] = float(n)
    info |= {
        mn.DATA_TRAINING_SAMPLES: float(len(samples)),
        "data/training_tokens": float(n_tokens),
        mn.DATA_SUPERVISED_TOKENS: float(n_active),
        # the rows the updater trains on (shared prefixes: fewer tokens than above)
        "data/packs": float(len(packs)),
        # what the model computes of those rows (sdpa-tree: branches merged where alike)
        "data/forward_positions": float(sum(forward_positions(p) for p in packs)),
        "data/padding_waste": padding_waste(row_tokens, len(packs), cfg.pack_max_length),
    }
    info |= _stats("data/rewards", rewards_C[np.isfinite(rewards_C)])
    info |= adv_stats
    info |= _stats("data/prompt_len", flat.P_S.astype(np.float64))
    info |= _stats(mn.DATA_RESPONSE_LEN, response_len_S.astype(np.float64))
    info["data/tool_turns/mean"] = float(tool_turns_S.mean()) if samples else 0.0
    info["data/staleness/mean"] = float(staleness.mean()) if staleness.size else 0.0
    info["data/staleness/max"] = float(staleness.max()) if staleness.size else 0.0
    return info


# ---------------------------------------------------------------- entry point


def convert_groups(
    groups: Sequence[Sequence[RolloutState]], cfg: ConversionConfig, train_step: int = 0
) -> TrainBatch:
    """One step's groups -> packed, shifted TrainBatch with data_info; the groups are
    only read. ``train_step`` dates the staleness figures.

    Raises ValueError for a missing reward with task weight > 0, for a sample
    longer than ``pack_max_length``, and for extras present on only some samples.
    """
    scr = _screen(groups, cfg)
    samples = [s for g in scr.kept for s in g]
    flat = scr.flat
    adv = _advantages(scr.kept, cfg)
    kernels = choose_kernels(cfg.attn_implementation, cfg.device)
    packed = pack_samples(
        samples, flat, adv.sample_S, cfg.pack_max_length, cfg.prefix_sharing, kernels
    )
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
    info = _data_info(
        len(groups), scr, samples, flat, adv.sample_S, adv.rewards_C, packed.packs, train_step, cfg
    )
    return TrainBatch(packs=packed.packs, samples=infos, skipped_groups=scr.skipped, data_info=info)
