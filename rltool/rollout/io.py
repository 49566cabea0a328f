"""Rollout files: JSON Lines, one ``RolloutState`` per line, streamed.

A rollout file is written **group by group**: all samples of one prompt group
(same ``group_id``) sit on consecutive lines, because producers append a group
once all its samples are done. ``iter_groups`` relies on that and refuses a
file where a group reappears after another one started, rather than silently
training it as two groups. Blank lines are skipped; line numbers are 1-based
and count every physical line, so they match an editor's.

Files are never loaded whole: ``iter_rollouts`` reads one line at a time, so
memory stays bounded by the longest line, whatever the file size.

Lines written by other frameworks may carry fields rltool does not define (xtuner's
``response_mask``, verl's ``uid``): those are kept aside in ``extra``
(``rltool.rollout.foreign``) and reported once per field name and file.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from rltool.rollout.foreign import ForeignFieldError, describe_foreign, split_foreign
from rltool.rollout.state import RolloutState

# (line number, field name, the sample) for the first line of a file with that field
ForeignFn = Callable[[int, str, RolloutState], None]

_MAX_ERRORS_SHOWN = 3  # pydantic errors quoted per bad line; the rest are counted
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def not_a_file_reason(mode: int) -> str | None:
    """Why a file of this ``st_mode`` cannot be a rollout file (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "special file")
    return f"is {kind}, not a regular file"


def open_rollout_file(path: Path) -> BinaryIO:
    """Open a regular file for reading, never blocking: a FIFO, socket or device is an
    OSError saying what it is, found without waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        reason = not_a_file_reason(os.fstat(fd).st_mode)
        if reason is not None:
            raise OSError(f"{path}: {reason}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True, slots=True)
class LineError:
    """A line that is not valid JSON or not a RolloutState."""

    path: Path
    line_no: int  # 1-based physical line number
    message: str  # pydantic's errors, summarised with the field named
    field: str | None = None  # location of the first error ("prompt_ids", "reward.score")
    position: int | None = None  # list index of the first error in that field, if any
    rollout_id: str | None = None  # when the line is a JSON object with a str or int rollout_id

    def __str__(self) -> str:
        return f"{self.path}:{self.line_no}: {self.message}"


def _loc(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _field_position(loc: tuple[str | int, ...]) -> tuple[str, int | None]:
    """("prompt_ids", 3) from ("prompt_ids", 3); deeper locations stay dotted."""
    if len(loc) == 2 and isinstance(loc[1], int):
        return str(loc[0]), loc[1]
    return _loc(loc), None


def _summarise(err: ValidationError) -> tuple[str, str | None, int | None]:
    """(message, field, position) of a pydantic error, compact enough for one line."""
    details = err.errors(include_url=False, include_input=False)
    first = details[0]
    if first["type"] == "json_invalid":
        # pydantic sees one line as a whole document: its "line 1" is noise here
        reason = first["ctx"]["error"].replace(" at line 1 column ", " at column ")
        return f"not valid JSON: {reason}", None, None
    if not first["loc"]:
        return f"not a RolloutState: {first['msg']}", None, None
    parts = [f"{_loc(d['loc'])}: {d['msg']}" for d in details[:_MAX_ERRORS_SHOWN]]
    more = len(details) - _MAX_ERRORS_SHOWN
    if more > 0:
        parts.append(f"... {more} more")
    return "not a RolloutState: " + "; ".join(parts), *_field_position(first["loc"])


def _utf8_problem(line: bytes) -> tuple[str, None, None] | None:
    """A line that is not UTF-8 named by its first bad byte (error path only): pydantic
    reads it as JSON with an "invalid unicode code point" or "expected value"."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line[exc.start]
        return f"not valid UTF-8: byte 0x{bad:02x} at byte {exc.start + 1} of the line", None, None
    return None


def _rollout_id_of(line: bytes) -> str | None:
    """Best-effort rollout_id of a line that failed validation (error path only)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    rid = obj.get("rollout_id") if isinstance(obj, dict) else None
    return str(rid) if isinstance(rid, str) or type(rid) is int else None


def parse_line(line: bytes | str) -> tuple[RolloutState, list[str]]:
    """One line as a sample, and the names of the fields it carried that rltool does not
    define (moved into ``extra``). Raises pydantic's ValidationError or ForeignFieldError."""
    try:
        return RolloutState.from_json(line), []
    except ValidationError as err:
        if not any(e["type"] == "extra_forbidden" and len(e["loc"]) == 1 for e in err.errors()):
            raise
    obj = json.loads(line)  # an object: pydantic found unknown keys at its top level
    names = split_foreign(obj)
    return RolloutState.model_validate(obj), names


