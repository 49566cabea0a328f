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
3. the one shift and the packing, both by index arithmetic on the concatenated
   fields: packed position j of sample s reads its model input at flat
   position ``start_s + j`` and its target, rollout logprob and extras at
   ``start_s + j + 1``, so no target ever crosses into the next sample;
4. ``data_info``.

Pure: the groups are read, never written. Staleness is baked by production before
the groups get here (contract section 6); conversion only reports it. A Python loop
runs over groups and samples, never over tokens: the contract check concatenates
every sample's fields once (``check_samples``) and conversion reads those arrays.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from rltool.config.schema import RecipeConfig
from rltool.packing import pack_lengths, padding_waste
from rltool.rollout.contract import check_samples, errors, group_violations
from rltool.rollout.fields import segments
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status, group_status
from rltool.training.advantages import cluster_mean_scores, get_estimator
from rltool.training.batch import Pack, SampleInfo, SkippedGroup, TrainBatch
from rltool.training.flat import Flat

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConversionConfig:
    estimator: str = "grpo"  # a name in rltool.training.advantages.ESTIMATORS
    pack_max_length: int = 2048  # tokens per packed row
    task_adv_weight: dict[str, float] = field(default_factory=dict)  # task -> weight, default 1

    def __post_init__(self) -> None:
        get_estimator(self.estimator)  # raises with the known names
        if self.pack_max_length < 1:
            raise ValueError(f"trainer.pack_max_length must be >= 1, got {self.pack_max_length}")
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
            task_adv_weight={k: float(v) for k, v in a.task_adv_weight.items()},
        )

    def task_weight(self, task_name: str) -> float:
        return float(self.task_adv_weight.get(task_name, 1.0))


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
    checked = check_samples(samples, require_reward=needs_reward)
    kept, kept_rows, first = [], [], 0
    for g in completed:
        group, members = groups[g], slice(first, first + len(groups[g]))
        bad = errors(group_violations(group, checked.violations[members]))
        if bad:
            skipped[g] = SkippedGroup(group[0].group_id, "invalid", str(bad[0]))
        else:
            kept.append(group)
            kept_rows.append(checked.row_S[members])
        first += len(group)
    in_order = [skipped[g] for g in sorted(skipped)]
    for skip in in_order:
        log.warning("skipping group %s: %s (%s)", skip.group_id, skip.reason, skip.detail)
    rows = np.concatenate(kept_rows) if kept_rows else np.zeros(0, dtype=np.int64)
    return _Screened(Flat.of(checked.fields, rows), kept, in_order)


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


# ---------------------------------------------------------------- shift and pack


def _extra_F(
    samples: Sequence[RolloutState], name: str, get: Callable[[RolloutState], Any], dtype: type
) -> np.ndarray | None:
    """A per-position extra of every sample concatenated, [F, K]; None when no sample has it."""
    values = [get(s) for s in samples]
    if all(v is None for v in values):
        return None
    for s, v in zip(samples, values, strict=True):
        if v is None:
            raise ValueError(
                f"sample {s.rollout_id}: {name} missing while other samples of the step carry it; "
                "every sample of a step must have it or none"
            )
        if v.shape[1] != values[0].shape[1]:  # [T, K]
            k = values[0].shape[1]
            raise ValueError(f"sample {s.rollout_id}: {name} has shape {v.shape}, need [T, {k}]")
    return np.concatenate(values).astype(dtype, copy=False)  # [F, K]


