"""SandboxPool bounds and cleanup; sandboxes never outlive rltool; the non-root mode."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import rltool
from rltool.sandbox import SandboxLimits, SandboxPool, SandboxStatus
from rltool.sandbox.bwrap import runs_as_root


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_map_keeps_order_and_bound(make_spec):
    specs = [make_spec(["sh", "-c", f"sleep 0.3; echo {i}"]) for i in range(4)]
    seen: list[int] = []
    with SandboxPool(max_concurrent=2) as pool:
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.append(pool.live_count())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            results = pool.map(specs)
        finally:
            stop.set()
            watcher.join()
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert max(seen) == 2


def test_run_check_through_pool(make_spec):
    with SandboxPool(max_concurrent=1) as pool:
        checked = pool.run_check(make_spec(["sh", "-c", "echo 42 > a"]), ["grep", "-qx", "42", "a"])
    assert checked.passed


def test_keyboard_interrupt_kills_and_cleans_up(make_spec, live_processes):
    limits = SandboxLimits(wall_clock_s=60)
    with pytest.raises(KeyboardInterrupt), SandboxPool(max_concurrent=2) as pool:
        futures = [pool.submit(make_spec(["sleep", "987658"], limits=limits)) for _ in range(3)]
        _wait_for(lambda: pool.live_count() == 2)
        raise KeyboardInterrupt
    first, second = (f.result(timeout=10) for f in futures[:2])
    for result in (first, second):
        assert (result.status, result.reason) == (SandboxStatus.KILLED, "sandbox pool closed")
        assert result.wall_s < 30
    assert futures[2].cancelled()
    assert live_processes("987658") == []
    with pytest.raises(RuntimeError, match="SandboxPool is closed"):
        pool.run(make_spec(["true"]))


def test_sandbox_dies_with_rltool(bwrap, tmp_path, live_processes):
    """SIGKILL the Python that runs a sandbox: nothing of the sandbox survives it."""
    parent = tmp_path / "orphan"
    parent.mkdir()
    code = (
        "from pathlib import Path; from rltool.sandbox import SandboxSpec, run_sandbox;"
        f" run_sandbox(SandboxSpec(command=['sleep', '987659'], work_parent=Path('{parent}')))"
    )
    host = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(lambda: live_processes("sleep\x00987659") != [])
    finally:
        host.kill()
        host.wait()
    _wait_for(lambda: live_processes("sleep\x00987659") == [] and live_processes(str(parent)) == [])
    # only a SIGKILLed rltool leaves its work dir behind (nothing ran its cleanup)
    assert len(list(parent.iterdir())) == 1


NON_ROOT_SCRIPT = """
import json
from rltool.sandbox import SandboxLimits, SandboxSpec, run_sandbox
spawn = '''
import subprocess
ok = 0
for _ in range(50):
    try:
        subprocess.Popen(['sleep', '987661']); ok += 1
    except BlockingIOError:
        pass
print(ok)
'''
limits = SandboxLimits(max_processes=10, wall_clock_s=20)
runs = [
    run_sandbox(SandboxSpec(command=['python3', '-c', spawn], limits=limits)),
    run_sandbox(SandboxSpec(command=['sh', '-c', 'id -u; ls /root'])),
    run_sandbox(SandboxSpec(command=['sh', '-c', 'sleep 987660 & echo bg'])),
]
print(json.dumps([[r.status, r.stdout, r.stderr] for r in runs]))
"""


def test_non_root_mode(bwrap, live_processes):
    """rltool run by an ordinary user: bwrap makes the user namespace itself."""
    if not runs_as_root():
        pytest.skip("already running as non-root: every other test covers this mode")
    system_python = shutil.which("python3", path="/usr/bin")
    if system_python is None:
        pytest.skip("no /usr/bin/python3 to run rltool as an ordinary user")
    # a copy of the package that uid 65534 can read, whatever the checkout's permissions
    copy = Path(tempfile.mkdtemp(prefix="rltool-nonroot-"))
    try:
        package = Path(rltool.__file__).parent
        shutil.copytree(package / "sandbox", copy / "rltool" / "sandbox")
        shutil.copy(package / "__init__.py", copy / "rltool" / "__init__.py")
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        proc = subprocess.run(
            [system_python, "-c", NON_ROOT_SCRIPT],
            user=65534,
            group=65534,
            extra_groups=[],
            env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
            cwd=copy,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(copy)
    assert proc.returncode == 0, proc.stderr
    spawn, ident, background = json.loads(proc.stdout)
    assert spawn == ["ok", "8\n", ""]  # init + python + 8 sleeps = the 10 allowed
    assert ident[0] == "ok" and ident[1].split()[0] == "65534"
    assert "cannot access '/root'" in ident[2]
    assert background == ["ok", "bg\n", ""]
    # durations no other program uses (a shared machine runs its own `sleep 30`s); the NUL
    # ends the argument
    assert live_processes("sleep\x00987661\x00") == []
    assert live_processes("sleep\x00987660\x00") == []
