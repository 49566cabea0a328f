"""The requirements scripts/gpu_wheels.sh downloads: rltool's runtime dependencies and its
build requirements from pyproject.toml, torch left out (a GPU machine keeps its own build).

`python scripts/gpu_wheels.py [--lean]` prints them one a line; --lean also leaves out what
the GPU checks never import (the Ray backend's ray, parquet's pyarrow: 130 MB of 190).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"
KEPT_OFF = {"torch"}  # never downloaded: the GPU machine's own CUDA build stays
LEAN_OFF = {"ray", "pyarrow"}  # imported lazily, by rollout.backend ray and parquet data only


def requirement_name(requirement: str) -> str:
    """The normalised name of a PEP 508 requirement ("Math_Verify>=0.8" -> "math-verify")."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"{PYPROJECT}: cannot read the requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def wheel_requirements(pyproject: Path = PYPROJECT, lean: bool = False) -> list[str]:
    """[project] dependencies then [build-system] requires, as written, torch left out (and
    ``LEAN_OFF`` when ``lean``)."""
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    reqs = data["project"]["dependencies"] + data["build-system"]["requires"]
    off = KEPT_OFF | (LEAN_OFF if lean else set())
    return [r for r in reqs if requirement_name(r) not in off]


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--lean"]):
        sys.exit(f"usage: {sys.argv[0]} [--lean]")
    lean = sys.argv[1:] == ["--lean"]
    sys.stdout.write("".join(f"{r}\n" for r in wheel_requirements(lean=lean)))
