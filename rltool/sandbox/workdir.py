"""The private work dir of a sandbox: a fresh host dir, seeded, given to the sandbox uid."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from rltool.sandbox.bwrap import SANDBOX_GID, SANDBOX_UID, runs_as_root
from rltool.sandbox.spec import SandboxSpec

WORK_DIR_PREFIX = "rltool-sandbox-"


def create_work_dir(spec: SandboxSpec) -> Path:
    """A new 0700 host dir holding the spec's seed, writable by the sandbox uid."""
    path = Path(tempfile.mkdtemp(prefix=WORK_DIR_PREFIX, dir=spec.work_parent))
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
        if runs_as_root():
            _chown_tree(path)
    except BaseException:
        remove_work_dir(path)
        raise
    return path


def _chown_tree(root: Path) -> None:
    """Give the tree to the sandbox uid; links are chowned themselves, never followed."""
    os.chown(root, SANDBOX_UID, SANDBOX_GID)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), SANDBOX_UID, SANDBOX_GID, follow_symlinks=False)


def remove_work_dir(path: Path) -> None:
    """Delete the work dir whatever the sandbox did to its permissions."""
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
