"""Advantage estimators on small hand-worked reward vectors (data-contract 5.2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rltool.rollout.state import RolloutState
from rltool.training.advantages import (
    EPS,
    ESTIMATORS,
    dr_grpo,
    grpo,
    reinforce_pp,
    rloo,
    session_clusters,
)

# Three groups: g0 = clusters with rewards 3, 1, 2; g1 = two clusters, both 5; g2 = one cluster.
REWARDS = np.array([3.0, 1.0, 2.0, 5.0, 5.0, 7.0])
GROUPS = np.array([0, 0, 0, 1, 1, 2])


def test_grpo_hand_worked() -> None:
    # g0: mean 2, deviations 1, -1, 0, sample std sqrt((1 + 1 + 0) / 2) = 1
    # g1: deviations 0, std 0 -> 0 / (0 + eps) = 0; g2: lone cluster -> 0
    want = [1 / (1 + EPS), -1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(grpo(REWARDS, GROUPS), want, rtol=0, atol=1e-12)


def test_grpo_uses_sample_std() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) (population std: 0.5)
    adv = grpo(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, dtype=np.int64))
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    np.testing.assert_allclose(adv, [a, -a, -a, a], rtol=1e-12)
    assert a == pytest.approx(0.8660239, abs=1e-6)


def test_dr_grpo_hand_worked() -> None:
    np.testing.assert_allclose(dr_grpo(REWARDS, GROUPS), [1, -1, 0, 0, 0, 0], atol=1e-12)


def test_rloo_hand_worked() -> None:
    # g0: 3 - (1 + 2)/2 = 1.5, 1 - (3 + 2)/2 = -1.5, 2 - (3 + 1)/2 = 0; g1: 5 - 5 = 0; g2 lone: 0
    np.testing.assert_allclose(rloo(REWARDS, GROUPS), [1.5, -1.5, 0, 0, 0, 0], atol=1e-12)


def test_reinforce_pp_hand_worked() -> None:
    # r - group mean over the clusters of g0 and g1: 1, -1, 0, 0, 0 (g2 is lone: left out, stays 0)
    # batch mean 0, sample std sqrt((1 + 1) / 4) = sqrt(0.5)
    s = math.sqrt(0.5) + EPS
    np.testing.assert_allclose(
        reinforce_pp(REWARDS, GROUPS), [1 / s, -1 / s, 0, 0, 0, 0], rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_lone_clusters_get_zero_not_nan(name: str) -> None:
    adv = ESTIMATORS.get(name)(np.array([1.0, 0.3, 2.0]), np.array([0, 1, 2]))
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_group_order_does_not_matter(name: str) -> None:
    # groups interleaved in the batch give each cluster the same advantage as sorted ones
    est = ESTIMATORS.get(name)
    order = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_allclose(est(REWARDS[order], GROUPS[order]), est(REWARDS, GROUPS)[order])


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_empty_batch(name: str) -> None:
    assert ESTIMATORS.get(name)(np.zeros(0), np.zeros(0, dtype=np.int64)).shape == (0,)


def test_unknown_estimator_lists_known_names() -> None:
    with pytest.raises(
        ValueError,
        match=r"^algorithm\.estimator: unknown advantage estimator 'ppo'; "
        r"known: dr_grpo, grpo, reinforce_pp, rloo$",
    ):
        ESTIMATORS.get("ppo")


def test_non_finite_reward_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        grpo(np.array([1.0, math.nan]), np.array([0, 0]))


def _s(rid: str, session: str | None, score: float | None) -> RolloutState:
    reward = None if score is None else {"score": score}
    return RolloutState(
        rollout_id=rid, group_id="g", session_id=session, prompt_ids=[1], reward=reward
    )


def test_session_clusters_by_session_then_rollout_id() -> None:
    group = [_s("a", "s1", 1.0), _s("b", None, 0.0), _s("c", "s1", 0.0), _s("d", None, None)]
    other = [_s("e", "s1", 1.0)]  # the same session id in another group: its own cluster
    c = session_clusters([group, other])
    assert c.keys == [(0, "s1"), (0, "b"), (0, "d"), (1, "s1")]
    assert c.cluster_S.tolist() == [0, 1, 0, 2, 3]
    assert c.group_C.tolist() == [0, 0, 0, 1]
    # s1's members differ (1 and 0): the cluster reward is their mean; d has no score: NaN
    assert c.rewards_C[[0, 1, 3]].tolist() == [0.5, 0.0, 1.0]
    assert math.isnan(c.rewards_C[2])
