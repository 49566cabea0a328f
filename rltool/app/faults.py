"""The fault drill's hook: ``RLTOOL_FAULT=<point>@<step>`` kills the process with SIGKILL
when the run reaches that point of that step. Unset (always, outside tests), it does
nothing. Points: ``generate`` (the step's groups produced, nothing trained),
``train`` (the step trained and logged, not saved), ``save`` (weights and trainer state
written, manifest not). Design: docs/app.md#the-fault-drill
"""

from __future__ import annotations

import os
import signal

ENV = "RLTOOL_FAULT"


def fault_point(point: str, step: int) -> None:
    if os.environ.get(ENV) == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
