"""Shared fixtures of the sandbox tests: bwrap or skip, a Python usable inside, survivor scans."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rltool.sandbox import SandboxSpec

# The Python running the tests, made visible inside the sandbox (read-only, same
# path) unless it already lives under /usr, which every sandbox sees.
_PREFIX = Path(sys.base_prefix)
_PY = str(_PREFIX / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
_PY_BINDS = () if _PREFIX.is_relative_to("/usr") else ((_PREFIX, str(_PREFIX)),)


def _live_processes(needle: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose argv contains ``needle``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        if needle.encode() in cmdline and state != "Z":
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {args}")
    return found


@pytest.fixture
def live_processes() -> Callable[[str], list[str]]:
    return _live_processes


@pytest.fixture
def py() -> Callable[[str], list[str]]:
    """argv running a Python snippet with the test's interpreter inside the sandbox."""
    return lambda code: [_PY, "-c", code]


@pytest.fixture
def py_binds() -> tuple[tuple[Path, str], ...]:
    """The read-only binds make_spec adds so that ``py`` works inside."""
    return _PY_BINDS


@pytest.fixture
def bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")


@pytest.fixture
def work_parent(tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def make_spec(bwrap, work_parent: Path):
    """SandboxSpec factory: work dirs under work_parent, the test Python bound in.

    After the test: no work dir left, no bwrap of this test still running.
    """

    def make(command, **kwargs) -> SandboxSpec:
        kwargs.setdefault("ro_binds", _PY_BINDS)
        return SandboxSpec(command=command, work_parent=work_parent, **kwargs)

    yield make
    assert _live_processes(str(work_parent)) == []
    assert list(work_parent.iterdir()) == []
