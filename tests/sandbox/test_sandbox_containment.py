"""What a sandboxed command can and cannot do; every test ends with no sandbox process left.

Network checks never send a packet off this machine: the sandbox has only a
loopback interface, so a connect to a documentation address (192.0.2.1,
RFC 5737) fails in the kernel before anything is sent, and the script refuses
to even try if it sees any other interface.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from rltool.sandbox import (
    SandboxLimits,
    SandboxStatus,
    run_check,
    run_sandbox,
)
from rltool.sandbox.bwrap import runs_as_root

MiB = 1 << 20


def test_runs_in_work_dir_with_seed(make_spec, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.txt").write_text("from source dir\n")
    (src / "link").symlink_to("/etc/hostname")
    spec = make_spec(
        ["sh", "-c", "pwd; cat pkg/a.txt notes/b.txt; readlink link; echo out >> c.txt; exit 7"],
        source_dir=src,
        files={"notes/b.txt": "from files\n"},
    )
    result = run_sandbox(spec)
    assert (result.status, result.exit_code, result.signal) == (SandboxStatus.OK, 7, None)
    assert result.stdout == "/work\nfrom source dir\nfrom files\n/etc/hostname\n"
    assert result.stderr == ""
    assert result.reason == "exited 7"


def test_runs_as_unprivileged_uid_without_capabilities(make_spec):
    result = run_sandbox(
        make_spec(["sh", "-c", "id -u; id -g; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"])
    )
    assert result.stdout.split() == ["65534", "65534", "CapEff:", "0000000000000000",
                                     "NoNewPrivs:", "1"]  # fmt: skip
    if runs_as_root():
        # uid 65534 inside is host uid 65534, never host root (whose NPROC is unlimited)
        maps = run_sandbox(make_spec(["cat", "/proc/self/uid_map"])).stdout.split()
        assert maps == ["65533", "0", "1", "65534", "65534", "1"]


def test_host_environment_is_not_visible(make_spec, monkeypatch):
    monkeypatch.setenv("RLTOOL_TEST_SECRET", "hunter2")
    result = run_sandbox(make_spec(["env"]))
    assert "hunter2" not in result.stdout
    assert sorted(result.stdout.split()) == [
        "HOME=/work",
        "LANG=C.UTF-8",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PWD=/work",
    ]


def test_host_home_and_root_are_not_visible(make_spec, py_binds):
    result = run_sandbox(make_spec(["sh", "-c", "ls /; echo --; ls -A /root /home"]))
    top, inside = (part.split() for part in result.stdout.split("--\n"))
    # only the system whitelist, /work, and the top of the test Python's bind
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "etc", "proc", "tmp", "usr"}
    bound = [host for host, _ in py_binds]
    assert {"dev", "etc", "proc", "tmp", "usr", "work"} <= set(top)
    assert set(top) <= system | {"work"} | {b.parts[1] for b in bound}
    # host home dirs are absent; /root holds at most the path down to that bind
    assert "cannot access '/home': No such file or directory" in result.stderr
    under_root = [b.parts[2] for b in bound if b.is_relative_to("/root")]
    assert [name for name in inside if not name.endswith(":")] == under_root
    if os.access("/root", os.R_OK):
        assert len(os.listdir("/root")) > len(under_root)  # the host's /root has more


def test_writes_outside_work_dir_are_refused(make_spec):
    host_marker = Path("/tmp") / f"rltool-sandbox-test-{os.getpid()}"
    host_marker.write_text("host")
    try:
        script = (
            "for p in /etc/x /usr/x /x /dev/x /bin/x; do"
            " touch $p 2>/dev/null && echo wrote $p; done;"
            f" ls /tmp; test -e {host_marker} && echo sees-host-tmp;"
            " echo private > /tmp/mine; cat /tmp/mine"
        )
        result = run_sandbox(make_spec(["sh", "-c", script]))
    finally:
        host_marker.unlink()
    assert result.stdout == "private\n"  # nothing written, sandbox /tmp starts empty
    assert not Path("/tmp/mine").exists()


NET_SCRIPT = """
import errno, socket, sys
ifaces = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
if ifaces != ['lo']:
    print('interfaces', ifaces); sys.exit(2)   # do not try anything: not isolated
for host, port in (('192.0.2.1', 53), ('127.0.0.1', PORT)):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect((host, port)); print(host, 'connected')
    except OSError as e:
        print(host, errno.errorcode.get(e.errno, e))