def _teacher_kind(samples: Sequence[RolloutState]) -> str | None:
    kinds = {s.teacher_targets.kind for s in samples if s.teacher_targets is not None}
    if len(kinds) > 1:
        raise ValueError(f"teacher_targets kinds {sorted(kinds)} mixed in one step; use one kind")
    return kinds.pop() if kinds else None


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each training sample goes in the packed stream."""

    rows: list[list[int]]  # [B] sample indices per pack, ascending
    order_S: np.ndarray  # [S] sample indices in packed order
    L_packed: np.ndarray  # [S] shifted lengths in packed order
    offset_packed: np.ndarray  # [S] start of each sample in the packed stream, packed order
    offset_S: np.ndarray  # [S] the same by sample index
    row_first: np.ndarray  # [B] first packed sample of each row
    row_packed: np.ndarray  # [S] row of each sample, packed order
    pack_bounds: np.ndarray  # [B + 1] pack starts in the packed stream


def _layout(flat: Flat, rollout_ids: Sequence[str], max_len: int) -> _Layout:
    L_S = flat.T_S - 1  # [S]
    rows = pack_lengths(L_S, max_len, ids=rollout_ids)
    order_S = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=L_S.size)  # [S]
    L_packed = L_S[order_S]  # [S]
    offset_packed = np.cumsum(L_packed) - L_packed  # [S]
    offset_S = np.empty_like(offset_packed)
    offset_S[order_S] = offset_packed
    n_rows = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # [B]
    row_first = np.cumsum(n_rows) - n_rows  # [B]
    row_packed = np.repeat(np.arange(n_rows.size), n_rows)  # [S]
    pack_bounds = np.append(offset_packed[row_first], L_S.sum())  # [B + 1]
    return _Layout(
        rows, order_S, L_packed, offset_packed, offset_S, row_first, row_packed, pack_bounds
    )


def check_pack_widths(pack: Pack, index: int = 0) -> None:
    """Every per-position field of a pack has the width of its input_ids (contract 5.4)."""
    n = len(pack)
    fields = {
        "targets": pack.targets,
        "advantages": pack.advantages,
        "rollout_logprobs": pack.rollout_logprobs,
        "position_ids": pack.position_ids,
        "routed_experts": pack.routed_experts,
        "teacher_token_ids": pack.teacher_token_ids,
        "teacher_logprobs": pack.teacher_logprobs,
    }
    for name, t in fields.items():
        if t is not None and t.shape[0] != n:
            raise ValueError(f"pack {index}: {name} has {t.shape[0]} positions, input_ids has {n}")
    if int(pack.cu_seq_lens[-1]) != n:
        raise ValueError(f"pack {index}: cu_seq_lens ends at {int(pack.cu_seq_lens[-1])}, not {n}")


def _shifted_streams(
    flat: Flat, lay: _Layout, adv_S: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, targets, rollout logprobs, advantages and position_ids of every training
    sample, shifted and in packed order: one slice copy per sample and field.  # [N] each"""
    n = int(lay.pack_bounds[-1])
    ids_N, targets_N = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    lp_N, adv_N = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    pos_N = np.empty(n, dtype=np.int64)
    ramp = np.arange(int(lay.L_packed.max(initial=0)), dtype=np.int64)
    ids_F, labels_F, lp_F = flat.input_ids_F, flat.labels_F, flat.logprobs_F  # [F]
    for o, a, length, adv in zip(
        lay.offset_packed.tolist(),
        flat.start_S[lay.order_S].tolist(),
        lay.L_packed.tolist(),
        adv_S[lay.order_S].tolist(),
        strict=True,
    ):
        e = o + length
        ids_N[o:e] = ids_F[a : a + length]  # model input: input_ids[:-1]
        targets_N[o:e] = labels_F[a + 1 : a + 1 + length]  # target: labels[1:]
        lp_N[o:e] = lp_F[a + 1 : a + 1 + length]  # logprobs[1:]
        adv_N[o:e] = adv
        pos_N[o:e] = ramp[:length]
    adv_N[targets_N == IGNORE_INDEX] = 0.0  # a true 0 (multiplying would leave -0.0)
    return ids_N, targets_N, lp_N, adv_N, pos_N


def _extra_targets(flat: Flat, lay: _Layout) -> np.ndarray:
    """Index, into the extras' own concatenation (training samples only, unshifted), of each
    packed position's target: position j of sample s reads ``start_s + j + 1``.  # [N]"""
    starts = np.cumsum(flat.T_S) - flat.T_S  # [S]
    return segments(starts[lay.order_S] + 1, lay.L_packed)  # [N]


