"""The sandbox loop's temporary directories: the session socket's fits a socket path under
any TMPDIR (a Unix socket's path may not pass 107 bytes)."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from rltool.agent_loops.sandbox_task import SHORT_SOCKET_PARENT, temp_dir


def test_a_socket_dir_leaves_a_long_tmpdir_for_tmp(tmp_path, monkeypatch):
    long = tmp_path / ("x" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))  # TMPDIR of 100+ characters
    with temp_dir("rltool-check-") as plain:
        assert plain.parent == long  # other directories stay where the user asked
    with temp_dir("rltool-sock-", for_socket=True) as sock_dir:
        assert sock_dir.parent == Path(SHORT_SOCKET_PARENT)
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(sock_dir / "session.sock"))  # fits
    assert not sock_dir.exists() and not plain.exists()


def test_a_socket_dir_stays_under_a_short_tmpdir(monkeypatch):
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # /tmp/tXXXXXXXX
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    try:
        with temp_dir("rltool-sock-", for_socket=True) as sock_dir:
            assert sock_dir.parent == short
    finally:
        short.rmdir()
