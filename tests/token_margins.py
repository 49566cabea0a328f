"""Discrete results derived from floats, compared only where the margin makes them stable.

Two paths (another kernel, batch shape, cache layout or CPU) compute the same logits a few
1e-6 apart. The argmax, or the order of the top k, is then the same on both only where the
gap between the competing values is well above that; at a near-tie either answer is right
and a test that asserts one passes or fails by the machine.
"""

from __future__ import annotations

import torch

# logits of the paths the tests compare differ by < 1e-5; a gap 10x that cannot flip
MARGIN = 1e-4


def top_gaps(logits: torch.Tensor, k: int = 1) -> torch.Tensor:
    """[..., V] -> [...]: the smallest gap between neighbours among the top k + 1 values,
    which decides both which k are on top and their order (k = 1: top-1 minus top-2)."""
    top = logits.topk(k + 1, dim=-1).values  # [..., k + 1], descending
    return (top[..., :-1] - top[..., 1:]).min(dim=-1).values


def stable_length(gaps: torch.Tensor, margin: float = MARGIN) -> int:
    """[R] gaps of a greedy continuation's steps -> the steps before the first near-tie:
    two paths make the same tokens up to there, and may part after it."""
    below = (gaps < margin).nonzero()
    return int(below[0]) if len(below) else len(gaps)
