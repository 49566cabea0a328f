"""RolloutState: one sampled trajectory (or one trainable segment of it).

The record every part of rltool agrees on; see ``shared/design/data-contract.md``.
Shape legend used in comments: T = len(input_ids) (full sequence, unshifted),
P = len(prompt_ids), R = len(response_ids) = T - P, K = top-k width.

Pydantic validates *types* only (a line that is not a RolloutState at all is a
parse error); the semantic invariants of section 4 live in
``rltool.rollout.contract`` so that ``validate-rollouts`` can name every
violation instead of refusing the sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

IGNORE_INDEX = -100  # label of a position that is not supervised


class Status(StrEnum):
    INIT = "INIT"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"
    EXPIRED = "EXPIRED"
    FAILED = "FAILED"
    FILTERED = "FILTERED"


# A group is COMPLETED only if every member is; otherwise the first of these.
_GROUP_PRECEDENCE = (Status.FAILED, Status.ABORTED, Status.EXPIRED, Status.FILTERED)


def group_status(statuses: Iterable[Status]) -> Status:
    """Status of a group from its members' statuses (contract section 2)."""
    present = set(statuses)
    if not present:
        raise ValueError("group_status of an empty group")
    if present == {Status.COMPLETED}:
        return Status.COMPLETED
    for status in _GROUP_PRECEDENCE:
        if status in present:
            return status
    return Status.INIT


class TeacherTargets(BaseModel):
    """Per-position teacher signal for on-policy distillation, unshifted.

    ``kind == "topk"``: the teacher's top-K token ids and logprobs per position.
    ``kind == "sampled"``: K == 1, the teacher's logprob of the token at that
    position (token_ids repeats input_ids). Unsupervised positions hold anything;
    they are masked by labels like every other per-position field.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["topk", "sampled"]
    token_ids: list[list[int]]  # [T, K]
    logprobs: list[list[float]]  # [T, K]


class RolloutState(BaseModel):
    """One sample. Field names and meanings are exactly the data contract's."""

    # NaN/Infinity survive a JSONL round trip, so validate-rollouts can name them
    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, ser_json_inf_nan="constants"
    )

    # identity
    rollout_id: str
    group_id: str
    session_id: str | None = None  # segments of one agentic session share it
    task_name: str = "default"
    agent_loop: str | None = None  # informational only

    # generation inputs and outputs
    messages: list[dict[str, Any]] | None = None
    prompt_ids: list[int]  # [P]
    response_ids: list[int] | None = None  # [R] = input_ids[P:], env tokens included
    response_text: str | None = None
    finish_reason: str | None = None
    reward: dict[str, Any] | None = None  # must hold a finite "score" when COMPLETED
    status: Status = Status.INIT
    error: str | None = None
    extra: dict[str, Any] | None = None

    # canonical train fields: unshifted, full sequence
    input_ids: list[int] | None = None  # [T]
    labels: list[int] | None = None  # [T], -100 = not supervised
    logprobs: list[float] | None = None  # [T], 0.0 where not supervised
    response_model_steps: list[int] | None = None  # [R], policy version per token
    routed_experts: list[list[int]] | None = None  # [T, K] MoE router choices
    teacher_targets: TeacherTargets | None = None

    def to_json(self) -> str:
        """One JSON Lines record; absent optional fields are left out."""
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_json(cls, line: str | bytes) -> RolloutState:
        return cls.model_validate_json(line)

    def fail(self, error: str) -> RolloutState:
        """Mark this sample FAILED with a reason; the failure stays inside it."""
        self.status = Status.FAILED
        self.error = error
        return self

    @property
    def score(self) -> float | None:
        return None if self.reward is None else self.reward.get("score")
