"""Replay buffer: staleness on put and take, expiry retry/drop, serving order, checkpoints.

Samples (produce_fakes): P = 2, response [30, 31, 32, 33], 31 tool output, so
labels = [X, X, 30, X, 32, 33]. staleness(token) = train_step - model_step - 1.
"""

from __future__ import annotations

import copy
import json

import pytest
from produce_fakes import X, generate, group, ids, sample

from rltool.config.schema import AlgorithmConfig, RecipeConfig
from rltool.produce.buffer import KEPT_ON_RESET, BufferConfig, ReplayBuffer, reset_to_prompt
from rltool.produce.result import Fate
from rltool.rollout.staleness import StalenessLimits, bake_staleness
from rltool.rollout.state import RolloutState, Status


def test_staleness_is_baked_once_when_taken() -> None:
    # max_token_staleness 1, sync_interval 1 -> a token is trainable while staleness < 2
    cfg = BufferConfig(staleness=StalenessLimits(max_token_staleness=1))
    g = group("g", steps=[0, 1, 2, 3])
    reference = copy.deepcopy(g)
    buf = ReplayBuffer(cfg)
    # put at step 3: staleness [2, 1, 0, -1]; read for expiry, nothing cleared
    assert buf.put(g, train_step=3) == Fate.BUFFERED
    assert g == reference  # not baked at put
    assert buf.counters.stale_tokens == 0
    # take at step 5: staleness [4, 3, 2, 1] -> tokens 30 and 32 cleared, in one bake
    (served,) = buf.take(1, train_step=5)
    assert served is g
    assert [s.labels.tolist() for s in served] == [[X, X, X, X, X, 33]] * 2
    assert [s.logprobs.tolist() for s in served] == [[0.0, 0.0, 0.0, 0.0, 0.0, -0.3]] * 2
    for s in reference:
        bake_staleness(s, 5, cfg.staleness)
    assert served == reference  # token fields compared by value
    assert buf.counters.stale_tokens == 4  # 2 per sample, at take


def test_thresholds_through_the_buffer() -> None:
    # max_token_staleness 0, max_staleness 1, sync_interval 2:
    # a token is trainable while staleness < 2; a sample expires at oldest staleness >= 4
    cfg = BufferConfig(
        staleness=StalenessLimits(max_staleness=1, max_token_staleness=0, sync_interval=2)
    )
    buf = ReplayBuffer(cfg)
    old = group("old", steps=[0, 2, 3, 3])  # step 4: staleness [3, 1, 0, 0]
    fresh = group("fresh", steps=[1, 1, 2, 3])  # step 4: staleness [2, 2, 1, 0]
    assert buf.put(old, 4) == Fate.BUFFERED  # oldest 3 < 4
    assert buf.put(fresh, 4) == Fate.BUFFERED
    assert old[0].labels.tolist() == fresh[0].labels.tolist() == [X, X, 30, X, 32, 33]
    # step 5: old is [4, 2, 1, 1] -> expires; fresh is [3, 3, 2, 1] -> 32 cleared, served
    served = buf.take(2, 5)
    assert served == [fresh]
    assert fresh[0].labels.tolist() == [X, X, X, X, X, 33]
    assert buf.sizes() == {"completed": 0, "aborted": 0, "expired": 1}
    assert buf.counters.retried == 1 and buf.counters.taken == 1
    assert buf.counters.expired_samples == 2  # the whole group of 2, expired on take


def test_expired_at_put() -> None:
    buf = ReplayBuffer(BufferConfig(staleness=StalenessLimits(max_staleness=1, sync_interval=2)))
    assert buf.put(group("g", steps=[0, 0, 0, 0]), 5) == Fate.RETRY  # oldest 4 >= 4
    assert buf.sizes()["expired"] == 1
    assert buf.counters.expired_samples == 2


def test_no_supervised_token_left_expires() -> None:
    buf = ReplayBuffer(
        BufferConfig(expired="drop", staleness=StalenessLimits(max_token_staleness=0))
    )  # trainable while < 1
    assert buf.put(group("g", steps=[0, 0, 0, 0]), 2) == Fate.DROPPED  # staleness 1 everywhere


