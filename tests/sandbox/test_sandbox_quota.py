"""The work dir's disk quota (SandboxLimits.disk_bytes): a sample that writes past it ends
LIMIT, and as root what it wrote lived in a tmpfs, never on the host disk."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltool.sandbox import Sandbox, SandboxLimits, SandboxStatus, run_sandbox
from rltool.sandbox.bwrap import runs_as_root
from rltool.sandbox.quota import WorkDirQuota, tree_bytes

MiB = 1 << 20
QUOTA = 64 * MiB
# 32 files of 63 MB (each under the 64 MiB per-file limit; 2 GB in all), errors ignored:
# an agent that shrugs off ENOSPC and exits 0 must still end LIMIT
WRITER = """
ok = 0
for i in range(32):
    try:
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * 63_000_000)
        ok += 1
    except OSError:
        pass
print("complete files:", ok)
"""
root_only = pytest.mark.skipif(not runs_as_root(), reason="the tmpfs work dir needs root")


def test_default_quota_is_one_gib() -> None:
    assert SandboxLimits().disk_bytes == 1 << 30
    with pytest.raises(ValueError, match="disk_bytes must be a positive number"):
        SandboxLimits(disk_bytes=0)


@root_only
def test_writing_2gb_ends_limit_and_nothing_reaches_the_host_disk(make_spec, py, work_parent):
    spec = make_spec(py(WRITER), limits=SandboxLimits(disk_bytes=QUOTA))
    with Sandbox(spec) as box:
        result = box.run()
        assert result.status is SandboxStatus.LIMIT
        assert result.reason == f"disk quota of {QUOTA} bytes exceeded (exited 0)"
        assert result.stdout == "complete files: 1\n"
        # what was written sits in the work dir's own tmpfs, capped at the quota, mounted
        # in a namespace of its own: the host's mount table never shows it
        assert "rltool-sandbox" not in Path("/proc/self/mountinfo").read_text()
        assert os.path.ismount(box.work_dir)
        assert os.stat(box.work_dir).st_dev != os.stat(work_parent).st_dev
        held = tree_bytes(box.work_dir)
        assert 63_000_000 <= held <= QUOTA
        st = os.statvfs(box.work_dir)
        assert st.f_blocks * st.f_frsize == QUOTA and st.f_bavail == 0
    assert list(work_parent.iterdir()) == []  # unmounted and removed


@root_only
def test_a_writer_that_crashes_on_enospc_ends_limit(make_spec, py):
    code = "open('a', 'wb').write(bytes(3 << 20))"
    result = run_sandbox(make_spec(py(code), limits=SandboxLimits(disk_bytes=2 * MiB)))
    assert result.status is SandboxStatus.LIMIT
    assert result.reason.startswith(f"disk quota of {2 * MiB} bytes exceeded (exited 1 after")
    assert "No space left on device" in result.stderr


@root_only
def test_a_run_under_the_quota_is_ok_and_the_check_sees_its_files(make_spec):
    spec = make_spec(["sh", "-c", "head -c 1000000 /dev/zero > out"],
                     limits=SandboxLimits(disk_bytes=2 * MiB))  # fmt: skip
    with Sandbox(spec) as box:
        assert box.run().status is SandboxStatus.OK
        check = box.run(["sh", "-c", "wc -c < out"])
    assert (check.status, check.stdout) == (SandboxStatus.OK, "1000000\n")


@root_only
def test_a_seed_bigger_than_the_quota_is_refused(make_spec, work_parent):
    spec = make_spec(["true"], files={"big": bytes(2 * MiB)},
                     limits=SandboxLimits(disk_bytes=1 * MiB))  # fmt: skip
    with pytest.raises(ValueError, match=r"does not fit the work dir's disk quota"):
        Sandbox(spec)
    assert list(work_parent.iterdir()) == []


def test_poll_on_a_plain_dir_trips_past_the_quota(tmp_path: Path) -> None:
    """Without root the work dir is a plain host dir: the host measures it while it runs."""
    quota = WorkDirQuota(tmp_path, 8192)
    assert not quota.tmpfs
    (tmp_path / "a").write_bytes(b"x" * 4096)
    assert (quota.poll(), quota.exceeded()) == (None, False)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"x" * 8192)
    assert quota.poll() == "disk quota of 8192 bytes exceeded"
    assert quota.exceeded()
    quota.begin()  # the next run is judged on its own
    assert quota.exceeded() is False


@root_only
def test_the_tmpfs_dies_with_rltool(bwrap, tmp_path):
    """SIGKILL the Python holding a work dir: its namespace helper, and so the tmpfs, die too."""
    code = (
        "import sys, time; from pathlib import Path; from rltool.sandbox import Sandbox, "
        "SandboxSpec; box = Sandbox(SandboxSpec(command=['true'], files={'a': 'x'}, "
        f"work_parent=Path('{tmp_path}'))); print(box._work.tmpfs.helper.pid, flush=True); "
        "time.sleep(60)"
    )
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        helper = int(host.stdout.readline())
        assert Path(f"/proc/{helper}").exists()
    finally:
        host.kill()
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(helper)


def _alive(pid: int) -> bool:
    """Running (a zombie that no init reaps counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
