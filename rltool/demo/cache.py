"""Where the builtin demo checkpoints live once built: names and cache directories only.

``rltool.models`` reads this to resolve ``builtin:<name>`` without importing the
builder; ``rltool.demo.model.ensure_demo_checkpoint`` (called by the application
before it loads a builtin model) builds a missing one.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_NAME = "tiny-gsm8k-v2"  # v2: the smaller fact table of data.py
STUDENT_NAME = "tiny-gsm8k-student-v2"
MOE_NAME = "tiny-gsm8k-moe-v1"  # Qwen3-MoE, 8 experts top-2: routing replay's demo
# builtin name (``model.path: builtin:<name>``) -> cache directory name
BUILTIN_DIRS: dict[str, str] = {
    "tiny-gsm8k": DEMO_NAME,
    "tiny-gsm8k-student": STUDENT_NAME,
    "tiny-gsm8k-moe": MOE_NAME,
}


def demo_cache_dir(builtin: str = "tiny-gsm8k") -> Path:
    """``$RLTOOL_CACHE/tiny-gsm8k-v2`` (the student: ``tiny-gsm8k-student-v2``), with
    RLTOOL_CACHE defaulting to ``~/.cache/rltool``."""
    root = os.environ.get("RLTOOL_CACHE") or Path.home() / ".cache" / "rltool"
    return Path(root).expanduser() / BUILTIN_DIRS[builtin]
