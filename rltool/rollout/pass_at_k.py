"""Unbiased pass@k (Chen et al. 2021): from n samples of a prompt of which c are correct,
the chance that k drawn without replacement hold at least one correct one; and maj@n, the
correctness of the majority vote over a prompt's extracted answers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` for one prompt; ValueError unless 0 <= c <= n, 1 <= k <= n."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per prompt, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count {c} must lie in 0..{n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int, cap: bool = False) -> float:
    """pass@k averaged over prompts; ``counts[i]`` is prompt i's (samples n, correct c).
    ``cap``: a prompt with fewer than k samples counts at pass@n (else a ValueError)."""
    if not counts:
        raise ValueError("pass@k needs at least one prompt")
    return sum(pass_at_k(n, c, min(k, n) if cap else k) for n, c in counts) / len(counts)


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """maj@n of one prompt: is the most frequent answer correct? ``answers[i]`` is sample
    i's extracted answer (None: it gave none, and has no vote), ``correct[i]`` its
    correctness. A tie counts the share of the tied answers that are correct (the chance
    that a vote broken at random is right), so the figure does not depend on sample
    order; 0.0 when no sample gave an answer."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    right = {a for a, ok in zip(answers, correct, strict=True) if ok and a is not None}
    return sum(a in right for a in tied) / len(tied)
