"""How a sandbox run ended: ``SandboxStatus`` and ``classify`` (exit, signal, stderr markers).

Design: docs/sandbox.md#resource-limits
"""

from __future__ import annotations

import signal
from enum import StrEnum

from rltool.sandbox.limits import SandboxLimits

_CLASSIFY_TAIL = 4096  # stderr bytes searched for limit markers

# Lower-case stderr markers of a failure caused by a limit (best effort: the
# kernel reports these as ordinary errors, not signals).
_NPROC_MARKERS = (
    "resource temporarily unavailable",
    "cannot fork",
    "fork: retry",
    "can't start new thread",
)
_FSIZE_MARKERS = ("file too large",)
_SPACE_MARKERS = ("no space left on device",)  # ENOSPC: the work dir's quota or a full /tmp
_OOM_MARKERS = ("memoryerror", "cannot allocate memory", "std::bad_alloc", "out of memory")


class SandboxStatus(StrEnum):
    OK = "ok"  # the command exited by itself; exit_code says how
    TIMEOUT = "timeout"  # wall clock (host) or CPU time (SIGXCPU) ran out
    KILLED = "killed"  # killed from outside (pool closed, an unexplained SIGKILL)
    OOM = "oom"  # an allocation failed against memory_bytes
    CRASHED = "crashed"  # ended by a signal that is no limit (SIGSEGV, SIGABRT, ...)
    LIMIT = "limit"  # the process, file-size or disk limit was hit


# A non-zero exit whose stderr shows one of these is put down to that limit.
_EXIT_MARKERS = (
    (_NPROC_MARKERS, SandboxStatus.LIMIT, "hitting the process limit ({limits.max_processes})"),
    (_FSIZE_MARKERS, SandboxStatus.LIMIT, "hitting the file size limit ({limits.max_file_bytes})"),
    (
        _SPACE_MARKERS,
        SandboxStatus.LIMIT,
        "running out of space (disk_bytes={limits.disk_bytes}, tmp_bytes={limits.tmp_bytes})",
    ),
    (_OOM_MARKERS, SandboxStatus.OOM, "an allocation failed (memory_bytes={limits.memory_bytes})"),
)


def classify(
    *, exit_code: int | None, killed_for: str | None, stderr: str, limits: SandboxLimits
) -> tuple[SandboxStatus, int | None, str]:
    """(status, signal, reason) of a finished sandbox run."""
    tail = stderr[-_CLASSIFY_TAIL:].lower()
    if killed_for == "timeout":
        wall = f"the wall clock of {limits.wall_clock_s} s ran out; the sandbox was killed"
        if _has(tail, _NPROC_MARKERS):
            # a fork bomb: its processes retry forking at the limit until the wall clock
            reason = f"process limit ({limits.max_processes}) reached, then {wall}"
            return SandboxStatus.LIMIT, signal.SIGKILL, reason
        return SandboxStatus.TIMEOUT, signal.SIGKILL, wall
    if killed_for is not None:
        return SandboxStatus.KILLED, signal.SIGKILL, killed_for
    if exit_code is None:
        return SandboxStatus.KILLED, None, "bwrap ended without reporting an exit (killed?)"
    if 128 < exit_code < 128 + signal.NSIG:
        return _classify_signal(exit_code - 128, tail, limits)
    if exit_code != 0:
        for markers, status, what in _EXIT_MARKERS:
            if _has(tail, markers):
                return status, None, f"exited {exit_code} after {what.format(limits=limits)}"
    return SandboxStatus.OK, None, f"exited {exit_code}"


def _has(text: str, markers: tuple[str, ...]) -> bool:
    return any(m in text for m in markers)


def _classify_signal(
    sig: int, stderr_tail: str, limits: SandboxLimits
) -> tuple[SandboxStatus, int, str]:
    name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
    if sig == signal.SIGXCPU:
        return SandboxStatus.TIMEOUT, sig, f"cpu time limit of {limits.cpu_seconds} s (SIGXCPU)"
    if sig == signal.SIGXFSZ:
        return SandboxStatus.LIMIT, sig, f"file size limit of {limits.max_file_bytes} B (SIGXFSZ)"
    if _has(stderr_tail, _OOM_MARKERS):
        return SandboxStatus.OOM, sig, f"{name} after an allocation failed"
    if sig == signal.SIGKILL:
        reason = "SIGKILL from inside the sandbox or the kernel (hard cpu limit, host OOM killer)"
        return SandboxStatus.KILLED, sig, reason
    return SandboxStatus.CRASHED, sig, f"ended by {name}"
