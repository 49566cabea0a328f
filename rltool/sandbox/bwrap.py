"""The bubblewrap command line of one sandbox, and the user namespace it runs in.

A whitelist of read-only system dirs, a private read-write ``/work``, capped tmpfs, new
namespaces, no capabilities, uid 65534 (never host root); killing the process rltool
started kills everything inside. Design: docs/sandbox.md#the-bubblewrap-command-line
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rltool.sandbox.limits import PRLIMIT, SandboxLimits, prlimit_argv
from rltool.sandbox.spec import SESSION_SOCKET, WORK_DIR

SANDBOX_UID = 65534  # "nobody"
SANDBOX_GID = 65534  # "nogroup"
# Host root appears under this id inside (it must be mapped for bwrap, running
# as root, to read root-owned bind sources; mapping it to 0 would make bwrap's
# own switch to 65534 drop the capabilities it still needs).
HOST_ROOT_INSIDE = 65533
_SYSTEM_DIRS = ("/usr", "/etc")
_SYSTEM_LINKS_OR_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# util-linux programs a sandbox runs besides bwrap (limits, pid and mount namespaces, quota)
HELPER_TOOLS = (PRLIMIT, "setpriv", "unshare", "nsenter", "mount")


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the sandboxed command failing)."""


def bwrap_executable() -> str:
    """Path of bwrap, or SandboxError saying how to install it."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            "bubblewrap is not installed: `apt-get install -y bubblewrap` (needs user namespaces)"
        )
    for tool in HELPER_TOOLS:
        if shutil.which(tool) is None:
            raise SandboxError(f"{tool} is missing: install util-linux (the sandbox needs it)")
    return path


def runs_as_root() -> bool:
    return os.geteuid() == 0


def launcher_argv() -> list[str]:
    """What runs bwrap: as root, a pid namespace that dies with bwrap and with rltool."""
    if not runs_as_root():
        return []
    return [
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--pid", "--fork", "--kill-child=KILL", "--",
    ]  # fmt: skip


def system_mounts() -> list[str]:
    """bwrap arguments exposing the host system read-only, as this host lays it out."""
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        args += ["--ro-bind", path, path]
    for path in _SYSTEM_LINKS_OR_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def open_userns() -> int:
    """An fd of a fresh user namespace mapping uid/gid 65534 -> host 65534 (root only).

    A short-lived ``unshare --user`` helper creates the namespace; we write its
    maps (root may map any ids), keep the namespace alive through the fd and
    kill the helper. The caller passes the fd to bwrap's ``--userns`` and closes it.
    """
    helper = subprocess.Popen(
        ["unshare", "--user", "--", "cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={},
    )
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 5.0
        while os.readlink(f"/proc/{helper.pid}/ns/user") == own:
            if helper.poll() is not None or time.monotonic() > deadline:
                err = helper.stderr.read().decode(errors="replace") if helper.stderr else ""
                raise SandboxError(f"could not create a user namespace with unshare: {err}")
            time.sleep(0.0005)
        maps = f"{HOST_ROOT_INSIDE} 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
        Path(f"/proc/{helper.pid}/uid_map").write_text(maps)
        Path(f"/proc/{helper.pid}/gid_map").write_text(
            f"{HOST_ROOT_INSIDE} 0 1\n{SANDBOX_GID} {SANDBOX_GID} 1\n"
        )
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.kill()
        helper.wait()
        if helper.stdin:
            helper.stdin.close()
        if helper.stderr:
            helper.stderr.close()


def grant_socket_access(path: Path) -> None:
    """Let the sandbox uid connect to a host Unix socket (connect needs write permission).

    As root the sandboxed command is host uid 65534: a socket that uid cannot
    write is handed to it (chown), which keeps other host users out, unlike
    chmod 0666. Otherwise the sandbox runs as the caller, who can already connect.
    """
    if not runs_as_root():
        return
    st = path.stat()
    writable = (
        (st.st_uid == SANDBOX_UID and st.st_mode & stat.S_IWUSR)
        or (st.st_gid == SANDBOX_GID and st.st_mode & stat.S_IWGRP)
        or st.st_mode & stat.S_IWOTH
    )
    if not writable:
        os.chown(path, SANDBOX_UID, -1, follow_symlinks=False)
        os.chmod(path, st.st_mode | stat.S_IWUSR)


def bwrap_argv(
    *,
    bwrap: str,
    work_dir: Path,
    command: Sequence[str],
    env: Mapping[str, str],
    limits: SandboxLimits,
    status_fd: int,
    userns_fd: int | None,
    ro_binds: Sequence[tuple[Path, str]] = (),
    socket_path: Path | None = None,
) -> list[str]:
    """The full argv: bwrap, its options, then prlimit and the command.

    ``userns_fd`` is the namespace from ``open_userns`` when running as root,
    None otherwise (bwrap then makes the user namespace itself).
    """
    user = ["--unshare-user"] if userns_fd is None else ["--userns", str(userns_fd)]
    argv = [
        bwrap,
        *user,
        "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_GID),
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
        "--json-status-fd", str(status_fd),
        *system_mounts(),
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
        "--bind", str(work_dir), WORK_DIR,
    ]  # fmt: skip
    for host, inside in ro_binds:
        argv += ["--ro-bind", str(host), inside]
    if socket_path is not None:
        argv += ["--ro-bind", str(socket_path), SESSION_SOCKET]
    argv += ["--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *prlimit_argv(limits), *command]
