"""Can this machine run a sandbox? The programs it needs, then one real sandbox of ``true``.

Design: docs/agent-loops.md#preflight
"""

from __future__ import annotations

import functools
import os
import shutil

from rltool.sandbox.bwrap import HELPER_TOOLS, SandboxError
from rltool.sandbox.limits import SandboxLimits
from rltool.sandbox.run import SandboxStatus, run_sandbox
from rltool.sandbox.spec import SandboxSpec

PROBE_WALL_CLOCK_S = 10.0
INSTALL_BWRAP = "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
USERNS_HINT = (
    "bubblewrap needs user namespaces: allow them (sysctl kernel.unprivileged_userns_clone=1, "
    "kernel.apparmor_restrict_unprivileged_userns=0) or, in a container, run it with "
    "--security-opt seccomp=unconfined --security-opt apparmor=unconfined"
)


def sandbox_problems() -> list[str]:
    """What keeps this machine from running a sandbox, as fix-it sentences; [] when one ran."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return [INSTALL_BWRAP]
    missing = [tool for tool in HELPER_TOOLS if shutil.which(tool) is None]
    if missing:
        return [
            f"{', '.join(missing)} not found: apt-get install -y util-linux "
            "(the sandbox runs these beside bwrap)"
        ]
    problem = _probe(bwrap, os.geteuid())
    return [] if problem is None else [problem]


@functools.cache
def _probe(bwrap: str, euid: int) -> str | None:
    """Run ``true`` in a sandbox once per bwrap and user; why it failed, or None."""
    spec = SandboxSpec(command=["true"], limits=SandboxLimits(wall_clock_s=PROBE_WALL_CLOCK_S))
    try:
        result = run_sandbox(spec)
    except (SandboxError, OSError, ValueError) as exc:
        return f"bubblewrap ({bwrap}) cannot start a sandbox here: {exc}; {USERNS_HINT}"
    if result.status is not SandboxStatus.OK or result.exit_code != 0:
        why = result.stderr.strip() or result.reason
        return f"bubblewrap ({bwrap}) could not run `true` in a sandbox: {why}; {USERNS_HINT}"
    return None
