"""The sandbox loop's task record, its hidden check files and the reward its check gives.

A task record becomes a checked ``CodingTask``; its ``check_files`` are written to a
directory the check sandbox binds read-only; a finished agent-then-check run becomes
(reward, error). The record format: docs/agent-loops.md#task-records
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool.sandbox import CheckedRun, SandboxResult, SandboxStatus

OUTPUT_TAIL_CHARS = 2000  # of each sandbox output kept in a sample


@dataclass(frozen=True, slots=True)
class CodingTask:
    """A task record's sandbox fields, checked."""

    prompt: str
    solution_file: str
    files: dict[str, str]
    check: list[str]
    check_files: dict[str, str]

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str) -> CodingTask:
        def need(key: str, ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{where}: field {key!r} must be {what}, got {record.get(key)!r}")

        files = record.get("files", {})
        check_files = record.get("check_files", {})
        check = record.get("check")
        need("question", isinstance(record.get("question"), str), "a string")
        need("solution_file", isinstance(record.get("solution_file"), str), "a relative path")
        for key, value in (("files", files), ("check_files", check_files)):
            need(key, _str_dict(value), "an object of file name -> text")
        need("check", is_argv(check), "a non-empty list of strings (argv)")
        return cls(record["question"], record["solution_file"], files, check, check_files)


def _str_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def is_argv(value: Any) -> bool:
    """A non-empty list of strings: a command line."""
    return isinstance(value, list) and bool(value) and all(isinstance(a, str) for a in value)


def _tail(text: str) -> str:
    return text[-OUTPUT_TAIL_CHARS:]


def run_summary(result: SandboxResult) -> dict[str, Any]:
    return {
        "status": str(result.status),
        "exit_code": result.exit_code,
        "reason": result.reason,
        "wall_s": round(result.wall_s, 3),
        "stdout": _tail(result.stdout),
        "stderr": _tail(result.stderr),
    }


def agent_error(agent: SandboxResult) -> str | None:
    """Why the agent's run makes the sample unusable, or None when it finished cleanly."""
    if agent.status is not SandboxStatus.OK:
        return f"agent: sandbox {agent.status}: {agent.reason}"
    if agent.exit_code != 0:
        return f"agent: exited {agent.exit_code}: {_tail(agent.stderr.strip()) or '(no stderr)'}"
    return None


def check_reward(run: CheckedRun) -> tuple[dict[str, Any] | None, str | None]:
    """(reward, error): 1.0 when the check passed; a check killed from outside is an error."""
    check = run.check
    if check.status is SandboxStatus.KILLED:
        return None, f"check: sandbox killed: {check.reason}"
    reward = {
        "score": 1.0 if run.passed else 0.0,
        "passed": run.passed,
        "check_status": str(check.status),
        "check_exit_code": check.exit_code,
        "check_reason": check.reason,
        "check_output": _tail(check.stdout + check.stderr),
    }
    return reward, None


# A Unix socket's path may not pass 107 bytes: a directory for one goes under /tmp when the
# temporary directory leaves less than this for the rest (prefix, random part, socket name).
_SOCKET_ROOM = 47
SHORT_SOCKET_PARENT = "/tmp"


@contextmanager
def temp_dir(prefix: str, *, for_socket: bool = False) -> Iterator[Path]:
    """A fresh temporary directory, removed after; ``for_socket``: one whose path leaves
    room for a Unix socket's name however long TMPDIR is."""
    parent = None
    if for_socket and len(tempfile.gettempdir()) + _SOCKET_ROOM > 107:
        parent = SHORT_SOCKET_PARENT
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def write_check_dir(root: Path, files: Mapping[str, str]) -> Path:
    """A read-only-bindable dir of the check files, readable by the sandbox uid."""
    root.chmod(0o755)
    for name, text in files.items():
        dest = root / name
        if not dest.resolve().is_relative_to(root.resolve()):
            raise ValueError(f"check_files name {name!r} must stay inside the check dir")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")
        dest.chmod(0o644)
    for d in [p for p in root.rglob("*") if p.is_dir()]:
        d.chmod(0o755)
    return root
