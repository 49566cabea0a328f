"""The per-position invariants of data-contract section 4, over many samples at once.

As ``concat_fields`` copies the samples' token fields block by block, ``Scan`` marks the
positions where invariant 2 (input_ids = prompt_ids + response_ids), 3 (labels) or 4
(logprobs) may fail; ``position_checks`` then runs each rule on those suspects only and
reports every sample's first failing position, and ``step_order`` finds where
response_model_steps decrease inside a sample (invariant 5). ``rltool.rollout.contract``
calls them from ``check_samples``.

Shape legend: S = samples, F = their positions concatenated, M = suspect positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rltool.rollout.fields import Block, TokenFields, first_per_segment, segments
from rltool.rollout.state import RolloutState
from rltool.rollout.violation import Found, Violation

LOGPROB_TOLERANCE = 1e-4  # engines round; a supervised logprob may be a hair above 0


@dataclass(slots=True)
class Scan:
    """Marks, block by block as the fields are copied, the positions where invariant 2,
    3 (a foreign label) or 4 may fail: a few whole-block numpy operations each."""

    expected: list[tuple[np.ndarray, ...]]  # [S] each sample's expected input_ids, in parts
    suspect_F: np.ndarray  # [F] bool
    differs_F: np.ndarray  # [F] bool, input_ids != prompt_ids + response_ids

    def __call__(self, b: Block) -> None:
        ids, labels, lp, supervised = b.input_ids, b.labels, b.logprobs, b.supervised
        bad, differs = self.suspect_F[b.positions], self.differs_F[b.positions]
        expected = np.concatenate([part for i in b.samples for part in self.expected[i]])
        np.not_equal(expected, ids, out=differs)  # 2: prompt_ids + response_ids
        np.not_equal(labels, ids, out=bad)
        bad &= supervised  # 3: a label is -100 or its input id
        bad |= differs
        tmp, ok = np.not_equal(lp, 0.0), np.less_equal(lp, LOGPROB_TOLERANCE)
        np.greater(tmp, supervised, out=tmp)  # 4: not 0.0 where not supervised
        bad |= tmp
        ok &= np.greater(lp, -np.inf, out=tmp)  # 4: finite and <= 0 (NaN, +inf fail <=)
        np.greater_equal(bad, ok, out=bad)  # bad, or not ok


@dataclass(frozen=True, slots=True)
class _Suspects:
    """The suspect positions and what the rules read there.  # [M] each"""

    row: np.ndarray  # sample row in the fields
    at: np.ndarray  # position in the sample
    in_prompt: np.ndarray
    differs: np.ndarray
    ids: np.ndarray
    labels: np.ndarray
    supervised: np.ndarray
    lp: np.ndarray
    finite_row: np.ndarray  # every logprob of the sample is finite

    @classmethod
    def at_positions(cls, f: TokenFields, differs_F: np.ndarray, idx: np.ndarray) -> _Suspects:
        row = np.searchsorted(f.start_S, idx, side="right") - 1
        at = idx - f.start_S[row]
        lp = f.logprobs_F[idx]
        finite_row = ~np.isin(row, row[~np.isfinite(lp)])
        return cls(
            row, at, at < f.P_S[row], differs_F[idx], f.input_ids_F[idx], f.labels_F[idx],
            f.supervised_F[idx], lp, finite_row,
        )  # fmt: skip


def _suspect_positions(f: TokenFields, scan: Scan) -> np.ndarray:
    """The scan's suspects, and the supervised prompt positions (invariant 3) of the samples
    that concat_fields counted with any.  # [M] ascending"""
    rows = np.flatnonzero(f.prompt_supervised_S > 0)
    prompt_pos = segments(f.start_S[rows], f.P_S[rows])
    return np.union1d(np.flatnonzero(scan.suspect_F), prompt_pos[f.supervised_F[prompt_pos]])


@dataclass(frozen=True, slots=True)
class _Rule:
    """A per-position invariant: where it fails among the suspects, and how to say so."""

    field: str
    invariant: int
    kind: str  # Violation.kind
    fails: Callable[[_Suspects], np.ndarray]  # [M] bool
    message: Callable[[RolloutState, int], str]  # the sample, the position in ``field``
    in_response: bool = False  # positions counted in response_ids, not input_ids


