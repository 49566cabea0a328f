"""Batch allocation by task weight: floor, then the largest remainders, ties by task order."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltool.produce.allocation import allocate


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        # quotas 3.33 each -> floors 3, 3, 3; one left, remainders tie -> the first task
        (10, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 3, "c": 3}),
        (10, {"c": 1, "a": 1, "b": 1}, {"c": 4, "a": 3, "b": 3}),  # order, not name
        # quotas 3.5, 2.1, 1.4 -> floors 3, 2, 1; one left to the remainder 0.5
        (7, {"a": 0.5, "b": 0.3, "c": 0.2}, {"a": 4, "b": 2, "c": 1}),
        # quotas 1.67, 3.33 -> floors 1, 3; one left to a (0.67 beats 0.33)
        (5, {"a": 1, "b": 2}, {"a": 2, "b": 3}),
        # quotas 0.67 each -> floors 0; two left -> the first two
        (2, {"x": 1, "y": 1, "z": 1}, {"x": 1, "y": 1, "z": 0}),
        (5, {"a": 0, "b": 3}, {"a": 0, "b": 5}),  # weight 0 gets nothing
        (0, {"a": 1, "b": 1}, {"a": 0, "b": 0}),
        (6, {"a": 2, "b": 1}, {"a": 4, "b": 2}),  # exact quotas, nothing left over
    ],
)
def test_allocate(total: int, weights: dict[str, float], expected: dict[str, int]) -> None:
    out = allocate(total, weights)
    assert out == expected
    assert list(out) == list(weights)  # the recipe's task order is kept


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    total=st.integers(0, 500),
    weights=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=6).filter(any),
)
def test_allocate_sums_and_stays_within_one_of_the_quota(total: int, weights: list[float]) -> None:
    named = {f"t{i}": w for i, w in enumerate(weights)}
    out = allocate(total, named)
    assert sum(out.values()) == total
    weight_sum = sum(Fraction(w) for w in weights)
    for task, w in named.items():
        quota = total * Fraction(w) / weight_sum
        assert quota - 1 < out[task] < quota + 1
