"""A violation of the data contract (section 4), as every check reports it.

``Violation`` names the sample, the field, the invariant and the first offending position;
its ``reason`` is the short failure reason without the sample (rollout/failures.py).
``Severity`` says whether it fails the sample (an error) or is only reported (a warning).
The checks that make them are ``rltool.rollout.contract`` and
``rltool.rollout.position_checks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


Found = list[tuple[int, Violation]]  # (sample index, violation) of one check