"""


def test_network_is_unreachable(make_spec, py):
    with socket.socket() as server:  # a host loopback server the sandbox must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run_sandbox(make_spec(py(NET_SCRIPT.replace("PORT", str(port)))))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "192.0.2.1 ENETUNREACH",
        "127.0.0.1 ECONNREFUSED",  # the sandbox's own loopback, not the host's
    ]


def test_session_socket_is_the_way_out(make_spec, py, socket_dir):
    path = socket_dir / "session.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"pong:" + conn.recv(64))

    thread = threading.Thread(target=serve)
    thread.start()
    code = (
        "import os, socket; s = socket.socket(socket.AF_UNIX);"
        " s.connect(os.environ['RLTOOL_SESSION_SOCKET']); s.sendall(b'ping');"
        " print(os.environ['RLTOOL_SESSION_SOCKET'], s.recv(64).decode())"
    )
    try:
        result = run_sandbox(make_spec(py(code), socket_path=path))
    finally:
        thread.join(timeout=10)
        server.close()
    assert result.stdout == "/run/rltool/session.sock pong:ping\n", result.stderr


SPAWN_50 = """
import subprocess
procs, failed = [], 0
for _ in range(50):
    try:
        procs.append(subprocess.Popen(['sleep', '30']))
    except BlockingIOError:
        failed += 1
