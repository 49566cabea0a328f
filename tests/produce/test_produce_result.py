"""ProduceBatchResult figures and the accounting invariant: every sample taken from the
dataset is counted exactly once, whatever happens to it."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from produce_fakes import generate, group, ids, open_ids, queued_ids, sample

from rltool.produce.buffer import BufferConfig, ReplayBuffer
from rltool.produce.filters import apply_group_filter
from rltool.produce.result import (
    Accounting,
    Fate,
    ProduceBatchResult,
    failure_metrics,
    produced_totals,
    rollout_metrics,
    time_stats,
)
from rltool.rollout.staleness import StalenessLimits
from rltool.rollout.state import RolloutState, Status


def test_time_stats() -> None:
    # p50 of [1, 2, 3, 4] = 2.5; p99 = 1 + 0.99 * (4 - 1) = 3.97 (linear interpolation)
    mean, p50, p99 = time_stats([4.0, 1.0, 3.0, 2.0])
    assert (mean, p50) == (2.5, 2.5)
    assert p99 == pytest.approx(3.97, abs=1e-12)
    assert time_stats([]) == (0.0, 0.0, 0.0)


def test_reward_mean_is_over_completed_samples_before_filtering() -> None:
    kept = group("k", scores=(1.0, 0.0))
    zero_var = group("z", scores=(1.0, 1.0))
    failed = group("f", scores=(0.5, 0.25))
    failed[1].fail("reward: timeout")
    no_score = group("n", scores=(None, None))
    produced = [kept, zero_var, failed, no_score]
    # COMPLETED with a finite score: k 1 + 0, z 1 + 1, f/0 0.5 -> 3.5 over 5
    assert rollout_metrics(produced)["rollout/reward_mean"] == 3.5 / 5
    assert "rollout/failed" not in rollout_metrics(produced)  # one name: failures/samples
    assert failure_metrics([failed])["failures/samples"] == 1.0
    assert produced_totals(produced) == (8, 32)  # 8 samples x 4 response tokens
    survivors, _ = apply_group_filter([kept, zero_var], "zero_variance")
    # what a post-filter figure would see instead
    assert rollout_metrics(survivors)["rollout/reward_mean"] == 0.5
    assert math.isnan(rollout_metrics([no_score])["rollout/reward_mean"])


def test_reward_components_are_averaged_over_the_samples_that_report_them() -> None:
    g = group("c", scores=(1.0, 0.5, 0.0))
    g[0].reward["components"] = {"format": 0.75, "correct": 0.25}
    g[1].reward["components"] = {"format": 0.25, "correct": math.nan}  # not finite: left out
    g[2].fail("reward: timeout")  # FAILED: left out
    g[2].reward["components"] = {"format": 100.0}
    m = rollout_metrics([g])
    assert m["rollout/reward_components/format"] == 0.5  # (0.75 + 0.25) / 2
    assert m["rollout/reward_components/correct"] == 0.25
    assert not any(
        k.startswith("rollout/reward_components/") for k in rollout_metrics([group("d")])
    )


def test_metrics_keys_and_values() -> None:
    r = ProduceBatchResult(
        groups=[group("a"), group("b")],
        leftover_completed=3,
        leftover_failed=1,
        produced_samples=12,
        produced_tokens=48,
        produce_time_s=2.0,
        group_time_mean=0.5,
        group_time_p50=0.4,
        group_time_p99=0.9,
        extra_metrics={"buffer/completed": 3.0},
    )
    m = r.metrics()
    assert m["produce/groups"] == 2.0 and m["produce/samples"] == 4.0
    assert m["produce/leftover/completed"] == 3.0 and m["produce/leftover/failed"] == 1.0
    assert m["produce/leftover/init"] == 0.0 and m["produce/group_time/p99"] == 0.9
    assert m["buffer/completed"] == 3.0
    assert all(isinstance(v, float) for v in m.values())
    assert ProduceBatchResult(groups=[]).metrics()["produce/groups"] == 0.0


def test_failed_sample_skips_its_whole_group_with_consistent_counts() -> None:
    acct = Accounting()
    buf = ReplayBuffer(accounting=acct)
    good, bad = (
        group("good", scores=(1.0, 0.0, 1.0, 0.0)),
        group("bad", scores=(1.0, 0.0, 1.0, 0.0)),
    )
    bad[2].fail("canonicalize_train_fields: 3 response logprobs for 4 response tokens")
    acct.add(ids([good, bad]))
    fates = [buf.put(good, 0), buf.put(bad, 0)]
    assert fates == [Fate.BUFFERED, Fate.FAILED]
    batch = buf.take(2, 0)
    acct.move_groups(batch, Fate.TRAINED)
    result = ProduceBatchResult(groups=batch, leftover_failed=fates.count(Fate.FAILED))
    counts = acct.counts()
    assert (counts[Fate.TRAINED], counts[Fate.FAILED]) == (4, 4)  # the whole group, not 1
    assert result.metrics()["produce/leftover/failed"] == 1.0 == buf.counters.failed


def test_accounting_moves() -> None:
    acct = Accounting()
    a, b = sample("a", "g"), sample("b", "g")
    acct.add(["a", "b"])
    with pytest.raises(ValueError, match="taken from the dataset twice"):
        acct.add(["a"])
    acct.move([a, b], Fate.BUFFERED)
    acct.move([a], Fate.RETRY)
    with pytest.raises(ValueError, match="cannot move from retry to trained"):
        acct.move([a], Fate.TRAINED)
    acct.move([b], Fate.TAKEN)
    acct.move([b], Fate.TRAINED)
    assert "b" not in open_ids(acct, Fate.TAKEN)  # final: counted and forgotten
    with pytest.raises(ValueError, match="not open"):
        acct.move([b], Fate.TRAINED)  # a group trained twice
    with pytest.raises(ValueError, match="not open"):
        acct.move([sample("c", "g")], Fate.BUFFERED)  # never taken from the dataset
    assert acct.counts()[Fate.RETRY] == 1 and acct.counts()[Fate.TRAINED] == 1
    assert (acct.taken, acct.retries) == (2, 1)
    restored = Accounting()
    restored.load_state_dict(acct.state_dict())
    assert restored.counts() == acct.counts() and open_ids(restored, Fate.RETRY) == {"a"}
    assert restored.metrics()["produce/samples/trained"] == 1.0


# ---------------------------------------------------------------- the invariant, at random

GROUPS_PER_STEP = 2
GROUP_SIZE = 3
OUTCOMES = ("right", "wrong", "failed", "aborted")


def _generate(members: list[RolloutState], step: int, rng: random.Random) -> None:
    """Fill every member with a random outcome; model steps lag 0..3 behind ``step``.

    Half the groups are clean (right or wrong answers only), so that batches fill."""
    lag = rng.randint(0, 3)
    outcomes = OUTCOMES[:2] if rng.random() < 0.5 else OUTCOMES
    for s in members:
        outcome = rng.choice(outcomes)
        generate(s, steps=[max(step - lag, 0)] * 4, score=float(outcome == "right"))
        if outcome == "failed":
            s.fail("reward: could not parse")
        elif outcome == "aborted":
            s.status = Status.ABORTED


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    order=st.sampled_from(["fifo", "stalest"]),
    expired=st.sampled_from(["retry", "drop"]),
)
def test_every_sample_is_accounted_for_exactly_once(seed: int, order: str, expired: str) -> None:
    """A random producer run (generation outcomes and staleness from ``seed``)."""
    rng = random.Random(seed)
    acct = Accounting()
    cfg = BufferConfig(
        order=order,
        expired=expired,
        staleness=StalenessLimits(max_staleness=1, max_token_staleness=0),
    )
    buf = ReplayBuffer(cfg, accounting=acct)
    taken: list[str] = []  # ground truth, kept beside the accounting
    by_fate: dict[Fate, list[str]] = {f: [] for f in Fate}
    every_group: list[list[RolloutState]] = []
    next_group = 0
    for step in range(rng.randint(1, 6)):
        todo = buf.take_expired() + buf.take_aborted()  # back to PENDING: regenerate
        for _ in range(rng.randint(0, 3)):  # new prompts from the dataset
            g = [
                RolloutState(
                    rollout_id=f"p{next_group}/{i}", group_id=f"p{next_group}", prompt_ids=[1, 2]
                )
                for i in range(GROUP_SIZE)
            ]
            next_group += 1
            acct.add(s.rollout_id for s in g)
            taken += [s.rollout_id for s in g]
            todo.append(g)
            every_group.append(g)
        for g in todo:
            _generate(g, step, rng)
            if buf.put(g, step) == Fate.FAILED:
                by_fate[Fate.FAILED] += [s.rollout_id for s in g]
        train_step = step + rng.randint(0, 3)  # the trainer may run ahead
        served = buf.take(GROUPS_PER_STEP, train_step)
        assert all(s.status == Status.COMPLETED for g in served for s in g)
        kept, filtered = apply_group_filter(served, "zero_variance")
        acct.move_groups(filtered, Fate.FILTERED)
        acct.move_groups(kept, Fate.TRAINED)
        by_fate[Fate.FILTERED] += ids(filtered)
        by_fate[Fate.TRAINED] += ids(kept)

    counts = acct.counts()
    queued = queued_ids(buf)
    by_fate[Fate.BUFFERED] = [*queued["completed"], *queued["aborted"]]
    by_fate[Fate.RETRY] = list(queued["expired"])
    assert open_ids(acct, Fate.BUFFERED) == set(by_fate[Fate.BUFFERED])
    assert open_ids(acct, Fate.RETRY) == set(by_fate[Fate.RETRY])
    # dropped at put or at take: the buffer marked the stale members EXPIRED and forgot them
    by_fate[Fate.DROPPED] = ids(
        [g for g in every_group if any(s.status == Status.EXPIRED for s in g)]
    )
    every = [rid for f in Fate for rid in by_fate[f]]
    assert sorted(every) == sorted(taken)  # each sample in exactly one place
    assert {f: len(by_fate[f]) for f in Fate} == counts
    assert counts[Fate.PENDING] == counts[Fate.TAKEN] == 0  # nothing left in flight
    assert sum(counts.values()) == acct.taken == len(taken)
    if expired == "retry":
        assert counts[Fate.DROPPED] == 0
    assert buf.counters.dropped * GROUP_SIZE == counts[Fate.DROPPED]
    assert buf.counters.failed * GROUP_SIZE == counts[Fate.FAILED]
