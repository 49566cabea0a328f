"""Sandbox pieces that need no bwrap: spec validation, limits, argv, status, capture."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from rltool.sandbox import SandboxLimits, SandboxSpec, SandboxStatus, default_env
from rltool.sandbox.bwrap import bwrap_argv
from rltool.sandbox.limits import prlimit_argv
from rltool.sandbox.run import _Capture, classify


def test_default_env_is_minimal():
    assert default_env() == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/work",
        "LANG": "C.UTF-8",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": []}, "SandboxSpec.command must be a non-empty list"),
        ({"command": ["x"], "files": {"../escape": "x"}}, "files key '../escape'"),
        ({"command": ["x"], "files": {"/etc/passwd": "x"}}, "files key '/etc/passwd'"),
        ({"command": ["x"], "env": {"A=B": "1"}}, "invalid variable 'A=B'"),
        ({"command": ["x"], "ro_binds": [("/nonexistent-src", "/x")]}, "does not exist"),
        ({"command": ["x"], "ro_binds": [("/usr", "relative")]}, "must be an absolute path"),
        ({"command": ["x"], "ro_binds": [("/usr", "/work/venv")]}, "would shadow"),
        ({"command": ["x"], "ro_binds": [("/usr", "/tmp")]}, "would shadow"),
        ({"command": ["x"], "source_dir": Path("/nonexistent-dir")}, "is not a directory"),
        ({"command": ["x"], "socket_path": Path("/etc/hostname")}, "is not a Unix socket"),
    ],
)
def test_spec_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxSpec(**kwargs)


def test_spec_accepts_a_unix_socket(socket_dir):
    path = socket_dir / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        spec = SandboxSpec(command=["true"], socket_path=path)
    assert spec.socket_path == path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu_seconds": 0}, "cpu_seconds must be a positive number"),
        ({"memory_bytes": 1.5}, "memory_bytes must be an integer"),
        ({"max_processes": 1}, "max_processes must be at least 2"),
        ({"wall_clock_s": -1}, "wall_clock_s must be a positive number"),
        ({"max_open_files": 8}, "max_open_files must be at least 16"),
    ],
)
def test_limits_reject(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxLimits(**kwargs)


def test_prlimit_argv():
    limits = SandboxLimits(
        cpu_seconds=5, memory_bytes=256 << 20, max_processes=10, max_file_bytes=1 << 20
    )
    assert prlimit_argv(limits) == [
        "/usr/bin/prlimit",
        "--cpu=5:6",
        "--as=268435456",
        "--nproc=10",
        "--fsize=1048576",
        "--nofile=64",
        "--core=0",
        "--",
    ]


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_bwrap_argv_isolates(monkeypatch, tmp_path):
    monkeypatch.setenv("RLTOOL_TEST_SECRET", "hunter2")
    limits = SandboxLimits(tmp_bytes=1 << 20)
    argv = bwrap_argv(
        bwrap="/usr/bin/bwrap",
        work_dir=tmp_path,
        command=["echo", "hi"],
        env={"PATH": "/usr/bin", "HOME": "/work"},
        limits=limits,
        status_fd=7,
        userns_fd=None,
    )
    assert "hunter2" not in " ".join(argv)
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--die-with-parent",
                 "--new-session", "--clearenv"):  # fmt: skip
        assert flag in argv
    assert _pairs(argv, "--cap-drop") == ["ALL"]
    assert _pairs(argv, "--uid") == ["65534"] and _pairs(argv, "--gid") == ["65534"]
    assert _pairs(argv, "--json-status-fd") == ["7"]
    # whitelisted system, never the host root: /root, /home, /run are simply absent
    ro = _pairs(argv, "--ro-bind")
    assert "/" not in ro and "/usr" in ro and "/etc" in ro and "/root" not in ro
    assert _pairs(argv, "--bind") == [str(tmp_path)]
    assert _pairs(argv, "--tmpfs") == ["/dev/shm", "/tmp"]
    assert _pairs(argv, "--size") == ["1048576", "1048576"]
    assert _pairs(argv, "--remount-ro") == ["/dev", "/"]
    assert _pairs(argv, "--setenv") == ["PATH", "HOME"]
    assert argv[-3:] == ["--", "echo", "hi"]
    assert argv[argv.index("--") + 1] == "/usr/bin/prlimit"


def test_bwrap_argv_joins_a_prepared_userns(tmp_path):
    argv = bwrap_argv(
        bwrap="bwrap",
        work_dir=tmp_path,
        command=["true"],
        env={},
        limits=SandboxLimits(),
        status_fd=3,
        userns_fd=9,
        ro_binds=[(Path("/opt"), "/opt")],
        socket_path=Path("/x/s.sock"),
    )
    assert "--unshare-user" not in argv and _pairs(argv, "--userns") == ["9"]
    assert argv[argv.index("/opt") - 1] == "--ro-bind"
    assert argv[argv.index("/x/s.sock") + 1] == "/run/rltool/session.sock"


LIMITS = SandboxLimits(cpu_seconds=2, memory_bytes=1000, max_processes=8, max_file_bytes=10)


@pytest.mark.parametrize(
    ("exit_code", "killed_for", "stderr", "expected"),
    [
        (0, None, "", (SandboxStatus.OK, None, "exited 0")),
        (1, None, "AssertionError", (SandboxStatus.OK, None, "exited 1")),
        (1, None, "MemoryError\n", (SandboxStatus.OOM, None, "allocation failed")),
        (1, None, "BlockingIOError: [Errno 11] Resource temporarily unavailable",
         (SandboxStatus.LIMIT, None, "process limit (8)")),
        (2, None, "sh: 0: Cannot fork", (SandboxStatus.LIMIT, None, "process limit")),
        (1, None, "OSError: [Errno 27] File too large",
         (SandboxStatus.LIMIT, None, "file size limit (10)")),
        (0, None, "MemoryError", (SandboxStatus.OK, None, "exited 0")),
        (128 + 24, None, "", (SandboxStatus.TIMEOUT, signal.SIGXCPU, "cpu time limit of 2 s")),
        (128 + 25, None, "", (SandboxStatus.LIMIT, signal.SIGXFSZ, "file size limit of 10 B")),
        (128 + 11, None, "", (SandboxStatus.CRASHED, signal.SIGSEGV, "ended by SIGSEGV")),
        (128 + 6, None, "std::bad_alloc", (SandboxStatus.OOM, signal.SIGABRT, "SIGABRT")),
        (128 + 9, None, "", (SandboxStatus.KILLED, signal.SIGKILL, "SIGKILL from inside")),
        (None, "timeout", "", (SandboxStatus.TIMEOUT, signal.SIGKILL, "wall clock of")),
        (None, "timeout", "bash: fork: retry: Resource temporarily unavailable",
         (SandboxStatus.LIMIT, signal.SIGKILL, "process limit (8) reached, then the wall")),
        (None, "sandbox pool closed", "", (SandboxStatus.KILLED, signal.SIGKILL, "pool closed")),
        (None, None, "", (SandboxStatus.KILLED, None, "without reporting an exit")),
    ],
)  # fmt: skip
def test_classify(exit_code, killed_for, stderr, expected):
    status, sig, reason = classify(
        exit_code=exit_code, killed_for=killed_for, stderr=stderr, limits=LIMITS
    )
    assert (status, sig) == expected[:2]
    assert expected[2] in reason


def test_capture_keeps_everything_under_the_cap():
    cap = _Capture(16)  # head 12, tail 4
    for chunk in (b"abcde", b"fghijkl", b"mno"):
        cap.feed(chunk)
    assert cap.text() == "abcdefghijklmno"


def test_capture_keeps_head_and_tail_over_the_cap():
    cap = _Capture(16)
    cap.feed(b"0123456789ABCDEFGHIJ")  # 20 bytes: head 12, 4 cut, tail 4
    cap.feed(b"xy")
    assert cap.text() == "0123456789AB\n[... 6 bytes cut ...]\nIJxy"
