"""Check rollout files against every invariant of data-contract section 4.

``validate_files`` streams each file (``iter_rollouts``), checks its samples a
batch at a time with ``check_samples`` (invariants 1-6, 8; a batch holds at most
``BATCH_TOKENS`` tokens) and checks invariant 7 across the whole input: the
members of a group are all samples with the same ``group_id``, wherever they
sit, and must share ``task_name``; ``rollout_id``s are unique across all files.
Memory grows with the number of distinct ids and groups (one small entry each)
and one batch, never with file size.

A non-COMPLETED sample without train fields is the contract's record of a
failed build (section 3), so it is a warning, not an error; a non-COMPLETED
sample *with* train fields is checked like any other. A field rltool does not
define (another framework's) is a warning once per field name across the input;
a ``response_mask`` among them must agree with the labels (``rollout.foreign``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rltool.rollout.contract import check_samples
from rltool.rollout.foreign import check_response_mask, describe_foreign
from rltool.rollout.io import LineError, iter_rollouts, not_a_file_reason, open_rollout_file
from rltool.rollout.state import RolloutState, Status
from rltool.rollout.violation import Severity, Violation

ProgressFn = Callable[[int], None]  # called with bytes read since the last call
NO_SAMPLES = "no samples"  # the finding of a file without a single non-blank line (line 0)
BATCH_TOKENS = 1 << 20  # input_ids of the samples checked together, at most (one may exceed)


class InputError(ValueError):
    """The input cannot be checked at all (missing, a directory or FIFO, unreadable)."""


@dataclass(frozen=True, slots=True)
class FileViolation:
    """One finding, located in a file. ``invariant`` is None for an unparsable line or a
    field rltool does not define."""

    file: str
    line: int
    rollout_id: str | None
    field: str | None
    position: int | None
    invariant: int | None
    severity: Severity
    message: str

    @classmethod
    def of(cls, file: Path, line: int, v: Violation) -> FileViolation:
        return cls(
            str(file), line, v.rollout_id, v.field, v.position, v.invariant, v.severity, v.message
        )

    @classmethod
    def of_line_error(cls, e: LineError) -> FileViolation:
        return cls(
            str(e.path),
            e.line_no,
            e.rollout_id,
            e.field,
            e.position,
            None,
            Severity.ERROR,
            e.message,
        )

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["severity"] = str(self.severity)
        return d


@dataclass(slots=True)
class ValidationReport:
    files: int = 0
    samples: int = 0  # lines parsed as a RolloutState
    groups: int = 0  # distinct group_ids
    violations: list[FileViolation] = field(default_factory=list)  # in file/line order

    @property
    def errors(self) -> int:
        return sum(v.severity == Severity.ERROR for v in self.violations)

    @property
    def warnings(self) -> int:
        return sum(v.severity == Severity.WARNING for v in self.violations)

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed)."""
        return self.errors == 0

    def to_dict(self) -> dict[str, object]:
        return {
            "files": self.files,
            "samples": self.samples,
            "groups": self.groups,
            "errors": self.errors,
            "warnings": self.warnings,
            "violations": [v.to_dict() for v in self.violations],
        }


@dataclass(slots=True)
class _Group:
    task_name: str
    file: int  # index of the file and line where the group was first seen
    line: int
    last_file: int  # file of the group's latest run, to spot non-contiguous groups


