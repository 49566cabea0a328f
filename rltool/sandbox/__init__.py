"""Run agent commands in a bubblewrap sandbox: no network, read-only system, private /work.

See ``rltool.sandbox.bwrap`` for what a sandbox can see and ``rltool.sandbox.limits``
for what bounds it.
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
