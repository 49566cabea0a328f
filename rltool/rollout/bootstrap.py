"""Percentile-bootstrap intervals over prompts: how far a mean over a few hundred eval
prompts can move by the luck of which prompts were drawn. Used by ``rltool eval`` (each
figure's interval, the paired difference of two checkpoints) and the driver's held-out
accuracy. Vectorised: ``resamples`` draws of P prompt indices at once.
Design: docs/app.md#evaluating-a-checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 1000
SEED = 0  # fixed: the same figures give the same interval on every run
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Interval:
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high


def bootstrap_interval(
    values: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL
) -> Interval:
    """The percentile bootstrap interval of ``values.mean()``: ``values`` [P] is one
    figure per prompt; prompts are drawn with replacement. ValueError on no prompts."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(
            f"a bootstrap needs one value per prompt (a 1-d array), got {values.shape}"
        )
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(resamples, values.size))  # [B, P]
    means = values[idx].mean(axis=1)  # [B]
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(low), float(high))


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """B - A per prompt, averaged; distinguishable from noise when the interval excludes 0."""

    mean: float
    interval: Interval
    prompts: int

    @property
    def distinguishable(self) -> bool:
        return self.interval.excludes(0.0)


def paired_difference(a: np.ndarray, b: np.ndarray, **kwargs: float) -> PairedDifference:
    """``b - a`` per prompt (the same prompts, in the same order: [P] each) with the
    bootstrap interval of its mean; pairing removes the prompts' own difficulty from
    the noise."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"a paired difference needs the same prompts: {a.shape} vs {b.shape}")
    diff = b - a  # [P]
    return PairedDifference(float(diff.mean()), bootstrap_interval(diff, **kwargs), diff.size)
