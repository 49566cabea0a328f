"""Advantage estimators over session clusters (data-contract section 5.2).

Shape legend: C = clusters in the whole batch (all groups together), G = groups,
M = members of one group. Design: docs/losses.md#advantage-estimators
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rltool.registry import Registry
from rltool.rollout.state import RolloutState

EPS = 1e-6  # as verl and TRL: std + eps, so a constant-reward group gives 0

# (rewards_C, group_index_C) -> advantages_C
Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]
ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "algorithm.estimator")


@dataclass(frozen=True, slots=True)
class _GroupStats:
    count_C: np.ndarray  # [C] clusters in this cluster's group
    dev_C: np.ndarray  # [C] reward - group mean
    std_C: np.ndarray  # [C] sample std (n-1) of the group; 0 for a lone cluster


def _group_stats(rewards_C: np.ndarray, group_index_C: np.ndarray) -> _GroupStats:
    r = np.asarray(rewards_C, dtype=np.float64)  # [C]
    g = np.asarray(group_index_C, dtype=np.int64)  # [C]
    if r.ndim != 1 or r.shape != g.shape:
        raise ValueError(f"rewards {r.shape} and group index {g.shape} must be 1-D of equal length")
    if r.size and (not np.all(np.isfinite(r)) or g.min() < 0):
        raise ValueError("cluster rewards must be finite and group indices >= 0")
    count_G = np.bincount(g)  # [G]
    mean_G = np.bincount(g, weights=r) / np.maximum(count_G, 1)  # [G]
    dev_C = r - mean_G[g]  # [C]
    var_G = np.bincount(g, weights=dev_C**2) / np.maximum(count_G - 1, 1)  # [G]
    return _GroupStats(count_G[g], dev_C, np.sqrt(var_G)[g])


@ESTIMATORS.register("grpo")
def grpo(rewards_C: np.ndarray, group_index_C: np.ndarray) -> np.ndarray:
    """(r - mean) / (std + eps), sample std (n-1) of the group."""
    s = _group_stats(rewards_C, group_index_C)
    return np.where(s.count_C > 1, s.dev_C / (s.std_C + EPS), 0.0)  # [C]


@ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards_C: np.ndarray, group_index_C: np.ndarray) -> np.ndarray:
    """r - mean (Dr. GRPO: no std normalisation)."""
    s = _group_stats(rewards_C, group_index_C)
    return np.where(s.count_C > 1, s.dev_C, 0.0)  # [C]


@ESTIMATORS.register("rloo")
def rloo(rewards_C: np.ndarray, group_index_C: np.ndarray) -> np.ndarray:
    """r - mean of the other clusters of the group, which is n/(n-1) * (r - mean)."""
    s = _group_stats(rewards_C, group_index_C)
    n = s.count_C.astype(np.float64)  # [C]
    return np.where(s.count_C > 1, s.dev_C * n / np.maximum(n - 1, 1), 0.0)  # [C]


@ESTIMATORS.register("reinforce_pp")
def reinforce_pp(rewards_C: np.ndarray, group_index_C: np.ndarray) -> np.ndarray:
    """r - group mean, then whitened over the batch: (x - mean) / (std + eps).

    The batch statistics use the clusters of groups with more than one cluster
    (sample std, n-1, as verl's ``masked_whiten``); lone clusters stay 0.
    """
    s = _group_stats(rewards_C, group_index_C)
    out = np.zeros_like(s.dev_C)  # [C]
    active = s.count_C > 1  # [C]
    x = s.dev_C[active]  # [C_active]
    if x.size >= 2:
        out[active] = (x - x.mean()) / (x.std(ddof=1) + EPS)
    return out


@dataclass(frozen=True, slots=True)
class SessionClusters:
    """Session clusters of a batch of groups (contract 5.2), in order of first appearance:
    keyed by (group index, ``session_id`` or else ``rollout_id``)."""

    keys: list[tuple[int, str]]  # [C]
    rewards_C: np.ndarray  # [C] float64, mean member score; NaN when no member has one
    cluster_S: np.ndarray  # [S] int64, the cluster of each sample, groups concatenated
    group_C: np.ndarray  # [C] int64, the group of each cluster


def session_clusters(groups: Sequence[Sequence[RolloutState]]) -> SessionClusters:
    """The clusters of every group in one pass; every member of a cluster gets its reward."""
    index: dict[tuple[int, str], int] = {}
    cluster = [
        index.setdefault((g, s.session_id or s.rollout_id), len(index))
        for g, group in enumerate(groups)
        for s in group
    ]
    cluster_S = np.array(cluster, dtype=np.int64)  # [S]
    scores = [s.score for group in groups for s in group]
    keys = list(index)
    group_C = np.array([g for g, _ in keys], dtype=np.int64)  # [C]
    rewards_C = cluster_mean_scores(cluster_S, scores, len(keys))  # [C]
    return SessionClusters(keys, rewards_C, cluster_S, group_C)


def cluster_mean_scores(
    cluster_S: np.ndarray, scores: Sequence[float | None], n_clusters: int
) -> np.ndarray:
    """[C] mean score of each cluster's scored members; NaN where no member has a score.
    ``cluster_S`` [S] is the cluster of each sample, ``scores`` [S] their scores."""
    has_S = np.array([x is not None for x in scores], dtype=np.float64)  # [S]
    scores_S = np.array([0.0 if x is None else float(x) for x in scores])  # [S]
    n_C = np.bincount(cluster_S, weights=has_S, minlength=n_clusters)  # [C]
    sum_C = np.bincount(cluster_S, weights=scores_S, minlength=n_clusters)  # [C]
    rewards_C = np.full(n_clusters, np.nan)  # [C] NaN: no member has a score
    np.divide(sum_C, n_C, out=rewards_C, where=n_C > 0)
    return rewards_C
