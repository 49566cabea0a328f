"""The invariants of data-contract section 4, checked on many samples at once.

``check_samples`` checks invariants 1-6, 8 and 10 of every sample on their token fields
concatenated once (``rltool.rollout.fields``): numpy over all positions together,
a Python loop over samples only, and every violation names its sample, field and
first offending position. ``check_sample`` is the one-sample case, ``check_group``
adds invariant 7 across a group. None of them raises: ``validate-rollouts`` reports
every violation, an agent loop fails the sample, the conversion skips its group.
The per-position rules (invariants 2-5) are ``rltool.rollout.position_checks``; the
``Violation`` record is ``rltool.rollout.violation`` (still importable from here).

Shape legend: S = samples, F = their positions concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rltool.rollout.fields import TokenFields, concat_fields
from rltool.rollout.position_checks import Scan, position_checks, step_order
from rltool.rollout.routing import ROUTING_INVARIANT, routing_problems
from rltool.rollout.state import RolloutState, Status
from rltool.rollout.violation import Found, Severity, Violation
from rltool.rollout.vocab import VOCAB_INVARIANT, VOCAB_KIND, vocab_problems


@dataclass(frozen=True, slots=True)
class Checked:
    """What ``check_samples`` found."""

    violations: list[list[Violation]]  # [S] each sample's, in check_sample's order
    fields: TokenFields  # the samples whose lengths allow per-position checks
    row_S: np.ndarray  # [S] each sample's index in ``fields``; -1 when not there


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

    prompt: Found  # invariant 2: prompt longer than input_ids
    response: Found  # invariant 2: response_ids missing or of the wrong length
    steps: Found  # invariant 5: one model step per response token
    extras: Found  # per-position extras: one entry per position
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
    reward: Found = []
    lengths: Found = []
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
    scan = Scan(shapes.expected, np.empty(n, dtype=bool), np.empty(n, dtype=bool))
    f = concat_fields(checkable, shapes.with_steps, scan)
    prompt, response, *per_position = position_checks(samples, rows, f, scan)
    supervised_S = f.prompt_supervised_S + f.response_supervised_S  # [rows]
    no_supervision: Found = [
        (i, Violation(s.rollout_id, "labels", "COMPLETED sample has no supervised token", 8,
                      severity=Severity.WARNING))
        for i, s, n in zip(rows, checkable, supervised_S.tolist(), strict=True)
        if s.status == Status.COMPLETED and n == 0
    ]  # fmt: skip
    vocab: Found = [  # input_ids holds prompt_ids and response_ids (invariant 2)
        (rows[r], Violation(samples[rows[r]].rollout_id, "input_ids", msg, VOCAB_INVARIANT, at,
                            kind=VOCAB_KIND))
        for r, at, msg in vocab_problems(f.input_ids_F, f.start_S, vocab_size)
    ]  # fmt: skip
    out: list[list[Violation]] = [[] for _ in samples]
    for found in (
        reward, lengths, shapes.prompt + prompt, shapes.response + response, *per_position,
        shapes.steps + step_order(samples, rows, f), shapes.extras, no_supervision,
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