def iter_rollouts(
    path: str | Path,
    *,
    on_bytes: Callable[[int], None] | None = None,
    on_foreign: ForeignFn | None = None,
) -> Iterator[tuple[int, RolloutState | LineError]]:
    """Yield ``(line_no, sample_or_error)`` for every non-blank line of a JSONL file.

    A bad line yields a ``LineError`` and reading goes on, so a validator can
    report every bad line. ``on_bytes`` is called with the byte length of each
    physical line read (progress reporting). A field rltool does not define is kept
    in the sample's ``extra``; ``on_foreign`` is called for the first line of the file
    that carries it (default: a ``ForeignFieldWarning``). OSError from opening or
    reading propagates, a FIFO or another special file included (it is never read).
    """
    path = Path(path)
    seen: set[str] = set()
    with open_rollout_file(path) as f:
        for line_no, line in enumerate(f, start=1):
            if on_bytes is not None:
                on_bytes(len(line))
            line = line.rstrip(b"\r\n")  # so a line cut mid-string reads as cut, not as "\n"
            if not line.strip():
                continue
            try:
                sample, foreign = parse_line(line)
            except ValidationError as err:
                message, field, position = _utf8_problem(line) or _summarise(err)
                rid = _rollout_id_of(line)
                yield line_no, LineError(path, line_no, message, field, position, rid)
                continue
            except ForeignFieldError as err:
                rid = _rollout_id_of(line)
                yield (
                    line_no,
                    LineError(path, line_no, f"not a RolloutState: {err}", "extra", None, rid),
                )
                continue
            for name in foreign:
                if name not in seen:
                    seen.add(name)
                    (on_foreign or _warn_foreign(path))(line_no, name, sample)
            yield line_no, sample


class ForeignFieldWarning(UserWarning):
    """A rollout line carried a field rltool does not define (kept in ``extra``)."""


def _warn_foreign(path: Path) -> ForeignFn:
    def warn(line_no: int, name: str, sample: RolloutState) -> None:
        message = f"{path}:{line_no}: {describe_foreign(name)}"
        warnings.warn(message, ForeignFieldWarning, stacklevel=2)

    return warn


def iter_samples(
    path: str | Path, *, on_foreign: ForeignFn | None = None
) -> Iterator[tuple[int, RolloutState]]:
    """Like ``iter_rollouts`` but a bad line raises ValueError naming file and line."""
    for line_no, item in iter_rollouts(path, on_foreign=on_foreign):
        if isinstance(item, LineError):
            raise ValueError(
                f"{item}; run `rltool validate-rollouts {item.path}` for a full report"
            )
        yield line_no, item


def iter_groups(
    path: str | Path, *, on_foreign: ForeignFn | None = None
) -> Iterator[list[RolloutState]]:
    """Yield each group of a rollout file: a run of consecutive samples sharing ``group_id``.

    Raises ValueError on a bad line, or when a group_id reappears after another
    group started (the file was not written group by group), naming the line.
    """
    path = Path(path)
    closed: dict[str, int] = {}  # group_id -> first line, for groups already yielded
    group: list[RolloutState] = []
    start = 0
    for line_no, sample in iter_samples(path, on_foreign=on_foreign):
        if group and sample.group_id == group[0].group_id:
            group.append(sample)
            continue
        if group:
            closed[group[0].group_id] = start
            yield group
        if sample.group_id in closed:
            raise ValueError(
                f"{path}:{line_no}: group_id {sample.group_id!r} reappears after other groups "
                f"(it started at line {closed[sample.group_id]}); rollout files must be "
                "written group by group"
            )
        group, start = [sample], line_no
    if group:
        yield group


def read_groups(
    path: str | Path, *, on_foreign: ForeignFn | None = None
) -> list[list[RolloutState]]:
    """All groups of a small rollout file (see ``iter_groups``), in file order."""
    return list(iter_groups(path, on_foreign=on_foreign))


def write_rollouts(path: str | Path, states: Iterable[RolloutState]) -> int:
    """Append samples to a JSONL file, one per line; creates parent dirs. Returns the count.

    Write a whole group in one call to keep the file group by group.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a", encoding="utf-8") as f:
        for state in states:
            f.write(state.to_json())
            f.write("\n")
            n += 1
    return n
