"""Unbiased pass@k, worked by hand: 1 - C(n-c, k) / C(n, k); maj@n, the majority vote."""

from __future__ import annotations

import pytest

from rltool.rollout.pass_at_k import majority_vote, mean_pass_at_k, pass_at_k


def test_pass_at_1_is_the_fraction_correct():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # 1 - C(5,1)/C(8,1) = 1 - 5/8


def test_hand_worked_values():
    # n=4, c=1, k=2: C(3,2)/C(4,2) = 3/6, so 1/2
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: C(3,3)/C(5,3) = 1/10, so 9/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # n=8, c=1, k=8: every draw holds the one correct sample
    assert pass_at_k(8, 1, 8) == 1.0
    # n - c < k: C(n-c, k) = 0, a correct one is always drawn
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0


def test_mean_over_prompts():
    # prompts (n=4, c=1) -> 1/2 and (n=4, c=0) -> 0 at k=2
    assert mean_pass_at_k([(4, 1), (4, 0)], 2) == pytest.approx(0.25)


def test_cap_counts_a_short_prompt_at_its_own_n():
    # (2, 1) at k=4 capped to k=2: C(1,2)=0 -> 1.0; (4, 0) -> 0.0
    assert mean_pass_at_k([(2, 1), (4, 0)], 4, cap=True) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        mean_pass_at_k([(2, 1), (4, 0)], 4)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)])
def test_out_of_range_is_an_error(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_no_prompt_is_an_error():
    with pytest.raises(ValueError, match="at least one prompt"):
        mean_pass_at_k([], 1)


def test_majority_vote_is_right_when_the_most_frequent_answer_is():
    # "3" three times (right), "5" twice: the vote says 3
    assert majority_vote(["3", "5", "3", "5", "3"], [True, False, True, False, True]) == 1.0
    # two right of five: the majority "5" is wrong, though pass@5 would count it solved
    assert majority_vote(["5", "3", "5", "5", "3"], [False, True, False, False, True]) == 0.0


def test_a_tie_counts_the_share_of_tied_answers_that_are_right():
    assert majority_vote(["3", "5"], [True, False]) == 0.5
    assert majority_vote(["5", "3"], [False, True]) == 0.5  # sample order does not matter
    # three answers tied at two votes, one of them right; a lone "9" has no say
    assert majority_vote(
        ["1", "2", "3", "1", "2", "3", "9"], [True, False, False, True, False, False, True]
    ) == pytest.approx(1 / 3)


def test_samples_without_an_answer_do_not_vote():
    assert majority_vote([None, None, "4"], [False, False, True]) == 1.0
    assert majority_vote([None, None], [False, False]) == 0.0
    with pytest.raises(ValueError, match="2 answers but 1"):
        majority_vote(["1", "2"], [True])
