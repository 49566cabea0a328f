"""The invariants of data-contract section 4, checked on many samples at once.

``check_samples`` checks invariants 1-6, 8 and 10 of every sample on their token fields
concatenated once (``rltool.rollout.fields``): numpy over all positions together,
a Python loop over samples only, and every violation names its sample, field and
first offending position. ``check_sample`` is the one-sample case, ``check_group``
adds invariant 7 across a group. None of them raises: ``validate-rollouts`` reports
every violation, an agent loop fails the sample, the conversion skips its group.

Shape legend: S = samples, F = their positions concatenated, M = suspect positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from rltool.rollout.fields import Block, TokenFields, concat_fields, first_per_segment, segments
from rltool.rollout.routing import ROUTING_INVARIANT, routing_problems
from rltool.rollout.state import RolloutState, Status
from rltool.rollout.vocab import VOCAB_INVARIANT, VOCAB_KIND, vocab_problems

LOGPROB_TOLERANCE = 1e-4  # engines round; a supervised logprob may be a hair above 0


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Violation:
    rollout_id: str
    field: str
    message: str
    invariant: int  # number in data-contract section 4
    position: int | None = None  # first offending position in that field
    severity: Severity = Severity.ERROR
    kind: str = ""  # the rule broken, in words without sample, position or value

    def __str__(self) -> str:
        where = f"{self.field}[{self.position}]" if self.position is not None else self.field
        return f"{self.rollout_id}: {where}: {self.message} (invariant {self.invariant})"

    @property
    def reason(self) -> str:  # a failure reason (rollout/failures.py): no sample in it
        return f"contract: {self.kind or f'{self.field}, invariant {self.invariant}'}"


@dataclass(frozen=True, slots=True)
class Checked:
    """What ``check_samples`` found."""

    violations: list[list[Violation]]  # [S] each sample's, in check_sample's order
    fields: TokenFields  # the samples whose lengths allow per-position checks
    row_S: np.ndarray  # [S] each sample's index in ``fields``; -1 when not there


_Found = list[tuple[int, Violation]]  # (sample index, violation) of one check


# ---------------------------------------------------------------- one sample, no token loop


def _reward(s: RolloutState) -> Violation | None:
    """Invariant 6: a COMPLETED sample has a reward with a finite score."""
    if s.status != Status.COMPLETED:
        return None
    score = None if s.reward is None else s.reward.get("score")
    if score is None:
        return Violation(s.rollout_id, "reward.score", "missing on a COMPLETED sample", 6)
    if not isinstance(score, int | float) or not math.isfinite(score):
        return Violation(s.rollout_id, "reward.score", f"not a finite number ({score!r})", 6)
    return None


def _lengths(s: RolloutState) -> list[Violation]:
    """Invariant 1. Per-position checks go on only when it finds nothing."""
    rid = s.rollout_id
    if s.input_ids is None:
        return [Violation(rid, "input_ids", "missing (canonical train fields not built)", 1)]
    if s.labels is None:
        return [Violation(rid, "labels", "missing (canonical train fields not built)", 1)]
    t, out = len(s.input_ids), []
    if t < 2:
        out.append(Violation(rid, "input_ids", f"length {t}, need at least 2", 1))
    if len(s.labels) != t:
        out.append(Violation(rid, "labels", f"length {len(s.labels)} != len(input_ids) {t}", 1))
    if s.logprobs is not None and len(s.logprobs) != t:
        msg = f"length {len(s.logprobs)} != len(input_ids) {t}"
        out.append(Violation(rid, "logprobs", msg, 1))
    return out


def _extras(s: RolloutState, t: int, num_experts: int | None = None) -> list[Violation]:
    """Per-position extras have one entry per position of input_ids; routed_experts' ids
    are in range."""
    rows = [("routed_experts", s.routed_experts)]
    if s.teacher_targets is not None:
        tt = s.teacher_targets
        rows += [
            ("teacher_targets.token_ids", tt.token_ids),
            ("teacher_targets.logprobs", tt.logprobs),
        ]
    return [
        Violation(s.rollout_id, name, f"length {len(a)} != len(input_ids) {t}", 1)
        for name, a in rows
        if a is not None and len(a) != t
    ] + [
        Violation(s.rollout_id, "routed_experts", msg, ROUTING_INVARIANT, at)
        for at, msg in routing_problems(s.routed_experts, num_experts)
    ]


@dataclass(slots=True)
class _Shapes:
    """What the per-sample length checks of the checkable samples found, and what the
    per-position checks need from them."""

    prompt: _Found  # invariant 2: prompt longer than input_ids
    response: _Found  # invariant 2: response_ids missing or of the wrong length
    steps: _Found  # invariant 5: one model step per response token
    extras: _Found  # per-position extras: one entry per position
    expected: list[tuple[np.ndarray, ...]]  # what input_ids must be: prompt_ids, response_ids
    with_steps: list[bool]  # response_model_steps has one entry per response token


def _shapes(
    samples: Sequence[RolloutState], rows: Sequence[int], num_experts: int | None = None
) -> _Shapes:
    """The length checks of the samples ``rows`` that need no token (invariants 2, 5, extras).

    Where prompt_ids or response_ids cannot be lined up with input_ids, ``expected``
    takes input_ids' own values there, so that no position check fires on top."""
    out = _Shapes([], [], [], [], [], [])
    for i in rows:
        s = samples[i]
        rid, ids, t, p = s.rollout_id, s.input_ids, len(s.input_ids), len(s.prompt_ids)
        if p > t:
            msg = f"length {p} > len(input_ids) {t}"
            out.prompt.append((i, Violation(rid, "prompt_ids", msg, 2)))
            out.expected.append((ids,))
        elif s.response_ids is None:
            out.response.append((i, Violation(rid, "response_ids", "missing", 2)))
            out.expected.append((s.prompt_ids, ids[p:]))
        elif len(s.response_ids) != t - p:
            msg = f"length {len(s.response_ids)} != len(input_ids) - len(prompt_ids) = {t - p}"
            out.response.append((i, Violation(rid, "response_ids", msg, 2)))
            out.expected.append((s.prompt_ids, ids[p:]))
        else:
            out.expected.append((s.prompt_ids, s.response_ids))
        steps = s.response_model_steps
        fits = steps is not None and len(steps) == t - p
        if steps is not None and not fits:
            msg = f"length {len(steps)} != number of response tokens {t - p}"
            out.steps.append((i, Violation(rid, "response_model_steps", msg, 5)))
        out.with_steps.append(fits)
        out.extras += [(i, v) for v in _extras(s, t, num_experts)]
    return out