def test_expired_retry_resets_the_whole_group() -> None:
    buf = ReplayBuffer(
        BufferConfig(staleness=StalenessLimits(max_staleness=0))
    )  # expires at oldest staleness >= 1
    g = [sample("g/0", "g", steps=[0, 0, 0, 0]), sample("g/1", "g", steps=[1, 1, 1, 1])]
    assert buf.put(g, 2) == Fate.RETRY  # member 0 is stale (1), member 1 is not (0)
    (again,) = buf.take_expired()
    assert again is g
    for s in again:  # both members reset, not only the stale one
        assert s.status == Status.INIT
        assert s.prompt_ids.tolist() == [1, 2] and s.messages == [{"role": "user", "content": "q"}]
        assert s.extra == {"ground_truth": "4"} and s.task_name == "t"
        assert (s.response_ids, s.input_ids, s.labels, s.logprobs, s.reward, s.error) == (None,) * 6
    assert [s.rollout_id for s in again] == ["g/0", "g/1"]  # regenerated under the same ids
    for s in again:
        generate(s, steps=[2, 2, 2, 2])
    assert buf.put(again, 2) == Fate.BUFFERED
    assert buf.counters.retried == 1 and buf.sizes()["expired"] == 0


def test_expired_drop_counts_and_forgets() -> None:
    buf = ReplayBuffer(BufferConfig(expired="drop", staleness=StalenessLimits(max_staleness=0)))
    g = group("g", steps=[0, 0, 0, 0])
    assert buf.put(group("keep", steps=[2, 2, 2, 2]), 2) == Fate.BUFFERED
    assert buf.put(g, 2) == Fate.DROPPED
    assert all(s.status == Status.EXPIRED for s in g)
    assert "max_staleness (oldest token staleness 1)" in (g[0].error or "")
    assert buf.sizes() == {"completed": 1, "aborted": 0, "expired": 0}
    assert buf.counters.dropped == 1
    # expiry at take time follows the same rule: at step 4 "keep" is 1 stale too
    assert buf.take(1, 4) == []
    assert buf.counters.dropped == 2


def test_reset_covers_every_field() -> None:
    cleared = set(RolloutState.model_fields) - KEPT_ON_RESET
    assert {"response_ids", "labels", "reward", "teacher_targets", "status", "error"} <= cleared
    s = reset_to_prompt(sample("r", "g", steps=[0, 0, 0, 0]))
    dumped = json.loads(s.to_json())
    assert set(dumped) == {*KEPT_ON_RESET - {"session_id", "agent_loop"}, "status"}
    assert dumped["status"] == "INIT"


def _groups_by_step() -> list[list[RolloutState]]:
    return [
        group("A", steps=[2, 2, 3, 3]),
        group("B", steps=[0, 1, 1, 1]),
        group("C", steps=[1, 1, 2, 2]),
        group("D", steps=None),  # no model steps: never stale, served last by stalest
    ]


@pytest.mark.parametrize(
    ("order", "first", "then"),
    [("fifo", ["A", "B"], ["C", "D"]), ("stalest", ["B", "C"], ["A", "D"])],
)
def test_serving_order(order: str, first: list[str], then: list[str]) -> None:
    buf = ReplayBuffer(BufferConfig(order=order))
    for g in _groups_by_step():
        buf.put(g, 4)
    assert [g[0].group_id for g in buf.take(2, 4)] == first
    assert [g[0].group_id for g in buf.take(9, 4)] == then  # the rest kept FIFO order


def test_stalest_ties_are_served_fifo() -> None:
    buf = ReplayBuffer(BufferConfig(order="stalest"))
    for gid, oldest in (("p", 1), ("q", 0), ("r", 1), ("s", 0)):
        buf.put(group(gid, steps=[oldest, 2, 2, 2]), 3)
    assert [g[0].group_id for g in buf.take(4, 3)] == ["q", "s", "p", "r"]


