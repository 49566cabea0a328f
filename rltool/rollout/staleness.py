"""Token staleness (data-contract section 6), baked into labels in place.

Shape legend: T = len(input_ids), P = len(prompt_ids), R = T - P response tokens.

``staleness(token) = train_step - model_step - 1`` (0 in a synchronous run).
With ``sync_interval`` train steps between weight syncs:

- a token stays trainable while ``staleness < (max_token_staleness + 1) * sync_interval``;
- a sample expires when its oldest token reaches ``(max_staleness + 1) * sync_interval``,
  or when no supervised token is left.

"The bake" marks stale tokens as not trained: label -100 (and logprob 0.0, so the
sample still satisfies invariant 4), written in place. The replay buffer bakes once,
when a batch is taken for training (``bake_group``); ``rltool inspect-batch`` calls the
same ``bake_group``, so it shows what training does. ``expiry_reason`` (the buffer's
check when a group arrives) reads the same rule (``_judge``) without writing. Clearing
only ever removes supervision, so baking twice gives identical labels. A sample
without ``response_model_steps`` is never stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rltool.config.schema import AlgorithmConfig
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status


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


def position_staleness(state: RolloutState, train_step: int) -> np.ndarray:
    """``token_staleness`` at every position of the sequence.  # [T] float64

    nan at prompt positions and everywhere when the sample has no ``response_model_steps``.
    """
    assert state.input_ids is not None
    staleness_T = np.full(len(state.input_ids), np.nan)  # [T]
    if state.response_model_steps is not None:
        p = len(state.prompt_ids)
        staleness_T[p:] = token_staleness(train_step, state.response_model_steps)  # [R]
    return staleness_T


@dataclass(frozen=True, slots=True)
class StalenessResult:
    cleared: int  # supervised tokens this call set to -100
    max_staleness: int  # staleness of the oldest response token; 0 without model steps
    expired: bool
    reason: str | None = None  # "max_staleness" | "no_supervised_tokens" when expired
    # positions in the full sequence (indices into input_ids) whose labels this call cleared
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


NOT_STALE = StalenessResult(cleared=0, max_staleness=0, expired=False)


def _judge(state: RolloutState, train_step: int, cfg: StalenessLimits) -> StalenessResult:
    """The one staleness rule, read without writing: which supervised tokens are stale at
    ``train_step`` and whether the sample expires once they are cleared."""
    if state.response_model_steps is None:
        return NOT_STALE
    assert state.labels is not None
    staleness_R = token_staleness(train_step, state.response_model_steps)  # [R]
    oldest = int(staleness_R.max()) if staleness_R.size else 0
    tok_thr, sample_thr = cfg.token_threshold, cfg.sample_threshold
    if tok_thr is None and sample_thr is None:
        return StalenessResult(cleared=0, max_staleness=oldest, expired=False)
    p = len(state.prompt_ids)
    supervised_T = np.asarray(state.labels) != IGNORE_INDEX  # [T]
    stale_R = np.zeros(staleness_R.size, dtype=bool)  # [R]
    if tok_thr is not None:
        stale_R = (staleness_R >= tok_thr) & supervised_T[p:]  # [R]
    positions = np.flatnonzero(stale_R) + p  # positions in the full sequence
    supervised_T[positions] = False  # what is left to train once they are cleared
    reason = None
    if sample_thr is not None and oldest >= sample_thr:
        reason = "max_staleness"
    elif not supervised_T.any():
        reason = "no_supervised_tokens"
    return StalenessResult(int(positions.size), oldest, reason is not None, reason, positions)


def bake_staleness(state: RolloutState, train_step: int, cfg: StalenessLimits) -> StalenessResult:
    """Mark stale tokens of one sample as not trained, in place: their labels become -100
    and their logprobs 0.0. Reports what it cleared (``positions``) and whether the sample
    expires.

    Expects the sample's fields to satisfy the section-4 invariants (the lengths
    in particular); with both limits None nothing is cleared and nothing expires.
    """
    result = _judge(state, train_step, cfg)
    if result.cleared:
        assert state.labels is not None
        state.labels[result.positions] = IGNORE_INDEX  # the sample's own array
        if state.logprobs is not None:
            state.logprobs[result.positions] = 0.0
    return result


def expiry_reason(state: RolloutState, train_step: int, cfg: StalenessLimits) -> str | None:
    """Why the sample would expire if baked at ``train_step`` ("max_staleness" or
    "no_supervised_tokens", with its oldest token's staleness), or None.

    Reads staleness and changes nothing: the replay buffer's check when a group arrives
    (the one bake happens when the batch is taken)."""
    result = _judge(state, train_step, cfg)
    return _expiry_text(result) if result.expired else None


def _expiry_text(result: StalenessResult) -> str:
    return f"{result.reason} (oldest token staleness {result.max_staleness})"


def can_bake(state: RolloutState) -> bool:
    """Lengths that let the bake line model steps up with labels. Conversion skips a
    sample that breaks them as invalid, so the bake leaves it untouched."""
    steps, labels = state.response_model_steps, state.labels
    return (
        steps is not None
        and labels is not None
        and len(labels) - len(state.prompt_ids) == len(steps)
    )


def mark_expired(state: RolloutState, train_step: int, reason: str) -> None:
    state.status = Status.EXPIRED
    state.error = f"expired at train step {train_step}: {reason}"


@dataclass(slots=True)
class GroupBake:
    """What baking one group did."""

    cleared: int = 0  # supervised tokens set to -100, over the members
    expired: bool = False  # some member expired (marked EXPIRED): the group is not trained
    # rollout_id -> positions in the full sequence whose labels were cleared (members baked)
    positions: dict[str, np.ndarray] = field(default_factory=dict)


def bake_group(group: Sequence[RolloutState], train_step: int, cfg: StalenessLimits) -> GroupBake:
    """Bake every member whose fields line up (so the counts are whole), in place: the
    replay buffer's bake when it serves a group for training, and inspect-batch's.
    An expired member is marked EXPIRED with the reason in ``error``."""
    out = GroupBake()
    if not cfg.bakes:
        return out
    for s in group:
        if not can_bake(s):
            continue
        r = bake_staleness(s, train_step, cfg)
        out.cleared += r.cleared
        out.positions[s.rollout_id] = r.positions
        if r.expired:
            mark_expired(s, train_step, _expiry_text(r))
            out.expired = True
    return out
