"""Run agent commands in a bubblewrap sandbox: no network, read-only system, private /work.

Design (what a sandbox can see, what bounds it, how it ends): docs/sandbox.md
"""

from rltool.sandbox.bwrap import SandboxError
from rltool.sandbox.limits import SandboxLimits
from rltool.sandbox.pool import SandboxPool
from rltool.sandbox.run import (
    CheckedRun,
    Sandbox,
    SandboxResult,
    SandboxStatus,
    run_check,
    run_sandbox,
)
from rltool.sandbox.spec import SESSION_SOCKET, WORK_DIR, SandboxSpec, default_env

__all__ = [
    "SESSION_SOCKET",
    "WORK_DIR",
    "CheckedRun",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxResult",
    "SandboxSpec",
    "SandboxStatus",
    "default_env",
    "run_check",
    "run_sandbox",
]
