"""SandboxSpec: what to run in a sandbox, with which files, environment and limits."""

from __future__ import annotations

import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rltool.sandbox.limits import SandboxLimits

WORK_DIR = "/work"  # the private writable work dir, as the sandbox sees it
SESSION_SOCKET = "/run/rltool/session.sock"  # where socket_path appears inside
SESSION_SOCKET_ENV = "RLTOOL_SESSION_SOCKET"  # set inside when a socket is bound
# Mount points the sandbox sets up itself; a read-only bind must not shadow them.
_RESERVED = ("/", "/proc", "/dev", "/tmp", "/usr", "/etc", WORK_DIR, "/run/rltool")


def default_env() -> dict[str, str]:
    """The whole environment of a sandboxed command unless the spec gives its own."""
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": WORK_DIR,
        "LANG": "C.UTF-8",
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    command: Sequence[str]
    """argv of the command, resolved with the sandbox's PATH; it starts in /work."""
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Seed files: path relative to /work -> content, written after source_dir is copied."""
    source_dir: Path | None = None
    """A host directory copied (symlinks kept as links) into the fresh work dir."""
    env: Mapping[str, str] = field(default_factory=default_env)
    """The complete environment inside; the host's is never passed on."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    ro_binds: Sequence[tuple[str | Path, str]] = ()
    """Extra read-only binds: (host path, absolute sandbox path), e.g. a Python venv."""
    socket_path: Path | None = None
    """A host Unix socket bound at /run/rltool/session.sock (the only way out: no network)."""
    work_parent: Path | None = None
    """Host directory in which the per-sandbox work dir is created (default: system temp)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "ro_binds", tuple((Path(h), s) for h, s in self.ro_binds))
        validate_argv(self.command, "SandboxSpec.command")
        _check_env(self.env)
        for rel in self.files:
            _check_relative(rel)
        if self.source_dir is not None and not Path(self.source_dir).is_dir():
            raise ValueError(f"SandboxSpec.source_dir {self.source_dir} is not a directory")
        for host, inside in self.ro_binds:
            check_ro_bind(host, inside)
        if self.socket_path is not None:
            _check_socket(Path(self.socket_path))
        if self.work_parent is not None and not Path(self.work_parent).is_dir():
            raise ValueError(f"SandboxSpec.work_parent {self.work_parent} is not a directory")


def validate_argv(command: Sequence[str], name: str) -> None:
    if not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"{name} must be a non-empty list of strings, got {command!r}")


def _check_env(env: Mapping[str, str]) -> None:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in str(value):
            raise ValueError(f"SandboxSpec.env has an invalid variable {key!r}={value!r}")


def _check_relative(rel: str) -> None:
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or path == PurePosixPath("."):
        raise ValueError(
            f"SandboxSpec.files key {rel!r} must be a relative path inside /work (no '..')"
        )


def check_ro_bind(host: Path, inside: str) -> None:
    """Validate one extra read-only bind; ValueError naming what to fix."""
    if not host.exists():
        raise ValueError(f"SandboxSpec.ro_binds source {host} does not exist on the host")
    dest = PurePosixPath(inside)
    if not dest.is_absolute() or ".." in dest.parts:
        raise ValueError(f"SandboxSpec.ro_binds destination {inside!r} must be an absolute path")
    for reserved in _RESERVED:
        if str(dest) == reserved or (
            reserved in (WORK_DIR, "/run/rltool") and dest.is_relative_to(reserved)
        ):
            raise ValueError(
                f"SandboxSpec.ro_binds destination {inside!r} would shadow the sandbox's own "
                f"{reserved}; bind somewhere else (work files go in SandboxSpec.files)"
            )


def _check_socket(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"SandboxSpec.socket_path {path} does not exist") from None
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"SandboxSpec.socket_path {path} is not a Unix socket")
