"""GSM8K answer checking: extract the final number, compare it with the ground truth.

A reward that cannot be computed is a ``status="error"`` result, never a silent 0.0.
Design: docs/foundations.md#gsm8k-answer-checking
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

MATH_VERIFY_TIMEOUT_S = 5.0
# A number: an optional sign (not a minus between operands) and $, digits with thousands
# commas, optional decimals or a /denominator.
_NUMBER = r"(?:(?<![\w)])-)?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_LEADING_NUMBER_RE = re.compile(rf"^\s*({_NUMBER})(?![\d.]*[a-zA-Z\\^{{])")
# A few workers: a math-verify call that overruns its deadline keeps its thread
# until it returns (a thread cannot be killed), so the pool is shared and small.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="math-verify")


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float | None  # 1.0 correct, 0.0 wrong or no answer; None when status is "error"
    status: Literal["ok", "error"]
    error: str | None = None  # why the reward could not be computed
    extracted: str | None = None  # the answer found in the response, if any

    @property
    def correct(self) -> bool:
        return self.score == 1.0


def extract_answer(text: str) -> str | None:
    """The number after the last ``####`` (or the expression there if it is not a
    number), else the last number in the text; None when there is none."""
    head, sep, tail = text.rpartition("####")
    if sep:
        line = tail.strip().split("\n", 1)[0].strip()
        match = _LEADING_NUMBER_RE.match(line)
        if match:
            return _clean_number(match.group(1))
        if line:
            return line.rstrip(".")
        text = head
    numbers = _NUMBER_RE.findall(text)
    return _clean_number(numbers[-1]) if numbers else None


def answer_key(extracted: str) -> str:
    """The form answers are voted in (maj@n): a plain number's exact value (``"3.0"``,
    ``"3"`` and ``"6/2"`` are one answer), else the text as extracted."""
    value = _as_fraction(extracted)
    return extracted.strip() if value is None else str(value)


def _clean_number(s: str) -> str:
    return re.sub(r"[\s$,]", "", s)


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a plain number string, or None if it is not one."""
    s = _clean_number(s).rstrip(".")
    if not re.fullmatch(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?", s):
        return None
    try:
        return Fraction(s)
    except ZeroDivisionError:
        return None


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns (to stderr) that its timeout is off; ours replaces it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_TIMEOUT_FILTER = _DropTimeoutDisabledWarning()


def _math_verify_equal(ground_truth: str, answer: str) -> bool:
    import math_verify  # lazy: sympy costs ~2 s to import and plain numbers never need it

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_TIMEOUT_FILTER)  # idempotent: a set of filters
    gold = math_verify.parse(ground_truth, parsing_timeout=None, raise_on_error=True)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    pred = math_verify.parse(answer, parsing_timeout=None, raise_on_error=True)
    if not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None, raise_on_error=True))


def gsm8k_reward(
    response_text: str, ground_truth: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S
) -> RewardResult:
    """Score one response against the ground-truth answer. Never raises on bad input:
    a failure is a RewardResult with status "error". Safe from any thread."""
    answer = extract_answer(response_text)
    if answer is None:
        return RewardResult(score=0.0, status="ok")
    gold = ground_truth.strip()
    gold_value, answer_value = _as_fraction(gold), _as_fraction(answer)
    if gold_value is not None and answer_value is not None:
        return RewardResult(float(gold_value == answer_value), "ok", extracted=answer)
    future = _POOL.submit(_math_verify_equal, gold, answer)
    try:
        equal = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        msg = f"timeout: math-verify timed out after {timeout_s:g} s on {answer!r} vs {gold!r}"
        return RewardResult(None, "error", msg, extracted=answer)
    except Exception as exc:  # any failure of the checker is recorded, never scored 0.0
        msg = f"{type(exc).__name__}: math-verify failed on {answer!r} vs {gold!r}: {exc}"
        return RewardResult(None, "error", msg, extracted=answer)
    return RewardResult(float(equal), "ok", extracted=answer)
