"""The private work dir of a sandbox: a fresh host dir (as root a tmpfs of ``disk_bytes`` in
a mount namespace of its own), seeded, given to the sandbox uid."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rltool.sandbox.bwrap import SANDBOX_GID, SANDBOX_UID, runs_as_root
from rltool.sandbox.quota import TmpfsNamespace
from rltool.sandbox.spec import SandboxSpec

WORK_DIR_PREFIX = "rltool-sandbox-"


@dataclass(slots=True)
class WorkDir:
    """A sandbox's work dir: the host dir bwrap binds at /work, and where the host sees it."""

    path: Path  # the host dir (as root, the tmpfs is mounted on it inside ``tmpfs``)
    view: Path  # where the host reads and writes its files: ``path``, or the tmpfs through /proc
    tmpfs: TmpfsNamespace | None = None


def create_work_dir(spec: SandboxSpec) -> WorkDir:
    """A new 0700 host dir holding the spec's seed, writable by the sandbox uid.

    As root it is a tmpfs of ``spec.limits.disk_bytes`` in a mount namespace of its own:
    nothing the sandbox writes reaches the host disk, nothing stays mounted after rltool,
    and a seed bigger than the quota is a ValueError."""
    path = Path(tempfile.mkdtemp(prefix=WORK_DIR_PREFIX, dir=spec.work_parent))
    work = WorkDir(path, path)
    try:
        if runs_as_root():
            work.tmpfs = TmpfsNamespace(path, spec.limits.disk_bytes)
            work.view = work.tmpfs.view
        _seed(work.view, spec)
        if runs_as_root():
            _chown_tree(work.view)
    except BaseException:
        remove_work_dir(work)
        raise
    return work


def _seed(path: Path, spec: SandboxSpec) -> None:
    try:
        if spec.source_dir is not None:
            # symlinks=True: a link to a host file stays a link (resolved inside the
            # sandbox), never a copy of what it points at
            shutil.copytree(spec.source_dir, path, symlinks=True, dirs_exist_ok=True)
        for rel, content in spec.files.items():
            dest = path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                dest.write_bytes(content)
            else:
                dest.write_text(content, encoding="utf-8")
    except OSError as exc:
        if exc.errno != errno.ENOSPC and "No space left on device" not in str(exc):
            raise  # shutil.Error (copytree) lists its errors without an errno
        raise ValueError(
            f"SandboxSpec seed (source_dir and files) does not fit the work dir's disk quota "
            f"(SandboxLimits.disk_bytes={spec.limits.disk_bytes}); raise it or seed less"
        ) from exc


def _chown_tree(root: Path) -> None:
    """Give the tree to the sandbox uid; links are chowned themselves, never followed."""
    os.chown(root, SANDBOX_UID, SANDBOX_GID)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), SANDBOX_UID, SANDBOX_GID, follow_symlinks=False)


def remove_work_dir(work: WorkDir) -> None:
    """Delete the work dir whatever the sandbox did to its permissions."""
    if work.tmpfs is not None:
        work.tmpfs.close()  # the tmpfs and its files go with the namespace
    path = work.path
    if not path.exists():
        return
    try:
        shutil.rmtree(path)
    except PermissionError:
        # Not root: the command may have left a directory without write/search
        # permission for its owner (us). Give them back, then delete.
        _make_owner_writable(path)
        shutil.rmtree(path)


def _make_owner_writable(root: Path) -> None:
    stack = [root]
    while stack:
        directory = stack.pop()
        os.chmod(directory, stat.S_IRWXU)
        with os.scandir(directory) as entries:
            stack += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
