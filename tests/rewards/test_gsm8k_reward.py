"""GSM8K answer extraction and scoring, including reward errors and threads."""

from __future__ import annotations

import threading
import time

import math_verify
import pytest

from rltool.rewards.gsm8k import RewardResult, answer_key, extract_answer, gsm8k_reward
from rltool.rollout.failures import failure_reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7 * 7 = 49\n#### 49", "49"),
        ("#### 72 clips", "72"),
        ("#### -1,234", "-1234"),
        ("#### $1,200.50.", "1200.50"),
        ("#### 3/4", "3/4"),
        ("#### \\frac{1}{2}", "\\frac{1}{2}"),  # not a number: the expression, for math-verify
        ("so 5-3=2, the answer is 2.", "2"),  # no ####: the last number; '-' between operands
        ("it is -7", "-7"),
        ("12 apples ####", "12"),  # nothing after ####: the last number before it
        ("#### 1\n#### 2", "2"),  # the last ####
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_correct_wrong_and_missing() -> None:
    assert gsm8k_reward("3 + 4 = 7\n#### 7", "7") == RewardResult(1.0, "ok", extracted="7")
    assert gsm8k_reward("3 + 4 = 8\n#### 8", "7") == RewardResult(0.0, "ok", extracted="8")
    assert gsm8k_reward("I do not know", "7") == RewardResult(0.0, "ok", extracted=None)
    assert gsm8k_reward("#### 1,000", "1000").score == 1.0
    assert gsm8k_reward("#### 7.0", "7").score == 1.0


def test_math_verify_path_for_non_plain_answers() -> None:
    assert gsm8k_reward("#### 0.5", "\\frac{1}{2}").score == 1.0
    assert gsm8k_reward("#### 0.4", "\\frac{1}{2}").score == 0.0
    assert gsm8k_reward("#### \\frac{3}{4}", "0.75").score == 1.0


def test_unparsable_ground_truth_is_an_error_not_zero() -> None:
    r = gsm8k_reward("#### 2", "no answer recorded")
    assert (r.status, r.score, r.extracted) == ("error", None, "2")
    assert "ground truth" in r.error


def test_checker_exception_is_an_error_not_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_verify, "verify", boom)
    r = gsm8k_reward("#### 0.5", "\\frac{1}{2}")
    assert r.status == "error"
    assert r.score is None
    assert r.error.startswith("RuntimeError: ") and r.error.endswith(": sympy exploded")
    assert failure_reason(f"reward: {r.error}") == "reward: RuntimeError"
    assert not r.correct


def test_checker_timeout_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args: object, **kwargs: object) -> bool:
        time.sleep(0.5)
        return True

    monkeypatch.setattr(math_verify, "verify", slow)
    r = gsm8k_reward("#### 0.5", "\\frac{1}{2}", timeout_s=0.05)
    assert r.status == "error"
    assert "timed out after 0.05 s" in r.error
    assert failure_reason(f"reward: {r.error}") == "reward: timeout"


def test_works_outside_the_main_thread() -> None:
    # math-verify's default timeouts use signal.alarm, which raises in a non-main thread.
    results: list[RewardResult] = []
    worker = threading.Thread(
        target=lambda: results.extend(
            [gsm8k_reward("#### 0.5", "\\frac{1}{2}"), gsm8k_reward("#### 7", "7")]
        )
    )
    worker.start()
    worker.join(timeout=30)
    assert [(r.status, r.score) for r in results] == [("ok", 1.0), ("ok", 1.0)]


def test_answer_key_makes_equal_numbers_one_vote():
    assert answer_key("3") == answer_key("3.0") == answer_key("6/2") == "3"
    assert answer_key("0.5") == "1/2"
    assert answer_key(" x + 1 ") == "x + 1"  # not a plain number: the text as extracted
