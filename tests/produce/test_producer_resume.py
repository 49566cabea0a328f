"""An async producer's checkpoint taken between two batches: what came back while the
trainer trained (groups, errors, a group that failed for good) is in the next step's result
after a resume exactly as without one, and no drawn group is lost or served twice."""

from __future__ import annotations

import math

from test_producer import FakeBackend, _Model, check_accounting, gids, make

from rltool.produce.producer import Producer

FAIL = {4: 2, 6: 1}  # draw 4 fails twice (FAILED), draw 6 once (retried)


def _first_step(backend: FakeBackend) -> Producer:
    """Step 1 served and trained; the look-ahead groups come back during training, in two
    collections (draw 4 fails in both: FAILED before the next batch)."""
    p = make(backend, "async", max_inflight_steps=1)
    p.produce(1)
    p.update_weights(_Model(), 1)
    p.generation_overlap(0.0, 1.0)
    p.generation_overlap(1.0, 2.0)
    return p


def _figures(result) -> dict[str, float]:
    return {k: v for k, v in result.metrics().items() if not k.endswith("time_s")}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


def test_a_resume_between_batches_keeps_what_came_back_meanwhile():
    straight = _first_step(FakeBackend(fail=FAIL))
    assert straight._carry.failed and straight._carry.errors  # the case under test
    state = straight.state_dict()
    expected = straight.produce(2)

    fresh = FakeBackend()  # a new process: the failures happened before the save
    fresh.version = 1
    resumed = make(fresh, "async", max_inflight_steps=1)
    resumed.load_state_dict(state)
    got = resumed.produce(2)

    assert gids(got.groups) == gids(expected.groups)
    assert gids(got.failed_groups) == gids(expected.failed_groups) == ["s2-g4-p4"]
    assert [str(e) for e in resumed.errors] == [str(e) for e in straight.errors]
    assert _same(_figures(got), _figures(expected)), (_figures(got), _figures(expected))
    assert got.metrics()["produce/errors"] == 3.0  # draw 4 twice, draw 6 once: all meanwhile
    check_accounting(resumed)


def test_a_checkpoint_without_the_carry_loads_with_nothing_carried():
    p = _first_step(FakeBackend())
    state = p.state_dict()
    del state["carry"]  # written before the carry was kept
    q = make(FakeBackend(), "async", max_inflight_steps=1)
    q.load_state_dict(state)
    assert not q._carry.generated and not q._carry.errors
    assert len(q.produce(2).groups) == 4