def _packs(
    samples: Sequence[RolloutState], flat: Flat, lay: _Layout, adv_S: np.ndarray
) -> list[Pack]:
    ids_N, targets_N, lp_N, adv_N, pos_N = _shifted_streams(flat, lay, adv_S)

    def teacher(attr: str) -> Callable[[RolloutState], Any]:
        return lambda s: None if s.teacher_targets is None else getattr(s.teacher_targets, attr)

    routed = _extra_F(samples, "routed_experts", lambda s: s.routed_experts, np.int64)
    t_ids = _extra_F(samples, "teacher_targets.token_ids", teacher("token_ids"), np.int64)
    t_lps = _extra_F(samples, "teacher_targets.logprobs", teacher("logprobs"), np.float32)
    tgt_extra = None
    if routed is not None or t_ids is not None:
        tgt_extra = _extra_targets(flat, lay)
    per_position: dict[str, torch.Tensor | None] = {
        "input_ids": torch.from_numpy(ids_N),  # [N]
        "targets": torch.from_numpy(targets_N),  # [N]
        "advantages": torch.from_numpy(adv_N),  # [N]
        "rollout_logprobs": torch.from_numpy(lp_N),  # [N]
        "position_ids": torch.from_numpy(pos_N),  # [N]
        "routed_experts": None if routed is None else torch.from_numpy(routed[tgt_extra]),
        "teacher_token_ids": None if t_ids is None else torch.from_numpy(t_ids[tgt_extra]),
        "teacher_logprobs": None if t_lps is None else torch.from_numpy(t_lps[tgt_extra]),
    }  # extras: [N, K]
    kind = _teacher_kind(samples)
    row_tokens = np.diff(lay.pack_bounds).tolist()  # [B]
    # one split per field gives every pack its view of the packed stream
    split = {k: None if t is None else t.split(row_tokens) for k, t in per_position.items()}
    cu_views = _cu_seq_lens(lay)
    max_len_B = np.maximum.reduceat(lay.L_packed, lay.row_first).tolist() if lay.rows else []
    packs = []
    for b, row in enumerate(lay.rows):
        pack = Pack(
            **{k: None if views is None else views[b] for k, views in split.items()},
            cu_seq_lens=cu_views[b],
            max_seq_len=max_len_B[b],
            sample_index=row,
            teacher_kind=kind,
        )
        check_pack_widths(pack, b)
        packs.append(pack)
    return packs


def _cu_seq_lens(lay: _Layout) -> tuple[torch.Tensor, ...]:
    """Every pack's cu_seq_lens (its samples' starts, then its end, from 0) as views
    of one int32 array.  # B x [S_row + 1]"""
    n_B = np.diff(np.append(lay.row_first, lay.order_S.size))  # [B] samples per row
    cu = np.empty(lay.order_S.size + n_B.size, dtype=np.int32)  # [S + B]
    at_S = np.arange(lay.order_S.size) + lay.row_packed  # [S] slot of each sample's start
    cu[at_S] = lay.offset_packed - lay.pack_bounds[lay.row_packed]
    cu[lay.row_first + n_B + np.arange(n_B.size)] = np.diff(lay.pack_bounds)  # row ends
    return torch.from_numpy(cu).split((n_B + 1).tolist())


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
    staleness = flat.supervised_staleness(train_step)
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
    lay = _layout(flat, [s.rollout_id for s in samples], cfg.pack_max_length)
    packs = _packs(samples, flat, lay, adv.sample_S)
    pack_of_S = np.empty(len(samples), dtype=np.int64)  # [S]
    pack_of_S[lay.order_S] = lay.row_packed
    start_S = lay.offset_S - lay.pack_bounds[pack_of_S]  # [S] offset inside its pack
    infos = [
        SampleInfo(
            rollout_id=s.rollout_id,
            group_id=s.group_id,
            task_name=s.task_name,
            pack=pack,
            start=start,
            length=length,
            advantage=advantage,
            has_rollout_logprobs=s.logprobs is not None,
        )
        for s, pack, start, length, advantage in zip(
            samples,
            pack_of_S.tolist(),
            start_S.tolist(),
            (flat.T_S - 1).tolist(),
            adv.sample_S.tolist(),
            strict=True,
        )
    ]
    info = _data_info(
        len(groups), scr, samples, flat, adv.sample_S, adv.rewards_C, len(packs), train_step, cfg
    )
    return TrainBatch(packs=packs, samples=infos, skipped_groups=scr.skipped, data_info=info)