# ---------------------------------------------------------------- every position at once


@dataclass(slots=True)
class _Scan:
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


def _suspect_positions(f: TokenFields, scan: _Scan) -> np.ndarray:
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


def _position_checks(
    samples: Sequence[RolloutState], rows: Sequence[int], f: TokenFields, scan: _Scan
) -> list[_Found]:
    """Each rule's first failing position in every sample ``rows`` (one list per rule)."""
    x = _Suspects.at_positions(f, scan.differs_F, _suspect_positions(f, scan))
    found: list[_Found] = []
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


def _step_order(samples: Sequence[RolloutState], rows: Sequence[int], f: TokenFields) -> _Found:
    """Invariant 5: response_model_steps never decrease inside a sample (a drop from one
    sample's last step onto the next sample's first is fine)."""
    with_steps = np.flatnonzero(f.steps_start_S >= 0)  # [W]
    starts_W = f.steps_start_S[with_steps]  # [W], ascending
    dropped = np.flatnonzero(np.diff(f.steps) < 0) + 1  # positions after a decrease
    dropped = dropped[~np.isin(dropped, starts_W)]
    out: _Found = []
    for w, at in zip(*first_per_segment(dropped, starts_W), strict=True):
        s = samples[rows[int(with_steps[w])]]
        steps, at = s.response_model_steps, int(at)
        msg = f"decreases from {steps[at - 1]} to {steps[at]}"
        out.append(
            (rows[int(with_steps[w])], Violation(s.rollout_id, "response_model_steps", msg, 5, at))
        )
    return out


# ---------------------------------------------------------------- entry points


