"""Run commands in a bubblewrap sandbox: ``run_sandbox``, ``run_check`` and ``Sandbox``.

One ``Sandbox`` owns one private work dir; each ``Sandbox.run`` is a fresh bwrap over it,
and no sandbox process outlives its ``run``. Design: docs/sandbox.md#runs-and-their-lifetime
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rltool.sandbox.bwrap import (
    SandboxError,
    bwrap_argv,
    bwrap_executable,
    grant_socket_access,
    launcher_argv,
    open_userns,
    runs_as_root,
)
from rltool.sandbox.classify import SandboxStatus, classify
from rltool.sandbox.limits import SandboxLimits
from rltool.sandbox.quota import POLL_S, WorkDirQuota
from rltool.sandbox.spec import (
    SESSION_SOCKET,
    SESSION_SOCKET_ENV,
    SandboxSpec,
    check_ro_bind,
    validate_argv,
)
from rltool.sandbox.workdir import create_work_dir, remove_work_dir

_KILL_GRACE_S = 5.0  # after SIGKILL, how long the pipes may take to close
_READ_CHUNK = 1 << 16
# statuses a full work dir explains better: an exit after ENOSPC, or our own kill (poll)
_QUOTA_CAN_EXPLAIN = (SandboxStatus.OK, SandboxStatus.LIMIT, SandboxStatus.KILLED)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    status: SandboxStatus
    exit_code: int | None
    """The command's exit status as bwrap reports it (128 + N when signal N ended it);
    None when the host killed the sandbox."""
    signal: int | None
    """The signal that ended the command, if one did."""
    stdout: str
    """At most ``output_bytes`` of stdout (head and tail, a marker where cut)."""
    stderr: str
    wall_s: float
    reason: str
    """One line saying why the status is what it is."""


@dataclass(frozen=True, slots=True)
class CheckedRun:
    agent: SandboxResult
    check: SandboxResult
    """The check command, run over the work dir the agent left behind."""

    @property
    def passed(self) -> bool:
        """The check exited 0 by itself (the task decides what else its output means)."""
        return self.check.status is SandboxStatus.OK and self.check.exit_code == 0


class Tracker(Protocol):
    """Told about each running sandbox so it can kill it (SandboxPool)."""

    def add(self, process: SandboxProcess) -> None: ...

    def discard(self, process: SandboxProcess) -> None: ...


class _Capture:
    """Keeps the head and a rolling tail of a stream; counts what it drops."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap - cap // 4
        self.tail_cap = cap // 4
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail = (self.tail + chunk)[-self.tail_cap :] if self.tail_cap else bytearray()

    def text(self) -> str:
        dropped = self.total - len(self.head) - len(self.tail)
        cut = f"\n[... {dropped} bytes cut ...]\n".encode() if dropped else b""
        return bytes(self.head + cut + self.tail).decode("utf-8", errors="replace")


class _StatusReader:
    """Parses bwrap's --json-status-fd stream for the command's exit code."""

    def __init__(self) -> None:
        self.buffer = b""
        self.exit_code: int | None = None

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            doc = json.loads(line) if line.strip() else {}
            if "exit-code" in doc:
                self.exit_code = int(doc["exit-code"])


class SandboxProcess:
    """One running bwrap: its pipes, its status stream, and how to kill all of it."""

    def __init__(self, argv: list[str], pass_fds: tuple[int, ...], status_r: int) -> None:
        self.killed_for: str | None = None
        self.status = _StatusReader()
        self._status_r = status_r
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env={},
            start_new_session=True,
        )

    def kill(self, reason: str) -> None:
        """Kill the sandbox: its whole process group, not only our child.

        Our child's death takes both pid namespaces down (see bwrap.py) once the forked
        bwrap has armed its parent-death signal; a kill that lands in the moments before
        (right after the spawn, on a loaded machine) would leave that bwrap running, so
        the group (``start_new_session``: our child leads it) is killed as one.
        """
        if self.killed_for is None:
            self.killed_for = reason
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            os.killpg(self.proc.pid, signal.SIGKILL)

    def collect(
        self, limits: SandboxLimits, quota: WorkDirQuota | None = None
    ) -> tuple[_Capture, _Capture, int | None, int | None]:
        """Drain stdout/stderr/status until the sandbox is gone, killing it at the wall clock
        (or, for a work dir that is not a tmpfs, once ``quota.poll`` says it is over).

        Returns (stdout, stderr, reported exit code, bwrap's return code).
        """
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        deadline = time.monotonic() + limits.wall_clock_s
        hard_stop: float | None = None
        with selectors.DefaultSelector() as sel:
            assert self.proc.stdout is not None and self.proc.stderr is not None
            sel.register(self.proc.stdout, selectors.EVENT_READ, out)
            sel.register(self.proc.stderr, selectors.EVENT_READ, err)
            sel.register(self._status_r, selectors.EVENT_READ, self.status)
            while sel.get_map():
                now = time.monotonic()
                if self.killed_for is None and now >= deadline:
                    self.kill("timeout")
                over = None if quota is None or self.killed_for else quota.poll()
                if over is not None:
                    self.kill(over)
                if self.killed_for is not None and hard_stop is None:
                    hard_stop = now + _KILL_GRACE_S
                if hard_stop is not None and now >= hard_stop:
                    raise SandboxError(
                        f"sandbox pipes still open {_KILL_GRACE_S} s after SIGKILL "
                        f"(bwrap pid {self.proc.pid})"
                    )
                wait = max((hard_stop or deadline) - now, 0.0)
                if quota is not None and not quota.tmpfs:
                    wait = min(wait, POLL_S)
                for key, _ in sel.select(timeout=wait):
                    data = os.read(key.fd, _READ_CHUNK)
                    if data:
                        key.data.feed(data)
                    else:
                        sel.unregister(key.fileobj)
        try:
            returncode = self.proc.wait(timeout=max(deadline - time.monotonic(), 0.0) + 0.5)
        except subprocess.TimeoutExpired:
            self.kill("timeout")
            returncode = self.proc.wait(timeout=_KILL_GRACE_S)
        return out, err, self.status.exit_code, returncode

    def close(self) -> None:
        """Make sure nothing is left running, then release the fds."""
        if self.proc.poll() is None:
            self.kill(self.killed_for or "sandbox run interrupted")
            self.proc.wait(timeout=_KILL_GRACE_S)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        os.close(self._status_r)


