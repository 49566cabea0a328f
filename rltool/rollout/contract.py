"""The invariants of data-contract section 4, checked with the field named.

``check_sample`` covers invariants 1-6 and 8 for one sample; ``check_group``
adds invariant 7 across a group. Both return every violation they find (never
raise), so that ``validate-rollouts`` reports them all and the controller can
skip a group with the reason. Per-position checks are vectorised with numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status

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

    def __str__(self) -> str:
        where = f"{self.field}[{self.position}]" if self.position is not None else self.field
        return f"{self.rollout_id}: {where}: {self.message} (invariant {self.invariant})"


def _first(mask: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _check_lengths(s: RolloutState, out: list[Violation]) -> bool:
    """Invariant 1. Returns whether per-position checks can go on."""
    rid = s.rollout_id
    if s.input_ids is None:
        out.append(Violation(rid, "input_ids", "missing (canonical train fields not built)", 1))
        return False
    if s.labels is None:
        out.append(Violation(rid, "labels", "missing (canonical train fields not built)", 1))
        return False
    t = len(s.input_ids)
    ok = True
    if t < 2:
        out.append(Violation(rid, "input_ids", f"length {t}, need at least 2", 1))
        ok = False
    if len(s.labels) != t:
        out.append(Violation(rid, "labels", f"length {len(s.labels)} != len(input_ids) {t}", 1))
        ok = False
    if s.logprobs is not None and len(s.logprobs) != t:
        msg = f"length {len(s.logprobs)} != len(input_ids) {t}"
        out.append(Violation(rid, "logprobs", msg, 1))
        ok = False
    return ok


def _check_prompt_response(s: RolloutState, ids: np.ndarray, out: list[Violation]) -> None:
    """Invariant 2: input_ids = prompt_ids + response_ids."""
    rid, p = s.rollout_id, len(s.prompt_ids)
    prompt = np.asarray(s.prompt_ids, dtype=np.int64)
    if p > ids.size:
        out.append(Violation(rid, "prompt_ids", f"length {p} > len(input_ids) {ids.size}", 2))
        return
    bad = _first(ids[:p] != prompt)
    if bad is not None:
        msg = f"input_ids[{bad}]={ids[bad]} but prompt_ids[{bad}]={prompt[bad]}"
        out.append(Violation(rid, "prompt_ids", msg, 2, bad))
    if s.response_ids is None:
        out.append(Violation(rid, "response_ids", "missing", 2))
        return
    resp = np.asarray(s.response_ids, dtype=np.int64)
    if resp.size != ids.size - p:
        msg = f"length {resp.size} != len(input_ids) - len(prompt_ids) = {ids.size - p}"
        out.append(Violation(rid, "response_ids", msg, 2))
        return
    bad = _first(ids[p:] != resp)
    if bad is not None:
        msg = f"response_ids[{bad}]={resp[bad]} but input_ids[{p + bad}]={ids[p + bad]}"
        out.append(Violation(rid, "response_ids", msg, 2, bad))


def _check_labels(
    s: RolloutState, ids: np.ndarray, labels: np.ndarray, out: list[Violation]
) -> None:
    """Invariant 3: labels are -100 or the input id; -100 inside the prompt."""
    rid = s.rollout_id
    bad = _first((labels != IGNORE_INDEX) & (labels != ids))
    if bad is not None:
        msg = f"label {labels[bad]} is neither -100 nor input_ids[{bad}]={ids[bad]}"
        out.append(Violation(rid, "labels", msg, 3, bad))
    p = min(len(s.prompt_ids), labels.size)
    bad = _first(labels[:p] != IGNORE_INDEX)
    if bad is not None:
        msg = f"prompt position supervised (label {labels[bad]}); prompt labels must be -100"
        out.append(Violation(rid, "labels", msg, 3, bad))


def _check_logprobs(s: RolloutState, labels: np.ndarray, out: list[Violation]) -> None:
    """Invariant 4: finite; <= 0 where supervised; exactly 0.0 elsewhere."""
    rid = s.rollout_id
    lp = np.asarray(s.logprobs, dtype=np.float64)
    bad = _first(~np.isfinite(lp))
    if bad is not None:
        out.append(Violation(rid, "logprobs", f"not finite ({lp[bad]})", 4, bad))
        return
    supervised = labels != IGNORE_INDEX
    bad = _first(supervised & (lp > LOGPROB_TOLERANCE))
    if bad is not None:
        msg = f"logprob {lp[bad]:.6g} > 0 at a supervised position"
        out.append(Violation(rid, "logprobs", msg, 4, bad))
    bad = _first(~supervised & (lp != 0.0))
    if bad is not None:
        msg = f"logprob {lp[bad]:.6g} at an unsupervised position, must be 0.0"
        out.append(Violation(rid, "logprobs", msg, 4, bad))


def _check_model_steps(s: RolloutState, n_response: int, out: list[Violation]) -> None:
    """Invariant 5: one version per response token, never decreasing."""
    if s.response_model_steps is None:
        return
    rid, steps = s.rollout_id, np.asarray(s.response_model_steps, dtype=np.int64)
    if steps.size != n_response:
        msg = f"length {steps.size} != number of response tokens {n_response}"
        out.append(Violation(rid, "response_model_steps", msg, 5))
        return
    bad = _first(np.diff(steps) < 0)
    if bad is not None:
        msg = f"decreases from {steps[bad]} to {steps[bad + 1]}"
        out.append(Violation(rid, "response_model_steps", msg, 5, bad + 1))


def _check_reward(s: RolloutState, out: list[Violation]) -> None:
    """Invariant 6: a COMPLETED sample has a reward with a finite score."""
    if s.status != Status.COMPLETED:
        return
    score = None if s.reward is None else s.reward.get("score")
    if score is None:
        out.append(Violation(s.rollout_id, "reward.score", "missing on a COMPLETED sample", 6))
    elif not isinstance(score, int | float) or not math.isfinite(score):
        out.append(Violation(s.rollout_id, "reward.score", f"not a finite number ({score!r})", 6))


def _check_extras(s: RolloutState, t: int, out: list[Violation]) -> None:
    """Per-position extras have one entry per position of input_ids."""
    rid = s.rollout_id
    if s.routed_experts is not None and len(s.routed_experts) != t:
        msg = f"length {len(s.routed_experts)} != len(input_ids) {t}"
        out.append(Violation(rid, "routed_experts", msg, 1))
    tt = s.teacher_targets
    if tt is not None:
        for name, rows in (("token_ids", tt.token_ids), ("logprobs", tt.logprobs)):
            if len(rows) != t:
                msg = f"length {len(rows)} != len(input_ids) {t}"
                out.append(Violation(rid, f"teacher_targets.{name}", msg, 1))


def check_sample(s: RolloutState, *, require_reward: bool = True) -> list[Violation]:
    """Every section-4 violation of one sample (invariants 1-6, 8)."""
    out: list[Violation] = []
    if require_reward:
        _check_reward(s, out)
    if not _check_lengths(s, out):
        return out
    ids = np.asarray(s.input_ids, dtype=np.int64)  # [T]
    labels = np.asarray(s.labels, dtype=np.int64)  # [T]
    _check_prompt_response(s, ids, out)
    _check_labels(s, ids, labels, out)
    if s.logprobs is not None:
        _check_logprobs(s, labels, out)
    _check_model_steps(s, ids.size - len(s.prompt_ids), out)
    _check_extras(s, ids.size, out)
    if s.status == Status.COMPLETED and not np.any(labels != IGNORE_INDEX):
        msg = "COMPLETED sample has no supervised token"
        out.append(Violation(s.rollout_id, "labels", msg, 8, severity=Severity.WARNING))
    return out


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


def check_group(group: Sequence[RolloutState], *, require_reward: bool = True) -> list[Violation]:
    """All violations of a group: each member, shared identity, unique ids."""
    out = check_group_identity(group)
    seen: set[str] = set()
    for s in group:
        if s.rollout_id in seen:
            out.append(Violation(s.rollout_id, "rollout_id", "duplicate rollout_id", 7))
        seen.add(s.rollout_id)
        out.extend(check_sample(s, require_reward=require_reward))
    return out


def errors(violations: Sequence[Violation]) -> list[Violation]:
    return [v for v in violations if v.severity == Severity.ERROR]
