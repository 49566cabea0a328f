"""RolloutState: one sampled trajectory (or one trainable segment of it).

The record every part of rltool agrees on; see ``shared/design/data-contract.md``.
Shape legend used in comments: T = len(input_ids) (full sequence, unshifted),
P = len(prompt_ids), R = len(response_ids) = T - P, K = top-k width,
L = MoE layers.

Token fields are numpy arrays in the program (int64 ids, labels and steps, float64
logprobs) and lists only in JSON: validation converts a list or an array in one
C-level step, serialization writes lists. Pydantic validates *types* only (a line
that is not a RolloutState at all is a parse error); the semantic invariants of
section 4 live in ``rltool.rollout.contract`` so that ``validate-rollouts`` can
name every violation instead of refusing the sample.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, GetCoreSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

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


class _ArrayOf:
    """Pydantic type of a token field: a numpy array of ``dtype`` with ``ndim`` axes,
    validated from a list or an array, written to JSON as (nested) lists."""

    def __init__(self, dtype: type, ndim: int) -> None:
        self.dtype, self.ndim = np.dtype(dtype), ndim
        # kinds taken as they are (a float field takes ints; an int field never floats)
        self.kinds = "iu" if self.dtype.kind == "i" else "iuf"

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        item: type = int if self.dtype.kind == "i" else float
        nested: Any = item
        for _ in range(self.ndim):
            nested = list[nested]
        lists = handler.generate_schema(nested)
        return core_schema.no_info_wrap_validator_function(
            self._validate,
            lists,
            serialization=core_schema.plain_serializer_function_ser_schema(
                _tolist, return_schema=lists
            ),
        )

    def _validate(self, value: Any, lists: core_schema.ValidatorFunctionWrapHandler) -> np.ndarray:
        """One C-level conversion of a list or an array (always a new array, ours alone);
        anything else, or values an array cannot hold as they are, goes through pydantic's
        list validation, whose errors name the offending item."""
        fast = None
        if isinstance(value, np.ndarray):
            fast = value
        elif type(value) is list:
            try:
                fast = np.array(value)
            except (ValueError, OverflowError):  # ragged, or ints beyond 64 bits
                fast = None
        if fast is not None and fast.ndim == self.ndim:
            if fast.dtype.kind in self.kinds and (fast.dtype.kind != "u" or _fits(fast)):
                return fast.astype(self.dtype, copy=fast is value)
            if fast.size == 0:
                return np.zeros(fast.shape, dtype=self.dtype)
        if isinstance(value, np.ndarray):
            value = value.tolist()
        items = lists(value)  # raises pydantic's own errors, with the item's position
        try:
            out = np.array(items, dtype=self.dtype)
        except OverflowError as exc:
            raise PydanticCustomError("int64", "a value does not fit a 64-bit integer") from exc
        except ValueError as exc:
            raise PydanticCustomError("rows", "rows differ in width") from exc
        if out.ndim != self.ndim:  # only [] (or [[]]) for a 2-D or 3-D field: no rows, no width
            out = out.reshape((0,) * self.ndim)
        return out


def _fits(a: np.ndarray) -> bool:
    return a.size == 0 or int(a.max()) <= np.iinfo(np.int64).max


def _tolist(a: np.ndarray) -> list[Any]:
    return a.tolist()


def _id_text(value: Any) -> Any:
    """An integer id (as xtuner and many exporters write them) is held as its decimal
    string; a float, a bool or anything else is refused."""
    if type(value) is int:
        return str(value)
    if not isinstance(value, str):
        raise PydanticCustomError(
            "id_type", "must be a string or an integer, got {kind}", {"kind": _json_kind(value)}
        )
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    kinds = {bool: "a boolean", float: "a number", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


Id = Annotated[str, BeforeValidator(_id_text)]  # read as int or str, held and written as str
IntArray = Annotated[np.ndarray, _ArrayOf(np.int64, 1)]  # [N] int64
FloatArray = Annotated[np.ndarray, _ArrayOf(np.float64, 1)]  # [N] float64
IntArray2D = Annotated[np.ndarray, _ArrayOf(np.int64, 2)]  # [N, K] int64
FloatArray2D = Annotated[np.ndarray, _ArrayOf(np.float64, 2)]  # [N, K] float64
IntArray3D = Annotated[np.ndarray, _ArrayOf(np.int64, 3)]  # [N, L, K] int64


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    return bool(a == b)


class _Record(BaseModel):
    """A pydantic model with array fields: equality by value, arrays that are ours to write."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, k), getattr(other, k)) for k in type(self).model_fields)

    __hash__ = None  # type: ignore[assignment]  # mutable, like every pydantic model

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickled arrays may be read-only views of a transport buffer (Ray's are):
        copy those, so that the staleness bake can write a sample's labels in place."""
        super().__setstate__(state)
        for name, value in self.__dict__.items():
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                self.__dict__[name] = value.copy()


class TeacherTargets(_Record):
    """Per-position teacher signal for on-policy distillation, unshifted.

    ``kind == "topk"``: the teacher's top-K token ids and logprobs per position.
    ``kind == "sampled"``: K == 1, the teacher's logprob of the token at that
    position (token_ids repeats input_ids). Unsupervised positions hold anything;
    they are masked by labels like every other per-position field.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kind: Literal["topk", "sampled"]
    token_ids: IntArray2D  # [T, K]
    logprobs: FloatArray2D  # [T, K]


class RolloutState(_Record):
    """One sample. Field names and meanings are exactly the data contract's."""

    # NaN/Infinity survive a JSONL round trip, so validate-rollouts can name them;
    # an assigned token field is validated too, so it is always an array
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, ser_json_inf_nan="constants"
    )

    # identity
    rollout_id: Id
    group_id: Id
    session_id: Id | None = None  # segments of one agentic session share it
    task_name: str = "default"
    agent_loop: str | None = None  # informational only

    # generation inputs and outputs
    messages: list[dict[str, Any]] | None = None
    prompt_ids: IntArray  # [P]
    response_ids: IntArray | None = None  # [R] = input_ids[P:], env tokens included
    response_text: str | None = None
    finish_reason: str | None = None
    reward: dict[str, Any] | None = None  # must hold a finite "score" when COMPLETED
    status: Status = Status.INIT
    error: str | None = None
    extra: dict[str, Any] | None = None

    # canonical train fields: unshifted, full sequence
    input_ids: IntArray | None = None  # [T]
    labels: IntArray | None = None  # [T], -100 = not supervised
    logprobs: FloatArray | None = None  # [T], 0.0 where not supervised
    response_model_steps: IntArray | None = None  # [R], policy version per token
    # [T, L, k] MoE experts of each position per MoE layer, -1 rows where never routed
    routed_experts: IntArray3D | None = None
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
