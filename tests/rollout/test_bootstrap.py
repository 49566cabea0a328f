"""The percentile bootstrap over prompts and the paired difference: exact where a tiny
sample makes the percentiles certain, against the normal approximation (with a
tolerance) for a large one, and the properties a user relies on."""

from __future__ import annotations

import numpy as np
import pytest

from rltool.rollout.bootstrap import bootstrap_interval, paired_difference


def test_half_right_out_of_100_is_about_plus_minus_two_standard_errors():
    # mean 0.5, standard error sqrt(0.25 / 100) = 0.05: the 95% interval is about
    # 0.5 -/+ 1.96 * 0.05 = [0.402, 0.598]; 1000 resamples give it to about +-0.01
    ci = bootstrap_interval(np.array([0.0, 1.0] * 50))
    assert ci.low == pytest.approx(0.402, abs=0.015)
    assert ci.high == pytest.approx(0.598, abs=0.015)


def test_a_fixed_seed_gives_the_same_interval_and_another_seed_a_close_one():
    values = np.random.default_rng(7).random(60)
    assert bootstrap_interval(values) == bootstrap_interval(values)
    other = bootstrap_interval(values, seed=1)
    base = bootstrap_interval(values)
    assert other.low == pytest.approx(base.low, abs=0.02)
    assert other.high == pytest.approx(base.high, abs=0.02)


def test_tiny_samples_are_exact():
    # [1, 0, 0]: a resample is all 0 with chance 8/27 and all 1 with 1/27 (> 2.5%)
    ci = bootstrap_interval(np.array([1.0, 0.0, 0.0]))
    assert (ci.low, ci.high) == (0.0, 1.0)
    same = bootstrap_interval(np.array([0.25] * 5))  # no spread: no width
    assert (same.low, same.high) == pytest.approx((0.25, 0.25))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_the_interval_holds_the_estimate_and_shrinks_with_more_prompts(p):
    widths = []
    for prompts in (50, 200, 800):  # a fraction p of the prompts right, at every size
        values = (np.arange(prompts) < round(p * prompts)).astype(np.float64)
        ci = bootstrap_interval(values)
        assert ci.low <= values.mean() <= ci.high
        widths.append(ci.high - ci.low)
    # the width goes as 1/sqrt(prompts): 4x the prompts, about half the width
    assert widths[0] > widths[1] > widths[2]
    assert widths[1] / widths[0] == pytest.approx(0.5, abs=0.15)
    assert widths[2] / widths[1] == pytest.approx(0.5, abs=0.15)


def test_no_prompts_is_an_error():
    with pytest.raises(ValueError, match="one value per prompt"):
        bootstrap_interval(np.array([]))


def test_paired_difference_hand_worked():
    a = np.array([0.0, 0.5, 1.0, 0.25])
    b = np.array([0.5, 0.5, 1.0, 0.75])
    d = paired_difference(a, b)
    assert d.mean == pytest.approx(0.25)  # (0.5 + 0 + 0 + 0.5) / 4
    assert d.prompts == 4
    # differences [0.5, 0, 0, 0.5]: all 0 with chance 1/16, all 0.5 with 1/16 (> 2.5%)
    assert (d.interval.low, d.interval.high) == (0.0, 0.5)
    assert not d.distinguishable  # the interval reaches 0
    with pytest.raises(ValueError, match="the same prompts"):
        paired_difference(a, b[:3])


def test_pairing_sees_a_small_steady_gain_that_two_separate_intervals_miss():
    rng = np.random.default_rng(0)
    a = rng.random(200)  # prompts of every difficulty
    b = a + 0.05  # B a little better on every prompt
    d = paired_difference(a, b)
    assert d.mean == pytest.approx(0.05)
    assert d.distinguishable and d.interval.low == pytest.approx(0.05)
    ca, cb = bootstrap_interval(a), bootstrap_interval(b)
    assert cb.low < ca.high  # separately the two intervals overlap
