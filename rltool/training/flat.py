"""A batch's token fields concatenated once, and the vectorised contract check on them.

Shape legend: S = samples, T_s = len(input_ids) of sample s, F = sum of T_s.

``flatten`` reads every per-position field of every sample into one array per
field (sample s at ``[start_S[s], start_S[s] + T_S[s])``): a memory copy for a
``CachedList`` built by canonicalization, a struct read for plain lists.
``shape_ok`` and ``token_errors_S`` are the vectorised twin of
``rltool.rollout.contract.check_sample`` (kept equal to it by a property test):
no Python loop over tokens; ``invalid_skip`` asks ``check_group`` to name the
violation of a group that failed.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rltool.rollout.cached_list import cached_array, is_join
from rltool.rollout.contract import LOGPROB_TOLERANCE, check_group, check_group_identity, errors
from rltool.rollout.state import IGNORE_INDEX, RolloutState
from rltool.training.batch import SkippedGroup

# ---------------------------------------------------------------- concatenated fields


def _read(values: Any, out: np.ndarray, offset: int, n: int, code: str) -> None:
    """Write one sample's field into ``out[offset : offset + n]``: its cached array when
    it has one (a memory copy), else its Python numbers, packed by struct straight into
    the buffer (faster than np.fromiter or np.array read them)."""
    array = cached_array(values)
    if array is None:
        struct.pack_into(f"{n}{code}", out, offset * out.itemsize, *values)
    elif array.dtype.kind == out.dtype.kind:  # int into int, float into float
        out[offset : offset + n] = array
    else:
        raise struct.error(f"cached array of dtype {array.dtype}")


def concat_field(
    samples: Sequence[RolloutState], name: str, sizes: Sequence[int], code: str, dtype: type
) -> np.ndarray:
    """One per-position field of every sample concatenated; a sample without it stays 0."""
    arrays = [cached_array(getattr(s, name)) for s in samples]
    if arrays and all(a is not None and a.dtype == dtype for a in arrays):
        return np.concatenate(arrays)  # every sample canonicalized: one memory copy
    out = np.zeros(sum(sizes), dtype=dtype)
    offset = 0
    for s, n in zip(samples, sizes, strict=True):
        values = getattr(s, name)
        if values is not None:
            try:
                _read(values, out, offset, n, code)
            except struct.error as exc:
                msg = f"sample {s.rollout_id}: {name} does not fit {np.dtype(dtype)}: {exc}"
                raise ValueError(msg) from exc
        offset += n
    return out


@dataclass(slots=True)
class Flat:
    """Samples' unshifted fields concatenated once; sample s sits at [start_S[s], +T_S[s])."""

    T_S: np.ndarray  # [S] int64
    P_S: np.ndarray  # [S] int64, len(prompt_ids)
    start_S: np.ndarray  # [S] int64
    input_ids_F: np.ndarray  # [F] int64
    labels_F: np.ndarray  # [F] int64, patched after the staleness bake
    logprobs_F: np.ndarray  # [F] float64, zeros for a sample without logprobs
    steps_start_S: np.ndarray  # [S] int64, offset in steps; -1 without response_model_steps
    steps: np.ndarray  # [sum of R over samples with steps] int64, response_model_steps
    supervised_F: np.ndarray  # [F + 1] bool, label != -100; one False past the end
    prompt_supervised_S: np.ndarray  # [S] int64, supervised labels inside the prompt
    response_supervised_S: np.ndarray  # [S] int64, supervised labels after the prompt

    def take(self, idx: np.ndarray) -> Flat:
        """The samples ``idx``; the concatenated arrays are shared, not copied."""
        return Flat(
            self.T_S[idx], self.P_S[idx], self.start_S[idx], self.input_ids_F, self.labels_F,
            self.logprobs_F, self.steps_start_S[idx], self.steps, self.supervised_F,
            self.prompt_supervised_S[idx], self.response_supervised_S[idx],
        )  # fmt: skip

    def count_supervised(self) -> None:
        """(Re)count supervised labels from labels_F, after the bake cleared some.

        Needs every sample of the concatenation (before ``take``): a sample's response
        runs up to the next sample's start.
        """
        np.not_equal(self.labels_F, IGNORE_INDEX, out=self.supervised_F[:-1])
        if self.T_S.size == 0:
            return
        bounds = np.stack([self.start_S, self.start_S + self.P_S], axis=1).ravel()  # [2S]
        # int32 sums (a sample is far below 2**31 tokens): 3x faster than int64 here
        sums = np.add.reduceat(self.supervised_F, bounds, dtype=np.int32).astype(np.int64)  # [2S]
        # reduceat gives the element at lo, not 0, for an empty range: zero those
        self.prompt_supervised_S = np.where(self.P_S > 0, sums[0::2], 0)  # [S]
        self.response_supervised_S = np.where(self.T_S > self.P_S, sums[1::2], 0)  # [S]

    def supervised_targets(self) -> np.ndarray:
        """Supervised labels of each sample after the shift (all but position 0).  # [S]"""
        at_0 = self.supervised_F[self.start_S]  # [S]
        return self.prompt_supervised_S + self.response_supervised_S - at_0


