"""Group filters, the batch refill from over-sampled groups, and the over-sampling count."""

from __future__ import annotations

import pytest
from produce_fakes import group

from rltool.produce.filters import GROUP_FILTERS, apply_group_filter, oversample
from rltool.rollout.state import Status


def test_zero_variance_judges_scores() -> None:
    keep = GROUP_FILTERS.get("zero_variance")
    assert keep(group("g", scores=(1.0, 0.0, 1.0)))
    assert not keep(group("g", scores=(1.0, 1.0, 1.0)))
    assert not keep(group("g", scores=(0.0, 0.0)))
    assert not keep(group("g", scores=(0.5,)))  # one member: advantage 0 anyway
    assert keep(group("g", scores=(1.0, None)))  # nothing to judge: kept
    assert keep(group("g", scores=(float("nan"), float("nan"))))
    assert GROUP_FILTERS.get("none")(group("g", scores=(1.0, 1.0)))


def test_filtered_members_are_marked() -> None:
    varied, flat = group("v", scores=(1.0, 0.0)), group("f", scores=(0.0, 0.0))
    kept, filtered = apply_group_filter([varied, flat], "zero_variance")
    assert kept == [varied] and filtered == [flat]
    assert [s.status for s in flat] == [Status.FILTERED] * 2
    assert flat[0].error == "filtered by zero_variance"
    assert [s.status for s in varied] == [Status.COMPLETED] * 2


def names(groups: list) -> list[str]:
    return [g[0].group_id for g in groups]


def test_filter_keeps_groups_with_variance_in_order() -> None:
    # over-sampled to oversample(3, 1.0) = 6 groups; groups 1 and 4 have no variance
    scores = [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 1.0)]
    groups = [group(f"g{i}", scores=sc) for i, sc in enumerate(scores)]
    assert len(groups) == oversample(3, 1.0)
    kept, filtered = apply_group_filter(groups, "zero_variance")
    assert names(kept) == ["g0", "g2", "g3", "g5"]
    assert names(filtered) == ["g1", "g4"]
    assert all(s.status == Status.FILTERED for g in filtered for s in g)
    passthrough, none = apply_group_filter([group("c", scores=(1.0, 1.0))], "none")
    assert len(passthrough) == 1 and not none


def test_fill_batch_needs_completed_groups() -> None:
    g = group("x")
    g[0].fail("reward: timeout")
    with pytest.raises(ValueError, match="group x is FAILED, not COMPLETED"):
        apply_group_filter([g], "zero_variance")


def test_registry() -> None:
    assert GROUP_FILTERS.names() == ["none", "zero_variance"]
    with pytest.raises(
        ValueError,
        match=r"^produce\.group_filter: unknown group filter 'nope'; known: none, zero_variance$",
    ):
        GROUP_FILTERS.get("nope")
    with pytest.raises(ValueError, match="group filter 'none' is registered twice"):
        GROUP_FILTERS.register("none")(lambda g: True)


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [(10, 0.1, 11), (8, 0.25, 10), (7, 0.5, 11), (3, 0.0, 3), (0, 0.5, 0), (1, 0.01, 2)],
)
def test_oversample(n: int, fraction: float, expected: int) -> None:
    # 10 * 1.1 = 11.000000000000002 in floats: still 11; 7 * 1.5 = 10.5 -> 11; 1.01 -> 2
    assert oversample(n, fraction) == expected
