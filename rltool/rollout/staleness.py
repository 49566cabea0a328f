"""Token staleness (data-contract section 6), baked into labels in place.

Shape legend: T = len(input_ids), P = len(prompt_ids), R = T - P response tokens.

``staleness(token) = train_step - model_step - 1`` (0 in a synchronous run).
With ``sync_interval`` train steps between weight syncs:

- a token stays trainable while ``staleness < (max_token_staleness + 1) * sync_interval``;
- a sample expires when its oldest token reaches ``(max_staleness + 1) * sync_interval``,
  or when no supervised token is left.

Stale tokens get label -100 (and logprob 0.0, so the sample still satisfies
invariant 4). On the live path the replay buffer bakes once, when a batch is
taken for training; ``expiry_reason`` reads staleness without baking. Clearing
only ever removes supervision, so baking twice gives identical labels. A sample
without ``response_model_steps`` is never stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rltool.config.schema import AlgorithmConfig
from rltool.rollout.state import IGNORE_INDEX, RolloutState


@dataclass(frozen=True, slots=True)
class StalenessLimits:
    """The staleness settings (``algorithm.max_staleness``, ``max_token_staleness``,
    ``sync_interval``): the one object the producer, the replay buffer and the offline
    tools read them from. None = no limit."""

    max_staleness: int | None = None  # a sample expires at (max_staleness + 1) * sync_interval
    max_token_staleness: int | None = None  # a token is cleared at (this + 1) * sync_interval
    sync_interval: int = 1  # train steps between weight syncs

    @classmethod
    def from_algorithm(cls, algorithm: AlgorithmConfig) -> StalenessLimits:
        return cls(algorithm.max_staleness, algorithm.max_token_staleness, algorithm.sync_interval)

    @property
    def bakes(self) -> bool:
        """Whether any limit is set (else nothing is ever cleared or expired)."""
        return self.max_staleness is not None or self.max_token_staleness is not None

    @property
    def token_threshold(self) -> int | None:
        """A token is trainable while its staleness is below this; None = no limit."""
        return _threshold(self.max_token_staleness, self.sync_interval)

    @property
    def sample_threshold(self) -> int | None:
        """A sample expires when its oldest token reaches this; None = no limit."""
        return _threshold(self.max_staleness, self.sync_interval)


def _threshold(limit: int | None, sync_interval: int) -> int | None:
    return None if limit is None else (limit + 1) * sync_interval


def token_staleness(train_step: int, model_steps: Sequence[int] | np.ndarray) -> np.ndarray:
    """train_step - model_step - 1 per token."""
    return train_step - np.asarray(model_steps, dtype=np.int64) - 1  # [R]


@dataclass(frozen=True, slots=True)
class StalenessResult:
    cleared: int  # supervised tokens this call set to -100
    max_staleness: int  # staleness of the oldest response token; 0 without model steps
    expired: bool
    reason: str | None = None  # "max_staleness" | "no_supervised_tokens" when expired


NOT_STALE = StalenessResult(cleared=0, max_staleness=0, expired=False)


def bake_staleness(state: RolloutState, train_step: int, cfg: StalenessLimits) -> StalenessResult:
    """Clear stale tokens' labels (and logprobs) of one sample in place; report expiry.

    Expects the sample's fields to satisfy the section-4 invariants (the lengths
    in particular); with both limits None nothing is cleared and nothing expires.
    """
    tok_thr, sample_thr = cfg.token_threshold, cfg.sample_threshold
    if state.response_model_steps is None:
        return NOT_STALE
    assert state.labels is not None
    staleness_R = token_staleness(train_step, state.response_model_steps)  # [R]
    oldest = int(staleness_R.max()) if staleness_R.size else 0
    if tok_thr is None and sample_thr is None:
        return StalenessResult(cleared=0, max_staleness=oldest, expired=False)

    p = len(state.prompt_ids)
    labels_T = state.labels  # [T], the sample's own array: written in place
    cleared = 0
    if tok_thr is not None:
        stale_R = (staleness_R >= tok_thr) & (labels_T[p:] != IGNORE_INDEX)  # [R]
        cleared = int(stale_R.sum())
        if cleared:
            pos = np.flatnonzero(stale_R) + p  # positions in the full sequence
            labels_T[pos] = IGNORE_INDEX
            if state.logprobs is not None:
                state.logprobs[pos] = 0.0

    reason = None
    if sample_thr is not None and oldest >= sample_thr:
        reason = "max_staleness"
    elif not np.any(labels_T != IGNORE_INDEX):
        reason = "no_supervised_tokens"
    return StalenessResult(cleared, oldest, reason is not None, reason)


def expiry_reason(state: RolloutState, train_step: int, cfg: StalenessLimits) -> str | None:
    """Why the sample would expire if baked at ``train_step`` ("max_staleness" or
    "no_supervised_tokens", with its oldest token's staleness), or None.

    Reads staleness and changes nothing: the replay buffer's check when a group arrives
    (the one bake happens when the batch is taken)."""
    if state.response_model_steps is None or not cfg.bakes:
        return None
    staleness_R = token_staleness(train_step, state.response_model_steps)  # [R]
    oldest = int(staleness_R.max()) if staleness_R.size else 0
    sample_thr, tok_thr = cfg.sample_threshold, cfg.token_threshold
    why = f"(oldest token staleness {oldest})"
    if sample_thr is not None and oldest >= sample_thr:
        return f"max_staleness {why}"
    p = len(state.prompt_ids)
    supervised_T = np.asarray(state.labels, dtype=np.int64) != IGNORE_INDEX  # [T]
    if tok_thr is not None:
        supervised_T[p:] &= staleness_R < tok_thr
    return None if supervised_T.any() else f"no_supervised_tokens {why}"
