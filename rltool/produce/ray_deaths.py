"""Why a Ray rollout worker died, in one line: what the run's report says about it."""

from __future__ import annotations

import re

from ray.exceptions import RayTaskError

MAX_REASON_CHARS = 240
# Ray's account of a process that vanished: "... Worker exit type: SYSTEM_ERROR Worker exit
# detail: Worker unexpectedly exits with ... Some common causes include: (1) ..."
_EXIT = re.compile(r"Worker exit type: (\w+) Worker exit detail: (.*?)\s*(?:Some common causes|$)")


def death_reason(err: BaseException) -> str:
    """Ray's death message in one line: what happened and why (its first and last lines)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    reason = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    # a crashed process's last line goes on to list common causes: keep the start
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def exit_reason(err: BaseException) -> str:
    """What ended a worker, in a few words: Ray's exit type and detail when it gives them,
    else the last line of its message (e.g. "it was killed by `ray.kill`")."""
    found = _EXIT.search(" ".join(str(err).split()))
    if found is None:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        last = lines[-1].removeprefix("The actor is dead because ") if lines else ""
        return last.rstrip(".")[:MAX_REASON_CHARS] or type(err).__name__
    kind, detail = found.groups()
    if kind == "SYSTEM_ERROR":  # kill -9, the kernel's OOM killer, a segfault: Ray cannot tell
        return f"killed or crashed (Ray: {detail})"
    return f"{kind} (Ray: {detail})"


def task_error(err: RayTaskError) -> str:
    """The exception a remote call raised, as ``Type: message`` (Ray's wrapper dropped)."""
    cause = getattr(err, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else death_reason(err)
