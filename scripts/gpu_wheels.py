"""The requirements scripts/gpu_wheels.sh downloads: rltool's runtime dependencies and its
build requirements from pyproject.toml, torch left out (a GPU machine keeps its own build).

`python scripts/gpu_wheels.py` prints them one a line.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
KEPT_OFF = {"torch"}  # never downloaded: the GPU machine's own CUDA build stays


def requirement_name(requirement: str) -> str:
    """The normalised name of a PEP 508 requirement ("Math_Verify>=0.8" -> "math-verify")."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"{PYPROJECT}: cannot read the requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def wheel_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """[project] dependencies then [build-system] requires, as written, torch left out."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    reqs = data["project"]["dependencies"] + data["build-system"]["requires"]
    return [r for r in reqs if requirement_name(r) not in KEPT_OFF]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{r}\n" for r in wheel_requirements()))
