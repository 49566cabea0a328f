"""The producer's strategies on a fake backend: batches, look-ahead, staleness, filter refills,
retries of failed and expired groups, and the accounting of every sample."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import pytest
from produce_fakes import open_ids, queued_ids, sample

from rltool.config.schema import AgentLoopConfig, RecipeConfig
from rltool.produce.backend import GroupOutcome, GroupRequest, RolloutBackend
from rltool.produce.producer import Producer
from rltool.produce.result import Fate
from rltool.produce.task_sampler import TaskSampler
from rltool.produce.task_specs import TaskSpec
from rltool.produce.worker import FINISHED_AT

SPEC = TaskSpec(name="t", weight=1.0, loop=AgentLoopConfig(), train_files=["x"], eval_files=[])
ROWS = [{"question": f"q{i}"} for i in range(50)]


class FakeBackend(RolloutBackend):
    """Generates on ``collect``; tokens carry the weight version of the moment of ``submit``
    (so work submitted ahead of a weight sync comes back stale, as in an async run).

    ``scores(k)``: the group's scores from its draw index k (``s<step>-g<k>-p<i>``).
    ``fail[k]``: how many times group k's generation fails before it succeeds.
    """

    def __init__(self, scores=lambda k: (1.0, 0.0), fail: Mapping[int, int] | None = None):
        self.version = 0
        self.queue: list[tuple[GroupRequest, int]] = []
        self.scores = scores
        self.fail = dict(fail or {})
        self.submitted: list[GroupRequest] = []
        self.generated_ids: set[str] = set()

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        self.submitted += requests
        self.queue += [(r, self.version) for r in requests]

    def collect(self, min_groups: int = 1, timeout: float | None = None) -> list[GroupOutcome]:
        # min_groups 0 = whatever is ready: here every group is ready at once
        n = (
            len(self.queue)
            if min_groups in (0, *range(len(self.queue), min_groups + 1))
            else min_groups
        )
        todo, self.queue = self.queue[:n], self.queue[n:]
        return [self._outcome(r, v) for r, v in todo]

    def _outcome(self, r: GroupRequest, version: int) -> GroupOutcome:
        k = int(re.match(r"s\d+-g(\d+)-", r.group_id).group(1))
        if self.fail.get(k, 0) > 0:
            self.fail[k] -= 1
            return GroupOutcome(r, None, error="worker died", metrics={FINISHED_AT: 0.0})
        scores = self.scores(k)
        group = [
            sample(f"{r.group_id}/{i}", r.group_id, [version] * 4, scores[i]) for i in range(r.n)
        ]
        self.generated_ids |= {s.rollout_id for s in group}
        return GroupOutcome(r, group, gen_time_s=0.5, metrics={"reward/errors": 1.0})

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    def update_weights(self, state_dict, model_step: int) -> None:
        self.version = model_step

    def evaluate(self, task_name, tasks, sampling):
        return {}


class _Model:
    def state_dict(self):
        return {}


def make(backend: FakeBackend, mode="sync", **produce) -> Producer:
    recipe = RecipeConfig()
    recipe.data.prompts_per_step, recipe.data.group_size = 4, 2
    recipe.produce.mode = mode
    for key, value in produce.items():
        section = (
            recipe.algorithm if key in ("max_staleness", "max_token_staleness") else recipe.produce
        )
        setattr(section, key, value)
    return Producer(recipe, backend, TaskSampler([SPEC], {"t": ROWS}, seed=0, shuffle=False))


def run(producer: Producer, steps: int, start: int = 1) -> list[list[list]]:
    batches = []
    for step in range(start, start + steps):
        batches.append(producer.produce(step).groups)
        producer.update_weights(_Model(), step)
        check_accounting(producer)
    return batches


def check_accounting(p: Producer) -> None:
    """Every sample ever generated has exactly one fate; open ones sit in the buffer or wait
    for regeneration."""
    counts = p.accounting.counts()  # asserts they sum to `taken`
    assert sum(counts.values()) == p.accounting.taken
    queued = queued_ids(p.buffer)
    buffered = open_ids(p.accounting, Fate.BUFFERED)
    assert buffered == queued["completed"] | queued["aborted"]
    assert open_ids(p.accounting, Fate.PENDING) == {i for ids in p._retry_ids.values() for i in ids}
    assert not open_ids(p.accounting, Fate.TAKEN)


def gids(batch) -> list[str]:
    return [g[0].group_id for g in batch]


def test_sync_serves_this_steps_groups_in_draw_order():
    backend = FakeBackend()
    p = make(backend)
    first = p.produce(1)
    assert gids(first.groups) == ["s1-g0-p0", "s1-g1-p1", "s1-g2-p2", "s1-g3-p3"]
    assert backend.in_flight == 0
    m = first.metrics()
    assert m["staleness/tokens_s0"] == 32 and m["staleness/tokens_s1"] == 0  # 4 x 2 x 4 tokens
    assert m["produce/produced_samples"] == 8 and m["rollout/reward_mean"] == 0.5
    assert m["reward/errors"] == 4.0  # the loop metrics of every outcome, summed
    assert m["produce/samples/trained"] == 8 and m["produce/samples/drawn"] == 8
    assert m["produce/samples/taken"] == 0  # served and trained: none left in TAKEN
    assert m["task/t/samples"] == 8
    p.update_weights(_Model(), 1)
    assert gids(p.produce(2).groups) == ["s2-g4-p4", "s2-g5-p5", "s2-g6-p6", "s2-g7-p7"]


def test_async_generates_the_next_step_ahead_and_counts_its_staleness():
    backend = FakeBackend()
    p = make(backend, "async", max_inflight_steps=1)
    assert gids(p.produce(1).groups) == ["s1-g0-p0", "s1-g1-p1", "s1-g2-p2", "s1-g3-p3"]
    assert backend.in_flight == 4  # step 2's groups: generating while step 1 trains
    p.update_weights(_Model(), 1)  # arrives after they were submitted with version 0
    second = p.produce(2)
    assert gids(second.groups)[0] == "s2-g4-p4"
    m = second.metrics()
    assert (m["staleness/tokens_s0"], m["staleness/tokens_s1"]) == (0, 32)
    assert m["staleness/mean"] == 1.0 and m["staleness/max"] == 1.0
    assert second.leftover_init == 4  # step 3 in flight


def test_two_steps_ahead():
    backend = FakeBackend()
    p = make(backend, "async", max_inflight_steps=2)
    p.produce(1)
    assert backend.in_flight == 8


def test_zero_variance_filter_refills_from_oversampled_groups():
    # every third group scores the same on both samples: filtered
    backend = FakeBackend(scores=lambda k: (1.0, 1.0) if k % 3 == 0 else (1.0, 0.0))
    p = make(backend, oversample=0.5, group_filter="zero_variance")
    first = p.produce(1)  # draws 6: g0 and g3 filtered, 4 survive
    assert gids(first.groups) == ["s1-g1-p1", "s1-g2-p2", "s1-g4-p4", "s1-g5-p5"]
    assert first.leftover_filtered == 2 and first.leftover_completed == 0
    results = [first]
    for step in range(2, 7):
        p.update_weights(_Model(), step - 1)
        results.append(p.produce(step))
        check_accounting(p)
    assert all(len(r.groups) == 4 for r in results)
    trained = [s.rollout_id for r in results for g in r.groups for s in g]
    assert len(trained) == len(set(trained)) == p.accounting.counts()[Fate.TRAINED]
    filtered_groups = sum(r.leftover_filtered for r in results)
    assert p.accounting.counts()[Fate.FILTERED] == 2 * filtered_groups


def test_filtered_and_leftover_groups_are_all_accounted():
    backend = FakeBackend(scores=lambda k: (1.0, 1.0) if k % 3 == 0 else (1.0, 0.0))
    p = make(backend, oversample=1.0, group_filter="zero_variance")
    batches = run(p, 4)
    counts = p.accounting.counts()
    n_trained = sum(len(g) for b in batches for g in b)
    assert counts[Fate.TRAINED] == n_trained == 4 * 4 * 2
    # 8 drawn per step, a third filtered, the surplus stays buffered for the next step
    assert counts[Fate.FILTERED] + counts[Fate.TRAINED] + counts[Fate.BUFFERED] == len(
        backend.generated_ids
    )
    assert counts[Fate.BUFFERED] == 2 * p.buffer.sizes()["completed"] > 0


def test_failed_generation_is_retried_once_then_counted_failed():
    backend = FakeBackend(fail={1: 1, 2: 2})  # g1 fails once, g2 twice
    p = make(backend)
    result = p.produce(1)
    assert len(p.errors) == 3 and "worker died" in p.errors[0].error
    fates = sorted((e.group_id, e.attempt, e.retried) for e in p.errors)
    assert fates == [("s1-g1-p1", 0, True), ("s1-g2-p2", 0, True), ("s1-g2-p2", 1, False)]
    assert result.leftover_failed == 1
    # g1 came back on its retry; g2 is FAILED; a refill drew g4 for the missing group
    assert gids(result.groups) == ["s1-g0-p0", "s1-g3-p3", "s1-g1-p1", "s1-g4-p4"]
    retried = [r for r in backend.submitted if r.attempt == 1]
    assert [r.group_id for r in retried] == ["s1-g1-p1", "s1-g2-p2"]
    counts = p.accounting.counts()
    assert counts[Fate.FAILED] == 2 and counts[Fate.TRAINED] == 8
    m = result.metrics()
    assert m["produce/errors"] == 3 and m["produce/refills"] == 1
    # the FAILED group travels with the batch; its error keeps the real cause first
    assert [g[0].group_id for g in result.failed_groups] == ["s1-g2-p2"]
    assert [s.rollout_id for s in result.failed_groups[0]] == ["s1-g2-p2/0", "s1-g2-p2/1"]
    assert result.failed_groups[0][0].error.startswith("worker died\n(generation of group")
    assert m["failures/samples"] == 2 and m["failures/worker died"] == 2
    check_accounting(p)


class SampleFailBackend(FakeBackend):
    """Group k's first sample comes back FAILED with ``errors[k]`` (a loop's recorded error)."""

    def __init__(self, errors: Mapping[int, str]):
        super().__init__()
        self.errors = dict(errors)

    def _outcome(self, r: GroupRequest, version: int) -> GroupOutcome:
        out = super()._outcome(r, version)
        k = int(re.match(r"s\d+-g(\d+)-", r.group_id).group(1))
        if k in self.errors:
            out.group[0].reward = None
            out.group[0].fail(self.errors[k])
        return out


def test_failed_samples_are_counted_by_reason_and_their_groups_handed_along():
    # g1 and g3: reward errors (one reason, different details); g2: an agent error
    backend = SampleFailBackend(
        {
            1: "reward: RuntimeError: judge offline",
            2: "agent: ValueError: bad",
            3: "reward: RuntimeError: judge still offline",
        }
    )
    result = make(backend).produce(1)
    assert [g[0].group_id for g in result.failed_groups] == ["s1-g1-p1", "s1-g2-p2", "s1-g3-p3"]
    assert gids(result.groups) == ["s1-g0-p0", "s1-g4-p4", "s1-g5-p5", "s1-g6-p6"]  # refilled
    m = result.metrics()
    assert m["failures/samples"] == 3  # one failed member in each of the 3 groups
    assert m["failures/reward: RuntimeError"] == 2 and m["failures/agent: ValueError"] == 1
    assert m["produce/leftover/failed"] == 3


def test_a_step_without_failures_reports_zero_failed_samples():
    m = make(FakeBackend()).produce(1).metrics()
    assert m["failures/samples"] == 0
    assert [k for k in m if k.startswith("failures/")] == ["failures/samples"]


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_expired_groups_are_regenerated_under_the_same_ids_or_dropped(policy):
    # two steps ahead with max_staleness 0: groups drawn at step 1 (version 0) have staleness
    # >= 1 from step 2 on and expire
    backend = FakeBackend()
    p = make(backend, "async", max_inflight_steps=2, max_staleness=0, expired=policy)
    batches = run(p, 3)
    assert all(len(b) == 4 for b in batches)
    counts = p.accounting.counts()
    if policy == "retry":
        assert gids(batches[1]) == ["s2-g4-p4", "s2-g5-p5", "s2-g6-p6", "s2-g7-p7"]
        again = [r for r in backend.submitted if r.attempt == 1]
        assert {r.group_id for r in again} >= {"s2-g4-p4", "s2-g8-p8"}
        assert counts[Fate.DROPPED] == 0 and p.accounting.retries > 0
        # regenerated with the version of their resubmission: trainable now
        assert all(s.response_model_steps.tolist() == [1] * 4 for g in batches[1] for s in g)
    else:
        assert counts[Fate.DROPPED] > 0 and p.accounting.retries == 0
        assert "s2-g4-p4" not in gids(batches[1])
    m = p.produce(4).metrics()
    assert m["produce/samples/drawn"] == p.accounting.taken


def test_expired_samples_count_expiry_on_arrival_and_when_served():
    """staleness/expired_samples and leftover/expired count every group that expired in the
    call, whether the buffer found it too stale on put or when it served it (take)."""
    # three steps ahead with max_staleness 1: groups buffered fresh for step 3 are too old when
    # step 3 takes them (worked out by running the fake backend: 16 samples expire on take)
    backend = FakeBackend()
    p = make(backend, "async", max_inflight_steps=3, max_staleness=1, expired="drop")
    total_samples = total_groups = 0
    for step in range(1, 5):
        m = p.produce(step).metrics()
        total_samples += m["staleness/expired_samples"]
        total_groups += m["produce/leftover/expired"]
        p.update_weights(_Model(), step)
    assert total_samples == p.buffer.counters.expired_samples == 16
    assert total_groups == p.buffer.counters.dropped


def test_accounting_holds_with_filter_errors_and_expiry_in_play():
    backend = FakeBackend(
        scores=lambda k: (0.0, 0.0) if k % 4 == 0 else (1.0, 0.0), fail={3: 1, 5: 2, 11: 2}
    )
    p = make(
        backend,
        "async",
        max_inflight_steps=2,
        oversample=0.25,
        group_filter="zero_variance",
        max_staleness=1,
        max_token_staleness=0,
    )
    batches = run(p, 8)
    trained = [s.rollout_id for b in batches for g in b for s in g]
    assert len(trained) == len(set(trained))  # never trained twice
    counts = p.accounting.counts()
    assert counts[Fate.TRAINED] == len(trained)
    assert counts[Fate.FAILED] == 4  # g5 and g11, two samples each
    # every sample ever generated is trained, filtered, failed, dropped, or still open
    assert p.accounting.taken == len(backend.generated_ids) + 4


def test_state_dict_resumes_with_every_buffered_and_in_flight_group():
    backend = FakeBackend(scores=lambda k: (1.0, 1.0) if k % 3 == 0 else (1.0, 0.0))
    p = make(backend, "async", oversample=1.0, group_filter="zero_variance")
    run(p, 2)
    buffered = queued_ids(p.buffer)["completed"]
    in_flight = {r.group_id for r, _ in backend.queue}
    assert buffered and in_flight
    state = p.state_dict()

    fresh = FakeBackend(scores=backend.scores)
    fresh.version = 2
    q = make(fresh, "async", oversample=1.0, group_filter="zero_variance")
    q.load_state_dict(state)
    assert queued_ids(q.buffer)["completed"] == buffered
    assert {r.group_id for r in fresh.submitted} == in_flight  # resubmitted, same ids
    assert q.accounting.counts() == p.accounting.counts()
    third = q.produce(3)
    served = {s.rollout_id for g in third.groups for s in g}
    assert served & buffered  # the buffered survivors are served first
    check_accounting(q)
    assert q.accounting.taken == p.accounting.taken + len(fresh.generated_ids)