def test_statuses_on_put() -> None:
    buf = ReplayBuffer()
    failed = group("f")
    failed[1].fail("canonicalize_train_fields: 3 response logprobs for 4 response tokens")
    assert buf.put(failed, 0) == Fate.FAILED
    filtered = group("z")
    for s in filtered:
        s.status = Status.FILTERED
    assert buf.put(filtered, 0) == Fate.FILTERED
    aborted = group("a", steps=[0, 0, 0, 0])
    aborted[0].status = Status.ABORTED
    assert buf.put(aborted, 0) == Fate.BUFFERED
    assert buf.sizes() == {"completed": 0, "aborted": 1, "expired": 0}
    assert (buf.counters.failed, buf.counters.filtered, buf.counters.put) == (1, 1, 3)
    assert buf.take(1, 0) == []  # aborted groups are not served for training
    assert buf.take_aborted() == [aborted]
    with pytest.raises(ValueError, match="never generated"):
        buf.put([RolloutState(rollout_id="i", group_id="i", prompt_ids=[1])], 0)
    with pytest.raises(ValueError, match="empty group"):
        buf.put([], 0)


def test_aborted_groups_are_not_baked() -> None:
    buf = ReplayBuffer(
        BufferConfig(staleness=StalenessLimits(max_token_staleness=0, max_staleness=0))
    )
    g = group("a", steps=[0, 0, 0, 0])
    g[1].status = Status.ABORTED
    assert buf.put(g, 10) == Fate.BUFFERED
    assert g[0].labels.tolist() == [X, X, 30, X, 32, 33]


def test_no_limits_bakes_nothing() -> None:
    buf = ReplayBuffer()
    g = group("g", steps=[0, 0, 0, 0])
    buf.put(g, 100)
    assert buf.take(1, 200) == [g]
    assert g[0].labels.tolist() == [X, X, 30, X, 32, 33]


def test_state_dict_round_trip() -> None:
    cfg = BufferConfig(staleness=StalenessLimits(max_token_staleness=1))
    buf = ReplayBuffer(cfg)
    for g in _groups_by_step():
        buf.put(g, 3)  # staleness A [0, 0, -1, -1], B [2, 1, 1, 1] (30 cleared), C [1, 1, 0, 0]
    aborted = group("E", steps=[3, 3, 3, 3])
    aborted[0].status = Status.ABORTED
    buf.put(aborted, 3)
    retry = group("F", steps=[0, 0, 0, 0])
    buf.put(retry, 9)  # every token cleared -> no supervised token -> retry
    state = json.loads(json.dumps(buf.state_dict()))  # survives JSON, as in a checkpoint

    restored = ReplayBuffer(cfg)
    restored.load_state_dict(state)
    assert restored.sizes() == buf.sizes() == {"completed": 4, "aborted": 1, "expired": 1}
    assert restored.counters == buf.counters
    taken = buf.take(9, 4)  # at step 4 B's 32 and 33 clear too: B expires (retry)
    assert [g[0].group_id for g in taken] == ["A", "C", "D"]
    for a, b in (
        (taken, restored.take(9, 4)),
        (buf.take_aborted(), restored.take_aborted()),
        (buf.take_expired(), restored.take_expired()),
    ):
        assert [[s.to_json() for s in g] for g in a] == [[s.to_json() for s in g] for g in b]
        assert ids(a) == ids(b) and a  # nothing lost, nothing empty


def test_state_dict_version_is_checked() -> None:
    with pytest.raises(ValueError, match="state version"):
        ReplayBuffer().load_state_dict({"version": 99})


def test_metrics() -> None:
    buf = ReplayBuffer()
    buf.put(group("g"), 0)
    m = buf.metrics()
    assert m["buffer/completed"] == 1.0 and m["buffer/put_total"] == 1.0
    assert m["buffer/taken_total"] == 0.0


def test_config_from_recipe() -> None:
    recipe = RecipeConfig(algorithm=AlgorithmConfig(max_staleness=2, sync_interval=3))
    cfg = BufferConfig.from_recipe(recipe, order="stalest", expired="drop")
    assert cfg == BufferConfig("stalest", "drop", StalenessLimits(max_staleness=2, sync_interval=3))
    assert cfg.staleness.bakes and not BufferConfig().staleness.bakes