def check_samples(
    samples: Sequence[RolloutState],
    *,
    require_reward: bool | Sequence[bool] = True,
    num_experts: int | None = None,
    vocab_size: int | None = None,
) -> Checked:
    """Every section-4 violation (invariants 1-6, 8; 9: routed_experts' ranges, against
    ``num_experts`` when known; 10: token ids, against ``vocab_size`` when known) of every
    sample; ``require_reward`` for all samples or per sample. The samples whose lengths
    agree are checked at every position together, on their fields concatenated once
    (returned for reuse)."""
    needs = [require_reward] * len(samples) if isinstance(require_reward, bool) else require_reward
    reward: _Found = []
    lengths: _Found = []
    rows: list[int] = []  # samples whose lengths let the per-position checks go on
    for i, (s, need) in enumerate(zip(samples, needs, strict=True)):
        v = _reward(s) if need else None
        if v is not None:
            reward.append((i, v))
        found = _lengths(s)
        lengths += [(i, v) for v in found]
        if not found:
            rows.append(i)
    shapes = _shapes(samples, rows, num_experts)
    checkable = [samples[i] for i in rows]
    n = sum(len(s.input_ids) for s in checkable)
    scan = _Scan(shapes.expected, np.empty(n, dtype=bool), np.empty(n, dtype=bool))
    f = concat_fields(checkable, shapes.with_steps, scan)
    prompt, response, *per_position = _position_checks(samples, rows, f, scan)
    supervised_S = f.prompt_supervised_S + f.response_supervised_S  # [rows]
    no_supervision: _Found = [
        (i, Violation(s.rollout_id, "labels", "COMPLETED sample has no supervised token", 8,
                      severity=Severity.WARNING))
        for i, s, n in zip(rows, checkable, supervised_S.tolist(), strict=True)
        if s.status == Status.COMPLETED and n == 0
    ]  # fmt: skip
    vocab: _Found = [  # input_ids holds prompt_ids and response_ids (invariant 2)
        (rows[r], Violation(samples[rows[r]].rollout_id, "input_ids", msg, VOCAB_INVARIANT, at,
                            kind=VOCAB_KIND))
        for r, at, msg in vocab_problems(f.input_ids_F, f.start_S, vocab_size)
    ]  # fmt: skip
    out: list[list[Violation]] = [[] for _ in samples]
    for found in (
        reward, lengths, shapes.prompt + prompt, shapes.response + response, *per_position,
        shapes.steps + _step_order(samples, rows, f), shapes.extras, no_supervision,
        vocab,
    ):  # fmt: skip
        for i, v in found:
            out[i].append(v)
    row_S = np.full(len(samples), -1, dtype=np.int64)
    row_S[rows] = np.arange(len(rows))
    return Checked(out, f, row_S)


def check_sample(s: RolloutState, *, require_reward: bool = True) -> list[Violation]:
    """Every section-4 violation of one sample (invariants 1-6, 8)."""
    return check_samples([s], require_reward=require_reward).violations[0]


def check_group_identity(group: Sequence[RolloutState]) -> list[Violation]:
    """Invariant 7: members share group_id and task_name."""
    out: list[Violation] = []
    if not group:
        return out
    first = group[0]
    for s in group[1:]:
        if s.group_id != first.group_id:
            msg = f"{s.group_id!r} differs from the group's {first.group_id!r}"
            out.append(Violation(s.rollout_id, "group_id", msg, 7))
        if s.task_name != first.task_name:
            msg = f"{s.task_name!r} differs from the group's {first.task_name!r}"
            out.append(Violation(s.rollout_id, "task_name", msg, 7))
    return out


def group_violations(
    group: Sequence[RolloutState], members: Sequence[list[Violation]]
) -> list[Violation]:
    """All violations of a group: shared identity, then each member's duplicate id and
    its own violations ``members`` (from ``check_samples``)."""
    out = check_group_identity(group)
    seen: set[str] = set()
    for s, found in zip(group, members, strict=True):
        if s.rollout_id in seen:
            out.append(Violation(s.rollout_id, "rollout_id", "duplicate rollout_id", 7))
        seen.add(s.rollout_id)
        out.extend(found)
    return out


def check_group(group: Sequence[RolloutState], *, require_reward: bool = True) -> list[Violation]:
    """All violations of a group: each member, shared identity, unique ids."""
    return group_violations(group, check_samples(group, require_reward=require_reward).violations)


def errors(violations: Sequence[Violation]) -> list[Violation]:
    return [v for v in violations if v.severity == Severity.ERROR]
