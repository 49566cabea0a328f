"""Start-to-exit time of ``true`` through ``run_sandbox`` vs a bare ``bwrap --ro-bind / / true``.

``run_sandbox`` does more than the bare call: it creates and seeds a work dir,
prepares a user namespace (as root), applies limits through prlimit, sets up
its mounts and remounts, reads the status stream and removes the work dir.
Prints the median of N runs of each, in ms, and their ratio.

    python benchmarks/sandbox_start.py --n 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

from rltool.sandbox import SandboxSpec, SandboxStatus, run_sandbox


def time_bare(bwrap: str) -> float:
    start = time.perf_counter()
    subprocess.run([bwrap, "--ro-bind", "/", "/", "true"], check=True)
    return time.perf_counter() - start


def time_sandbox(spec: SandboxSpec) -> float:
    start = time.perf_counter()
    result = run_sandbox(spec)
    elapsed = time.perf_counter() - start
    assert result.status is SandboxStatus.OK and result.exit_code == 0, result
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="runs of each")
    args = parser.parse_args()
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SystemExit("bubblewrap is not installed: apt-get install -y bubblewrap")
    spec = SandboxSpec(command=["true"])
    time_bare(bwrap), time_sandbox(spec)  # warm the page cache
    bare = [time_bare(bwrap) for _ in range(args.n)]
    ours = [time_sandbox(spec) for _ in range(args.n)]
    bare_ms, ours_ms = statistics.median(bare) * 1e3, statistics.median(ours) * 1e3
    print(f"bare bwrap --ro-bind / / true : median {bare_ms:7.1f} ms  (N={args.n})")
    print(f"run_sandbox(true)             : median {ours_ms:7.1f} ms  (N={args.n})")
    print(f"ratio run_sandbox / bare       : {ours_ms / bare_ms:.2f}x")


if __name__ == "__main__":
    main()
