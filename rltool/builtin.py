"""``builtin:<name>``: what rltool ships or builds itself, resolved in this one module.

Three kinds of path take the prefix: ``model.path`` (a demo checkpoint, built into the
cache on first use by ``rltool.app.demo_model``), task data files (shipped under
``rltool/demo/data``) and verl tool configs (shipped in ``rltool/verl_compat``). Nothing
here imports a model, a tokenizer or the demo's builder.
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
DATA_DIR = Path(__file__).parent / "demo" / "data"  # the shipped task files

DEMO_NAME = "tiny-gsm8k-v2"  # v2: the smaller fact table of demo/data.py
STUDENT_NAME = "tiny-gsm8k-student-v2"
MOE_NAME = "tiny-gsm8k-moe-v1"  # Qwen3-MoE, 8 experts top-2: routing replay's demo
RG_SUMS_NAME = "tiny-rg-sums-v1"  # reasoning-gym sums: the reasoning_gym recipe's warm start
# builtin model name (``model.path: builtin:<name>``) -> cache directory name
BUILTIN_DIRS: dict[str, str] = {
    "tiny-gsm8k": DEMO_NAME,
    "tiny-gsm8k-student": STUDENT_NAME,
    "tiny-gsm8k-moe": MOE_NAME,
    "tiny-rg-sums": RG_SUMS_NAME,
}


def is_builtin(path: object) -> bool:
    """Whether ``path`` is a ``builtin:`` path (a string that starts with the prefix)."""
    return isinstance(path, str) and path.startswith(BUILTIN_PREFIX)


def demo_cache_dir(builtin: str = "tiny-gsm8k") -> Path:
    """``$RLTOOL_CACHE/tiny-gsm8k-v2`` (the student: ``tiny-gsm8k-student-v2``), with
    RLTOOL_CACHE defaulting to ``~/.cache/rltool``."""
    root = os.environ.get("RLTOOL_CACHE") or Path.home() / ".cache" / "rltool"
    return Path(root).expanduser() / BUILTIN_DIRS[builtin]


def check_builtin_model(path: str) -> str:
    """The name of a ``builtin:<name>`` model path, or a ValueError listing the known ones."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_DIRS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_DIRS)
        raise ValueError(f"model.path: unknown builtin model {path!r}; known: {known}")
    return name


def builtin_model_dir(path: str, key: str = "model.path") -> Path:
    """The cache directory of the built demo checkpoint ``path`` (``key`` names the recipe
    key in errors); a ValueError when it is not built yet."""
    built = demo_cache_dir(check_builtin_model(path))
    if not (built / "config.json").is_file():
        raise ValueError(
            f"{key}: {path} is not built yet (no checkpoint in {built}); `rltool train` "
            "builds it on first use, or run `python -m rltool.app.demo_model`"
        )
    return built


def builtin_file(path: str, root: Path, pattern: str, what: str) -> Path:
    """``builtin:REL`` -> the file ``root/REL``; a ValueError naming ``what`` and listing the
    files of ``root`` that match ``pattern`` when REL is not one (or leaves ``root``)."""
    resolved = (root / path.removeprefix(BUILTIN_PREFIX)).resolve()
    if not resolved.is_relative_to(root.resolve()) or not resolved.is_file():
        known = ", ".join(
            BUILTIN_PREFIX + p.relative_to(root).as_posix() for p in sorted(root.rglob(pattern))
        )
        raise ValueError(f"unknown {what} {path!r}; known: {known}")
    return resolved


def resolve_builtin_data(path: str) -> Path:
    """``builtin:gsm8k_tiny/train.jsonl`` -> the shipped file; any other path unchanged."""
    if not is_builtin(path):
        return Path(path)
    return builtin_file(path, DATA_DIR, "*.jsonl", "builtin data file")