class Sandbox:
    """A private work dir seeded from a spec; each ``run`` is a fresh bwrap over it.

    Use as a context manager: leaving it deletes the work dir.
    """

    def __init__(self, spec: SandboxSpec, *, tracker: Tracker | None = None) -> None:
        self.spec = spec
        self._bwrap = bwrap_executable()
        self._tracker = tracker
        self._work = create_work_dir(spec)
        self.work_dir = self._work.view
        """Where the host reads and writes the work dir (as root, its tmpfs via /proc)."""
        self.quota = WorkDirQuota(self.work_dir, spec.limits.disk_bytes)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        remove_work_dir(self._work)

    def run(
        self,
        command: Sequence[str] | None = None,
        *,
        limits: SandboxLimits | None = None,
        extra_ro_binds: Sequence[tuple[str | Path, str]] = (),
        with_socket: bool = True,
    ) -> SandboxResult:
        """Run ``command`` (default: the spec's) in a new sandbox over this work dir."""
        spec = self.spec
        command = spec.command if command is None else tuple(command)
        validate_argv(command, "command")
        limits = spec.limits if limits is None else limits
        binds = [*spec.ro_binds, *((Path(h), s) for h, s in extra_ro_binds)]
        for host, inside in binds[len(spec.ro_binds) :]:
            check_ro_bind(host, inside)
        env = dict(spec.env)
        socket_path = spec.socket_path if with_socket else None
        if socket_path is not None:
            grant_socket_access(Path(socket_path))
            env[SESSION_SOCKET_ENV] = SESSION_SOCKET
        status_r, status_w = os.pipe()
        userns_fd: int | None = None
        try:
            userns_fd = open_userns() if runs_as_root() else None
            ns = [] if self._work.tmpfs is None else self._work.tmpfs.launcher()
            argv = (
                ns
                + launcher_argv()
                + bwrap_argv(
                    bwrap=self._bwrap,
                    work_dir=self._work.path,
                    command=command,
                    env=env,
                    limits=limits,
                    status_fd=status_w,
                    userns_fd=userns_fd,
                    ro_binds=binds,
                    socket_path=socket_path,
                )
            )
            pass_fds = (status_w,) if userns_fd is None else (status_w, userns_fd)
            start = time.perf_counter()
            process = SandboxProcess(argv, pass_fds, status_r)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)  # bwrap holds its own copies now
            if userns_fd is not None:
                os.close(userns_fd)
        return self._finish(process, limits, start)

    def _finish(
        self, process: SandboxProcess, limits: SandboxLimits, start: float
    ) -> SandboxResult:
        if self._tracker is not None:
            self._tracker.add(process)
        self.quota.begin()
        try:
            out, err, exit_code, returncode = process.collect(limits, self.quota)
        finally:
            if self._tracker is not None:
                self._tracker.discard(process)
            process.close()
        wall_s = time.perf_counter() - start
        stderr = err.text()
        if exit_code is None and process.killed_for is None and returncode >= 0:
            # bwrap exits 1 without reporting the command's exit when its setup fails
            raise SandboxError(
                f"bwrap failed to set up the sandbox (exit {returncode}): {stderr.strip()}"
            )
        status, sig, reason = classify(
            exit_code=exit_code, killed_for=process.killed_for, stderr=stderr, limits=limits
        )
        if status in _QUOTA_CAN_EXPLAIN and self.quota.exceeded():
            why = self.quota.reason
            status, reason = SandboxStatus.LIMIT, why if reason == why else f"{why} ({reason})"
        return SandboxResult(
            status=status,
            exit_code=None if process.killed_for is not None else exit_code,
            signal=None if sig is None else int(sig),
            stdout=out.text(),
            stderr=stderr,
            wall_s=wall_s,
            reason=reason,
        )


def run_sandbox(spec: SandboxSpec, *, tracker: Tracker | None = None) -> SandboxResult:
    """Run ``spec.command`` in a fresh sandbox; its work dir is deleted afterwards."""
    with Sandbox(spec, tracker=tracker) as box:
        return box.run()


def run_check(
    spec: SandboxSpec,
    check_command: Sequence[str],
    *,
    limits: SandboxLimits | None = None,
    ro_binds: Sequence[tuple[str | Path, str]] = (),
    tracker: Tracker | None = None,
) -> CheckedRun:
    """Run the agent's command, then ``check_command`` over the same work dir.

    The check is a second sandbox (same env and binds plus ``ro_binds``, e.g. the
    task's hidden tests; no session socket; ``limits`` or the spec's). It runs
    whatever the agent's status: the check judges the work dir as it was left.
    """
    with Sandbox(spec, tracker=tracker) as box:
        agent = box.run()
        check = box.run(check_command, limits=limits, extra_ro_binds=ro_binds, with_socket=False)
    return CheckedRun(agent=agent, check=check)
