"""The work dir's disk quota: a size-capped tmpfs in a private mount namespace (as root),
else a usage poll from the host.

Design: docs/sandbox.md#the-work-dirs-disk-quota
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rltool.sandbox.bwrap import SandboxError

POLL_S = 0.1  # how often the host measures a work dir that is not a tmpfs


class TmpfsNamespace:
    """A private mount namespace in which a work dir is a tmpfs of ``size`` bytes (root only).

    A helper process (``unshare --mount``, killed with rltool by pdeathsig) holds the
    namespace; the host reads and writes the tmpfs through ``/proc/<helper>/root``, and
    bwrap enters the namespace (``launcher``) before it starts. When the helper dies,
    closed or with rltool, the namespace and its tmpfs go too: nothing stays mounted.
    """

    def __init__(self, path: Path, size: int) -> None:
        self.helper = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--",
             "unshare", "--mount", "--propagation", "private", "--", "cat"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={},
        )  # fmt: skip
        try:
            self._wait_for_namespace()
            self.ns = f"/proc/{self.helper.pid}/ns/mnt"
            mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "rltool-sandbox"]
            done = subprocess.run(
                [*self.launcher(), *mount, str(path)], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                raise SandboxError(f"cannot mount the work dir tmpfs on {path}: {done.stderr}")
        except BaseException:
            self.close()
            raise
        self.view = Path(f"/proc/{self.helper.pid}/root") / path.resolve().relative_to("/")

    def _wait_for_namespace(self) -> None:
        own = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + 5.0
        while os.readlink(f"/proc/{self.helper.pid}/ns/mnt") == own:
            if self.helper.poll() is not None or time.monotonic() > deadline:
                err = (
                    self.helper.stderr.read().decode(errors="replace") if self.helper.stderr else ""
                )
                raise SandboxError(f"could not create a mount namespace with unshare: {err}")
            time.sleep(0.0005)

    def launcher(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["nsenter", f"--mount={self.ns}", "--"]

    def close(self) -> None:
        """End the namespace, and with it the tmpfs and everything in it."""
        self.helper.kill()
        self.helper.wait()
        for stream in (self.helper.stdin, self.helper.stderr):
            if stream is not None:
                stream.close()


def tree_bytes(root: Path) -> int:
    """Bytes the files under ``root`` occupy (allocated blocks, links not followed)."""
    total, stack = 0, [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # removed or locked meanwhile: the next poll sees it
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


class WorkDirQuota:
    """``disk_bytes`` of one work dir. On a tmpfs the kernel enforces it (writes past it fail
    with ENOSPC) and a full tmpfs after a run means the run hit it; otherwise ``poll`` measures
    the dir while the sandbox runs and the caller kills the sandbox once it is over."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit
        self.tmpfs = os.path.ismount(path)
        self.hit = False

    @property
    def reason(self) -> str:
        return f"disk quota of {self.limit} bytes exceeded"

    def begin(self) -> None:
        """A new run over the dir: each run is judged on its own."""
        self.hit = False

    def poll(self) -> str | None:
        """The reason to kill the sandbox now, or None (always None on a tmpfs)."""
        if not self.tmpfs and not self.hit and tree_bytes(self.path) > self.limit:
            self.hit = True
        return self.reason if self.hit and not self.tmpfs else None

    def exceeded(self) -> bool:
        """After a run: was the quota reached (tmpfs full) or passed (poll)?"""
        if self.tmpfs:
            st = os.statvfs(self.path)
            self.hit = self.hit or st.f_bavail == 0
        return self.hit