@dataclass(slots=True)
class _Checker:
    """Cross-sample state of one validation: invariant 7 and file contiguity."""

    paths: Sequence[Path]
    report: ValidationReport
    seen_ids: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (file, line)
    groups: dict[str, _Group] = field(default_factory=dict)
    prev_group: str | None = None  # group_id of the previous sample in the current file
    pending: list[tuple[int, int, RolloutState]] = field(default_factory=list)  # unchecked
    pending_tokens: int = 0
    num_experts: int | None = None  # routed_experts ids must be below it (when known)
    vocab_size: int | None = None  # token ids must be below it (when known)
    foreign: set[str] = field(default_factory=set)  # foreign field names already reported

    def add(self, file_idx: int, line: int, s: RolloutState) -> None:
        """Queue a sample; check the queue once it holds ``BATCH_TOKENS`` tokens."""
        self.pending.append((file_idx, line, s))
        self.pending_tokens += 0 if s.input_ids is None else len(s.input_ids)
        if self.pending_tokens >= BATCH_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Check the queued samples together, then record their findings in line order."""
        samples = [s for _, _, s in self.pending]
        found = check_samples(
            samples, num_experts=self.num_experts, vocab_size=self.vocab_size
        ).violations
        for (file_idx, line, s), violations in zip(self.pending, found, strict=True):
            self._record(file_idx, line, s, violations)
        self.pending, self.pending_tokens = [], 0

    def _record(self, file_idx: int, line: int, s: RolloutState, found: list[Violation]) -> None:
        path, out = self.paths[file_idx], self.report.violations
        self.report.samples += 1
        if s.status != Status.COMPLETED and s.input_ids is None:
            # Contract section 3: a sample whose fields could not be built is marked
            # FAILED (or was never finished) and the controller skips its group; its
            # absent train fields are the prescribed record, not corrupt data.
            msg = f"no train fields on a {s.status} sample" + (f" ({s.error})" if s.error else "")
            self._emit(file_idx, line, s, "input_ids", msg, Severity.WARNING, invariant=1)
        else:
            found = [*found, *check_response_mask(s)]
            out.extend(FileViolation.of(path, line, v) for v in found)
        first = self.seen_ids.setdefault(s.rollout_id, (file_idx, line))
        if first != (file_idx, line):
            msg = f"duplicate rollout_id, first at {self._where(*first)}"
            self._emit(file_idx, line, s, "rollout_id", msg)
        self._check_group(file_idx, line, s)

    def add_foreign(self, file_idx: int, line: int, name: str, s: RolloutState) -> None:
        """A warning for the first line (of the whole input) carrying a foreign field."""
        if name in self.foreign:
            return
        self.foreign.add(name)
        self.flush()  # findings stay in line order
        path = str(self.paths[file_idx])
        self.report.violations.append(
            FileViolation(
                path, line, s.rollout_id, name, None, None, Severity.WARNING, describe_foreign(name)
            )
        )

    def _check_group(self, file_idx: int, line: int, s: RolloutState) -> None:
        g = self.groups.get(s.group_id)
        if g is None:
            self.groups[s.group_id] = _Group(s.task_name, file_idx, line, file_idx)
            self.prev_group = s.group_id
            return
        if s.task_name != g.task_name:
            msg = (
                f"{s.task_name!r} differs from {g.task_name!r} of group {s.group_id!r} "
                f"(first member at {self._where(g.file, g.line)})"
            )
            self._emit(file_idx, line, s, "task_name", msg)
        if g.last_file == file_idx and self.prev_group != s.group_id:
            msg = (
                f"group {s.group_id!r} is not contiguous (first member at "
                f"{self._where(g.file, g.line)}); iter_groups/read_groups refuse files that "
                "are not written group by group"
            )
            self._emit(file_idx, line, s, "group_id", msg, Severity.WARNING)
        g.last_file = file_idx
        self.prev_group = s.group_id

    def _emit(
        self,
        file_idx: int,
        line: int,
        s: RolloutState,
        field_name: str,
        msg: str,
        severity: Severity = Severity.ERROR,
        invariant: int = 7,
    ) -> None:
        path = str(self.paths[file_idx])
        v = FileViolation(path, line, s.rollout_id, field_name, None, invariant, severity, msg)
        self.report.violations.append(v)

    def _where(self, file_idx: int, line: int) -> str:
        return f"{self.paths[file_idx]}:{line}"


def check_readable(paths: Sequence[str | Path]) -> list[Path]:
    """The paths as Paths; InputError naming the first that is missing, not a file or unreadable.

    Checked up front so that a bad path fails before any report is printed.
    """
    out = [Path(p) for p in paths]
    if not out:
        raise InputError("no rollout file given")
    for p in out:
        if not p.exists():
            raise InputError(f"{p}: no such file")
        reason = not_a_file_reason(p.stat().st_mode)
        if reason is not None:
            raise InputError(f"{p}: {reason} (give JSONL rollout files)")
        try:
            open_rollout_file(p).close()
        except OSError as err:
            raise InputError(f"{p}: cannot read ({err.strerror or err})") from err
    return out


def validate_files(
    paths: Sequence[str | Path],
    *,
    progress: ProgressFn | None = None,
    num_experts: int | None = None,
    vocab_size: int | None = None,
) -> ValidationReport:
    """Check every sample of every file; every violation is collected, none raised.
    ``num_experts``: the MoE model's expert count, the bound of routed_experts' ids;
    ``vocab_size``: the model's embedding rows, the bound of token ids (without it only a
    negative id is out of range).

    A file without a non-blank line is an error ("no samples", line 0). Raises
    InputError when a file is missing, not a regular file (a directory, a FIFO), or
    cannot be read.
    """
    resolved = check_readable(paths)
    report = ValidationReport(files=len(resolved))
    checker = _Checker(resolved, report, num_experts=num_experts, vocab_size=vocab_size)
    for file_idx, path in enumerate(resolved):
        lines = 0
        try:
            on_foreign = functools.partial(checker.add_foreign, file_idx)
            for line, item in iter_rollouts(path, on_bytes=progress, on_foreign=on_foreign):
                lines += 1
                if isinstance(item, LineError):
                    checker.flush()  # findings stay in line order
                    report.violations.append(FileViolation.of_line_error(item))
                else:
                    checker.add(file_idx, line, item)
        except OSError as err:
            raise InputError(f"{path}: cannot read ({err.strerror or err})") from err
        checker.flush()
        checker.prev_group = None
        if lines == 0:  # empty or blank lines only: nothing was checked, nothing to train
            empty = FileViolation(str(path), 0, None, None, None, None, Severity.ERROR, NO_SAMPLES)
            report.violations.append(empty)
    report.groups = len(checker.groups)
    return report