def flatten(samples: Sequence[RolloutState]) -> Flat:
    """Concatenate samples whose lengths were checked (``shape_ok``)."""
    T = [len(s.input_ids) for s in samples]
    T_S = np.array(T, dtype=np.int64)  # [S]
    P_S = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)  # [S]
    has_steps = [s.response_model_steps is not None for s in samples]
    with_steps = [s for s, has in zip(samples, has_steps, strict=True) if has]
    R_W = (T_S - P_S)[has_steps]  # [W] response lengths of the samples with steps
    steps_start_S = np.full(len(samples), -1, dtype=np.int64)
    steps_start_S[has_steps] = np.cumsum(R_W) - R_W
    flat = Flat(
        T_S=T_S,
        P_S=P_S,
        start_S=np.cumsum(T_S) - T_S,
        input_ids_F=concat_field(samples, "input_ids", T, "q", np.int64),  # [F]
        labels_F=concat_field(samples, "labels", T, "q", np.int64),  # [F]
        logprobs_F=concat_field(samples, "logprobs", T, "d", np.float64),  # [F]
        steps_start_S=steps_start_S,
        steps=concat_field(with_steps, "response_model_steps", R_W.tolist(), "q", np.int64),
        supervised_F=np.zeros(int(T_S.sum()) + 1, dtype=bool),
        prompt_supervised_S=np.zeros(len(samples), dtype=np.int64),
        response_supervised_S=np.zeros(len(samples), dtype=np.int64),
    )
    flat.count_supervised()
    return flat


def prefix_bad(samples: Sequence[RolloutState]) -> np.ndarray:
    """Invariant 2, input_ids = prompt_ids + response_ids, of every sample.  # [S] bool

    Right by construction when ``CachedList.join`` built input_ids from the sample's
    own prompt and response lists (canonicalization does); else list == at C speed.
    """
    return np.fromiter(
        (
            not is_join(s.input_ids, s.prompt_ids, s.response_ids)
            and (
                s.input_ids[: len(s.prompt_ids)] != s.prompt_ids
                or s.input_ids[len(s.prompt_ids) :] != s.response_ids
            )
            for s in samples
        ),
        dtype=bool,
        count=len(samples),
    )


def segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges: start_i, start_i + 1, ..., start_i + length_i - 1 for every i."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


# ---------------------------------------------------------------- invariants


def finite_score(s: RolloutState) -> bool:
    score = s.score
    return isinstance(score, int | float) and math.isfinite(score)


def shape_ok(s: RolloutState, needs_reward: bool) -> bool:
    """check_sample's errors that need no token loop: lengths (1, 2, 5, extras) and the
    reward (6). The prefix equality of 2 is ``prefix_bad``'s."""
    if s.input_ids is None or s.labels is None or s.response_ids is None:
        return False
    t, p = len(s.input_ids), len(s.prompt_ids)
    if t < 2 or len(s.labels) != t or p > t or len(s.response_ids) != t - p:
        return False
    if s.logprobs is not None and len(s.logprobs) != t:
        return False
    if s.response_model_steps is not None and len(s.response_model_steps) != t - p:
        return False
    if s.routed_experts is not None and len(s.routed_experts) != t:
        return False
    tt = s.teacher_targets
    if tt is not None and (len(tt.token_ids) != t or len(tt.logprobs) != t):
        return False
    return not needs_reward or finite_score(s)


_BLOCK = 1 << 17  # positions per block of _bad_positions: its temporaries stay in cache


def _bad_positions(flat: Flat) -> np.ndarray:
    """Invariants 3 and 4 at every position.  # [F] bool

    Block by block (a loop over blocks of 128k tokens, not over tokens): the
    boolean temporaries stay in cache, twice as fast as whole-array passes.
    """
    bad_F = np.empty(flat.labels_F.size, dtype=bool)  # [F]
    supervised_F = flat.supervised_F[:-1]  # [F]
    for lo in range(0, bad_F.size, _BLOCK):
        block = slice(lo, lo + _BLOCK)
        labels, lp, supervised = flat.labels_F[block], flat.logprobs_F[block], supervised_F[block]
        bad = bad_F[block]
        np.not_equal(labels, flat.input_ids_F[block], out=bad)
        bad &= supervised  # 3: a label is -100 or its input id
        bad |= (lp != 0.0) & ~supervised  # 4: 0.0 where not supervised
        in_range = lp <= LOGPROB_TOLERANCE  # 4: finite and <= 0; False for NaN and +inf
        in_range &= lp > -np.inf
        bad |= ~in_range
    return bad_F


def token_errors_S(samples: Sequence[RolloutState], flat: Flat) -> np.ndarray:
    """Invariants 2 (the prefix), 3, 4 and 5 of every sample at once.  # [S] bool"""
    bad_F = _bad_positions(flat)  # [F]
    if flat.T_S.size == 0:
        return bad_F[:0]
    bad_S = np.logical_or.reduceat(bad_F, flat.start_S)  # [S]; every T_S >= 2
    bad_S |= flat.prompt_supervised_S > 0  # 3: every prompt label is -100
    bad_S |= prefix_bad(samples)
    # 5: response_model_steps never decrease inside a sample (a drop onto a sample's first is fine)
    dropped = np.flatnonzero(np.diff(flat.steps) < 0) + 1  # positions after a decrease
    with_steps = np.flatnonzero(flat.steps_start_S >= 0)  # [W], starts ascending
    owner = with_steps[np.searchsorted(flat.steps_start_S[with_steps], dropped, "right") - 1]
    bad_S[owner[flat.steps_start_S[owner] != dropped]] = True
    return bad_S


def identity_ok(group: Sequence[RolloutState]) -> bool:
    ids = [s.rollout_id for s in group]
    return len(set(ids)) == len(ids) and not check_group_identity(group)


def invalid_skip(group: Sequence[RolloutState], needs_reward: bool) -> SkippedGroup:
    bad = errors(check_group(group, require_reward=needs_reward))
    assert bad, f"group {group[0].group_id}: screened invalid but check_group finds no error"
    return SkippedGroup(group[0].group_id, "invalid", str(bad[0]))