print(len(procs), failed)
"""


def test_process_limit_benign(make_spec, py, live_processes):
    # 10 processes: the sandbox's init, this Python, so 8 sleeps; the other 42 fail.
    # The sleeps are left running: they die with the sandbox's pid namespace.
    spec = make_spec(py(SPAWN_50), limits=SandboxLimits(max_processes=10, wall_clock_s=20))
    result = run_sandbox(spec)
    assert result.stdout == "8 42\n", result.stderr
    # OK, not the 20 s wall clock: it did not wait for the 30 s sleeps
    assert result.status is SandboxStatus.OK


def test_fork_bomb_is_contained(make_spec, py):
    bomb = "import os\nwhile True:\n    os.fork()\n"
    limits = SandboxLimits(max_processes=32, wall_clock_s=15, cpu_seconds=10)
    result = run_sandbox(make_spec(py(bomb), limits=limits))
    assert result.status is SandboxStatus.LIMIT, result.reason
    assert "process limit (32)" in result.reason
    assert "Resource temporarily unavailable" in result.stderr
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host still forks


@pytest.mark.slow
def test_shell_fork_bombs_are_contained(make_spec):
    limits = SandboxLimits(max_processes=16, wall_clock_s=3, cpu_seconds=10)
    # in the foreground: bash retries failed forks until the wall clock kills it all
    fg = run_sandbox(make_spec(["bash", "-c", ":(){ :|: ; }; :"], limits=limits))
    assert fg.status is SandboxStatus.LIMIT, fg.reason
    assert "process limit (16) reached, then the wall clock" in fg.reason and fg.wall_s < 60
    # in the background: the command itself still runs (it forks its sleep and the
    # bomb's subshell before the bomb grows; wait and echo are builtins), and the bomb
    # dies with it
    script = "sleep 1 & s=$!; ( :(){ :|:& }; : ) & wait $s; echo alive"
    bg = run_sandbox(make_spec(["bash", "-c", script], limits=limits))
    assert (bg.status, bg.stdout) == (SandboxStatus.OK, "alive\n"), bg.reason
    assert "fork: retry: Resource temporarily unavailable" in bg.stderr
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host still forks


def test_memory_hog_fails(make_spec, py):
    limits = SandboxLimits(memory_bytes=256 * MiB)
    result = run_sandbox(make_spec(py("b = bytearray(2 << 30); print(len(b))"), limits=limits))
    assert result.status is SandboxStatus.OOM, result.reason
    assert result.exit_code == 1 and result.stdout == ""
    assert "MemoryError" in result.stderr


def test_infinite_loop_hits_cpu_limit(make_spec, py):
    limits = SandboxLimits(cpu_seconds=1, wall_clock_s=20)
    result = run_sandbox(make_spec(py("while True: pass"), limits=limits))
    assert (result.status, result.signal) == (SandboxStatus.TIMEOUT, 24), result.reason
    assert result.reason == "cpu time limit of 1 s (SIGXCPU)"  # not the 20 s wall clock


def test_sleeper_hits_wall_clock(make_spec, live_processes):
    limits = SandboxLimits(wall_clock_s=1.0)
    result = run_sandbox(make_spec(["sh", "-c", "echo before; sleep 987651"], limits=limits))
    assert result.status is SandboxStatus.TIMEOUT
    assert result.exit_code is None and result.signal == 9
    assert result.stdout == "before\n"
    assert 1.0 <= result.wall_s < 60  # generous: without the limit it sleeps for days
    assert live_processes("987651") == []


def test_command_that_closes_its_output_still_times_out(make_spec, live_processes):
    limits = SandboxLimits(wall_clock_s=1.0)
    result = run_sandbox(make_spec(["sh", "-c", "exec >&- 2>&-; sleep 987661"], limits=limits))
    assert result.status is SandboxStatus.TIMEOUT and 1.0 <= result.wall_s < 60
    assert live_processes("sleep\x00987661") == []


def test_keyboard_interrupt_during_run_cleans_up(make_spec, live_processes):
    # a shell's background job (`pytest ... &`) starts with SIGINT ignored, and Python
    # keeps it so: install Python's own handler, or Ctrl-C never reaches the test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sandbox(make_spec(["sleep", "987662"], limits=SandboxLimits(wall_clock_s=30)))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert live_processes("sleep\x00987662") == []  # make_spec checks the work dir is gone


def test_file_size_limit(make_spec, py):
    limits = SandboxLimits(max_file_bytes=1 * MiB)
    # a shell writer gets SIGXFSZ; Python ignores that signal and gets EFBIG instead
    sh = run_sandbox(make_spec(["sh", "-c", "head -c 2M /dev/zero > big"], limits=limits))
    assert (sh.status, sh.signal) == (SandboxStatus.LIMIT, 25), sh.reason
    code = "open('big', 'wb').write(bytes(2 << 20))"
    pyr = run_sandbox(make_spec(py(code), limits=limits))
    assert pyr.status is SandboxStatus.LIMIT, pyr.reason
    assert "File too large" in pyr.stderr


def test_tmp_is_capped(make_spec):
    limits = SandboxLimits(tmp_bytes=1 * MiB, max_file_bytes=8 * MiB)
    result = run_sandbox(make_spec(["sh", "-c", "head -c 2M /dev/zero > /tmp/big"], limits=limits))
    assert result.exit_code != 0
    assert "No space left on device" in result.stderr


def test_background_process_is_killed_when_command_exits(make_spec, live_processes):
    spec = make_spec(["sh", "-c", "sleep 987652 & sleep 987653 & echo started"])
    result = run_sandbox(spec)
    assert (result.status, result.stdout) == (SandboxStatus.OK, "started\n")
    assert result.wall_s < 60  # generous: waiting for the sleeps would take days
    # this test's own sleeps only: other tests' markers share the 98765 prefix
    assert live_processes("sleep\x00987652") == live_processes("sleep\x00987653") == []


def test_output_is_capped(make_spec, py):
    limits = SandboxLimits(output_bytes=1000)
    result = run_sandbox(make_spec(py("print('x' * 1_000_000, end=''); print('END')"),
                                   limits=limits))  # fmt: skip
    assert result.status is SandboxStatus.OK
    assert result.stdout.startswith("x" * 750) and result.stdout.endswith("x" * 246 + "END\n")
    assert "[... 999004 bytes cut ...]" in result.stdout


def test_check_sees_the_work_dir_the_agent_left(make_spec, tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "check.sh").write_text('test "$(cat answer.txt)" = 42 && echo correct\n')
    spec = make_spec(["sh", "-c", "echo 42 > answer.txt; sleep 987654 &"])
    checked = run_check(spec, ["sh", "/check/check.sh"], ro_binds=[(hidden, "/check")])
    assert checked.agent.status is SandboxStatus.OK
    assert (checked.check.exit_code, checked.check.stdout) == (0, "correct\n")
    assert checked.passed


def test_check_runs_after_a_failed_agent(make_spec):
    spec = make_spec(["sh", "-c", "echo 41 > answer.txt; sleep 60"],
                     limits=SandboxLimits(wall_clock_s=0.5))  # fmt: skip
    checked = run_check(spec, ["sh", "-c", 'test "$(cat answer.txt)" = 42'])
    assert checked.agent.status is SandboxStatus.TIMEOUT
    assert (checked.check.status, checked.check.exit_code) == (SandboxStatus.OK, 1)
    assert not checked.passed


def test_bind_setup_failure_raises(make_spec, tmp_path):
    from rltool.sandbox import SandboxError

    private = tmp_path / "gone"
    private.mkdir()
    spec = make_spec(["true"], ro_binds=[(private, "/data")])
    private.rmdir()  # vanished between the spec and the run: bwrap cannot bind it
    with pytest.raises(SandboxError, match="bwrap failed to set up the sandbox"):
        run_sandbox(spec)