_RULES = (  # in the order check_sample lists them
    _Rule(
        "prompt_ids", 2, "input_ids start with prompt_ids", lambda x: x.differs & x.in_prompt,
        lambda s, i: f"input_ids[{i}]={s.input_ids[i]} but prompt_ids[{i}]={s.prompt_ids[i]}",
    ),
    _Rule(
        "response_ids", 2, "response_ids follow the prompt", lambda x: x.differs & ~x.in_prompt,
        lambda s, j: f"response_ids[{j}]={s.response_ids[j]} but "
        f"input_ids[{len(s.prompt_ids) + j}]={s.input_ids[len(s.prompt_ids) + j]}",
        in_response=True,
    ),
    _Rule(
        "labels", 3, "labels -100 or the input id", lambda x: x.supervised & (x.labels != x.ids),
        lambda s, i: f"label {s.labels[i]} is neither -100 nor input_ids[{i}]={s.input_ids[i]}",
    ),
    _Rule(
        "labels", 3, "prompt labels -100", lambda x: x.supervised & x.in_prompt,
        lambda s, i: f"prompt position supervised (label {s.labels[i]}); "
        "prompt labels must be -100",
    ),
    _Rule(
        "logprobs", 4, "logprobs finite", lambda x: ~np.isfinite(x.lp),
        lambda s, i: f"not finite ({s.logprobs[i]})",
    ),
    _Rule(
        "logprobs", 4, "logprobs <= 0 where supervised",
        lambda x: x.finite_row & x.supervised & (x.lp > LOGPROB_TOLERANCE),
        lambda s, i: f"logprob {s.logprobs[i]:.6g} > 0 at a supervised position",
    ),
    _Rule(
        "logprobs", 4, "logprobs 0.0 where not supervised",
        lambda x: x.finite_row & ~x.supervised & (x.lp != 0.0),
        lambda s, i: f"logprob {s.logprobs[i]:.6g} at an unsupervised position, must be 0.0",
    ),
)  # fmt: skip


def position_checks(
    samples: Sequence[RolloutState], rows: Sequence[int], f: TokenFields, scan: Scan
) -> list[Found]:
    """Each rule's first failing position in every sample ``rows`` (one list per rule)."""
    x = _Suspects.at_positions(f, scan.differs_F, _suspect_positions(f, scan))
    found: list[Found] = []
    for rule in _RULES:
        fails = rule.fails(x)  # [M]
        failing, first = np.unique(x.row[fails], return_index=True)
        at = x.at[fails][first] - (f.P_S[failing] if rule.in_response else 0)
        found.append([
            (rows[r], Violation(samples[rows[r]].rollout_id, rule.field,
                                rule.message(samples[rows[r]], i), rule.invariant, i,
                                kind=rule.kind))
            for r, i in zip(failing.tolist(), at.tolist(), strict=True)
        ])  # fmt: skip
    return found


def step_order(samples: Sequence[RolloutState], rows: Sequence[int], f: TokenFields) -> Found:
    """Invariant 5: response_model_steps never decrease inside a sample (a drop from one
    sample's last step onto the next sample's first is fine)."""
    with_steps = np.flatnonzero(f.steps_start_S >= 0)  # [W]
    starts_W = f.steps_start_S[with_steps]  # [W], ascending
    dropped = np.flatnonzero(np.diff(f.steps) < 0) + 1  # positions after a decrease
    dropped = dropped[~np.isin(dropped, starts_W)]
    out: Found = []
    for w, at in zip(*first_per_segment(dropped, starts_W), strict=True):
        s = samples[rows[int(with_steps[w])]]
        steps, at = s.response_model_steps, int(at)
        msg = f"decreases from {steps[at - 1]} to {steps[at]}"
        out.append(
            (rows[int(with_steps[w])], Violation(s.rollout_id, "response_model_steps", msg, 5, at))
        )
    return out
