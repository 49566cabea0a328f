"""The token fields of many samples concatenated once: what the contract check and the
conversion read, so that neither loops over tokens in Python.

Shape legend: S = samples, T_s = len(input_ids) of sample s, P_s = len(prompt_ids),
F = sum of T_s, W = samples with ``response_model_steps``. Sample s sits at
``[start_S[s], start_S[s] + T_S[s])`` of every ``*_F`` array.

The copy runs block by block (runs of whole samples of about ``BLOCK_TOKENS``
positions, a loop over blocks, not tokens); a ``scan`` callback reads each block
right after it is copied, while it is still in cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from rltool.rollout.state import IGNORE_INDEX, RolloutState

BLOCK_TOKENS = 1 << 17  # positions per block: its fields stay in cache while it is scanned


@dataclass(frozen=True, slots=True)
class TokenFields:
    """Samples' unshifted token fields concatenated; see the module docstring."""

    T_S: np.ndarray  # [S] int64, len(input_ids)
    P_S: np.ndarray  # [S] int64, len(prompt_ids), at most T_s
    start_S: np.ndarray  # [S] int64
    input_ids_F: np.ndarray  # [F] int64
    labels_F: np.ndarray  # [F] int64
    logprobs_F: np.ndarray  # [F] float64, zeros for a sample without logprobs
    steps_start_S: np.ndarray  # [S] int64, offset in steps; -1 without response_model_steps
    steps: np.ndarray  # [sum of T_s - P_s over the W samples] int64, response_model_steps
    supervised_F: np.ndarray  # [F + 1] bool, label != -100; one False past the end
    prompt_supervised_S: np.ndarray  # [S] int64, supervised labels inside the prompt
    response_supervised_S: np.ndarray  # [S] int64, supervised labels after the prompt

    def take(self, idx: np.ndarray) -> TokenFields:
        """The samples ``idx``; the concatenated arrays are shared, not copied."""
        return TokenFields(
            self.T_S[idx], self.P_S[idx], self.start_S[idx], self.input_ids_F, self.labels_F,
            self.logprobs_F, self.steps_start_S[idx], self.steps, self.supervised_F,
            self.prompt_supervised_S[idx], self.response_supervised_S[idx],
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Block:
    """A run of whole samples just copied: their indices and views of their fields."""

    samples: range  # sample indices
    positions: slice  # into every *_F array
    input_ids: np.ndarray  # [positions] views into the *_F arrays
    labels: np.ndarray
    logprobs: np.ndarray
    supervised: np.ndarray


def _blocks(T_S: np.ndarray) -> list[int]:
    """Sample indices where blocks begin, then S: whole samples, about BLOCK_TOKENS each."""
    bounds, filled = [0], 0
    for s, t in enumerate(T_S.tolist()):
        filled += t
        if filled >= BLOCK_TOKENS:
            bounds.append(s + 1)
            filled = 0
    if bounds[-1] != T_S.size:
        bounds.append(T_S.size)
    return bounds


def concat_fields(
    samples: Sequence[RolloutState],
    with_steps: Sequence[bool] | None = None,
    scan: Callable[[Block], None] | None = None,
) -> TokenFields:
    """Concatenate samples whose input_ids and labels (and logprobs, when present) have
    one length each. ``with_steps[s]``: take sample s's response_model_steps (which must
    then hold T_s - min(P_s, T_s) entries); by default every sample that has them.
    ``scan`` is called on every block right after it is copied."""
    T_S = np.array([len(s.input_ids) for s in samples], dtype=np.int64)  # [S]
    P_S = np.minimum([len(s.prompt_ids) for s in samples], T_S).astype(np.int64)  # [S]
    start_S = np.cumsum(T_S) - T_S  # [S]
    n = int(T_S.sum())
    ids_F, labels_F = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    logprobs_F, supervised_F = np.empty(n), np.zeros(n + 1, dtype=bool)
    bounds = _blocks(T_S)
    for a, b in pairwise(bounds):
        block = slice(int(start_S[a]), int(start_S[b - 1] + T_S[b - 1]))
        members = samples[a:b]
        np.concatenate([s.input_ids for s in members], out=ids_F[block])
        np.concatenate([s.labels for s in members], out=labels_F[block])
        lps = [np.zeros(len(s.input_ids)) if s.logprobs is None else s.logprobs for s in members]
        np.concatenate(lps, out=logprobs_F[block])
        np.not_equal(labels_F[block], IGNORE_INDEX, out=supervised_F[block])
        if scan is not None:
            scan(
                Block(
                    range(a, b), block, ids_F[block], labels_F[block], logprobs_F[block],
                    supervised_F[block],
                )
            )  # fmt: skip

    if with_steps is None:
        with_steps = [s.response_model_steps is not None for s in samples]
    has_steps = np.array(with_steps, dtype=bool).reshape(-1)  # [S]
    R_W = (T_S - P_S)[has_steps]  # [W]
    steps_start_S = np.full(len(samples), -1, dtype=np.int64)  # [S]
    steps_start_S[has_steps] = np.cumsum(R_W) - R_W
    steps = [s.response_model_steps for s, w in zip(samples, with_steps, strict=True) if w]

    prompt_S, response_S = np.zeros(len(samples), np.int64), np.zeros(len(samples), np.int64)
    if samples:
        bounds_2S = np.stack([start_S, start_S + P_S], axis=1).ravel()  # [2S]
        # int32 sums (a sample is far below 2**31 tokens): 3x faster than int64 here
        sums = np.add.reduceat(supervised_F, bounds_2S, dtype=np.int32)  # [2S]
        # reduceat gives the element at lo, not 0, for an empty range: zero those
        prompt_S[:] = np.where(P_S > 0, sums[0::2], 0)
        response_S[:] = np.where(T_S > P_S, sums[1::2], 0)
    return TokenFields(
        T_S, P_S, start_S, ids_F, labels_F, logprobs_F, steps_start_S,
        np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64),
        supervised_F, prompt_S, response_S,
    )  # fmt: skip


def segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges: start_i, start_i + 1, ..., start_i + length_i - 1 for every i."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def first_per_segment(idx: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ascending positions ``idx`` in a concatenation whose segments begin at the
    ascending ``starts``: the segments holding any of them and, for each, the first one's
    offset inside its segment.  # [M], [M]"""
    owner = np.searchsorted(starts, idx, side="right") - 1  # [len(idx)]
    segs, first = np.unique(owner, return_index=True)
    return segs, idx[first] - starts[segs]
