"""Unbiased pass@k (Chen et al. 2021): from n samples of a prompt of which c are correct,
the chance that k drawn without replacement hold at least one correct one."""

from __future__ import annotations

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
