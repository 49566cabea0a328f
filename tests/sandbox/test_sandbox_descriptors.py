"""The sandbox's open-file limit (RLIMIT_NOFILE) and its whole-sandbox memory bound: code
opening a thousand files or session sockets stops at the limit, the host keeps its own."""

from __future__ import annotations

import os
import resource
import socket

import pytest
from fake_engines import FixedReplyEngine

from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.sandbox import SandboxLimits, SandboxStatus, run_sandbox
from rltool.sessions import SessionServer

MiB = 1 << 20

OPEN_1000 = """
import errno, os, socket, sys
held = []
try:
    for i in range(1000):
        held.append(open(f'f{i}', 'w') if sys.argv[1] == 'files' else socket.socket(socket.AF_UNIX))
        if sys.argv[1] == 'connect':
            held[-1].connect(os.environ['RLTOOL_SESSION_SOCKET'])
except OSError as exc:
    print(len(held), errno.errorcode[exc.errno])
else:
    print(len(held), 'none')
"""


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


def host_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
def test_opening_1000_files_fails_at_the_limit_and_the_host_keeps_its_own(make_spec, py):
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    counts = {}
    for limit in (64, 32):
        spec = make_spec([*py(OPEN_1000), "files"], limits=SandboxLimits(max_open_files=limit))
        result = run_sandbox(spec)
        assert result.status is SandboxStatus.OK, result.reason
        held, error = result.stdout.split()
        assert error == "EMFILE", result.stdout + result.stderr
        counts[limit] = int(held)
    # the limit less stdin/out/err and the interpreter's own descriptors
    assert 64 - 16 < counts[64] < 64 and counts[32] == counts[64] - 32
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(500)]  # the host opens what it likes
    for fd in fds:
        os.close(fd)


@pytest.mark.slow
def test_held_session_sockets_stop_at_the_limit_and_the_server_serves(
    make_spec, py, tokenizer, socket_dir
):
    sock = socket_dir / "s.sock"
    with SessionServer(FixedReplyEngine(tokenizer), tokenizer, unix_socket=sock) as server:
        before = host_fds()
        spec = make_spec([*py(OPEN_1000), "connect"], socket_path=sock)
        result = run_sandbox(spec)
        held, error = result.stdout.split()
        assert error == "EMFILE" and int(held) < 64, result.stdout + result.stderr
        server.open_session("after")
        with socket.socket(socket.AF_UNIX) as probe:  # the server still answers
            probe.connect(str(sock))
            probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert probe.recv(4096).startswith(b"HTTP/1.1 200")
    assert host_fds() <= before + 2  # the sandbox's connections are gone with it


def test_the_whole_sandbox_memory_bound_is_computed():
    limits = SandboxLimits(memory_bytes=512 * MiB, max_processes=8, tmp_bytes=16 * MiB)
    assert limits.memory_bound_bytes == 8 * 512 * MiB + 2 * 16 * MiB
    assert SandboxLimits().memory_bound_bytes == 64 * 1024 * MiB + 2 * 64 * MiB
