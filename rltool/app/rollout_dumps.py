"""``--dump-rollouts``: each step's samples as the trainer saw them, and a note of where
they came from, so that ``rltool replay`` can train on them again and refuse what it
cannot trust.

Layout under ``<run_dir>/rollouts/``::

    step_000004.jsonl       the groups handed to the trainer (stale tokens already marked
                            as not trained), then the step's FAILED groups
    step_000004.meta.json   step, model path and vocabulary size, the weights version
                            that served the step, how many groups trained, sample count
                            and the sha256 of the .jsonl; written after it

A step redone after a resume replaces its dump (the redone step is what trained).
Design: docs/replay.md
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rltool.rollout.io import read_groups, write_rollouts
from rltool.rollout.state import RolloutState

DUMP_DIR = "rollouts"
Group = list[RolloutState]


class DumpError(ValueError):
    """A step's dump that is missing, damaged or not from this run's model."""


@dataclass(frozen=True, slots=True)
class DumpSource:
    """Where a step's samples came from: what a replay checks against its run."""

    model_path: str  # the run's model.path
    vocab_size: int  # len(tokenizer): every token id is below it


@dataclass(frozen=True, slots=True)
class DumpMeta:
    step: int  # the train step the samples were served to
    model_path: str
    vocab_size: int
    model_step: int  # the weights version the trainer held when it took the samples
    trained_groups: int  # the first ``trained_groups`` groups of the file went to the trainer
    samples: int
    sha256: str  # of the .jsonl file


def dump_path(run_dir: Path, step: int) -> Path:
    return run_dir / DUMP_DIR / f"step_{step:06d}.jsonl"


def meta_path(run_dir: Path, step: int) -> Path:
    return run_dir / DUMP_DIR / f"step_{step:06d}.meta.json"


def dumped_steps(run_dir: Path) -> list[int]:
    """The steps with a dump file, ascending."""
    names = (p.name for p in (run_dir / DUMP_DIR).glob("step_*.jsonl"))
    return sorted(int(n[5:-6]) for n in names if n[5:-6].isdigit())


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_step_dump(
    run_dir: Path,
    step: int,
    model_step: int,
    trained: list[Group],
    failed: list[Group],
    source: DumpSource,
) -> Path:
    """The step's trained groups, then its FAILED ones (with their errors: what explains a
    bad step), and the note of their source; returns the .jsonl path."""
    path = dump_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    samples = write_rollouts(tmp, [s for g in trained + failed for s in g])
    os.replace(tmp, path)
    meta = DumpMeta(
        step, source.model_path, source.vocab_size, model_step, len(trained), samples, _sha256(path)
    )
    tmp_meta = meta_path(run_dir, step).with_name(f".{meta_path(run_dir, step).name}.tmp")
    tmp_meta.write_text(json.dumps(asdict(meta), indent=1) + "\n")
    os.replace(tmp_meta, meta_path(run_dir, step))
    return path


def require_dump(run_dir: Path, step: int) -> Path:
    """The path of step ``step``'s dump; a DumpError naming it and the step when missing."""
    path = dump_path(run_dir, step)
    if not path.is_file():
        raise DumpError(
            f"{path}: no rollout dump for step {step}; replay needs a run trained with "
            "--dump-rollouts (or logging.dump_rollouts=true) for every replayed step"
        )
    return path


def read_step_dump(run_dir: Path, step: int, source: DumpSource) -> list[Group]:
    """The groups step ``step`` trained on, as dumped; a DumpError naming the file and the
    step when the dump is missing, damaged, or from another model or step."""
    path, mpath = require_dump(run_dir, step), meta_path(run_dir, step)
    meta = _read_meta(mpath, step)
    if meta.step != step:
        raise DumpError(f"{mpath}: the dump is of step {meta.step}, not step {step}")
    if _sha256(path) != meta.sha256:
        raise DumpError(
            f"{path}: step {step}'s dump is damaged: its bytes differ from those written "
            f"(sha256 recorded in {mpath.name})"
        )
    if (meta.model_path, meta.vocab_size) != (source.model_path, source.vocab_size):
        raise DumpError(
            f"{path}: step {step}'s dump is from another model (model.path "
            f"{meta.model_path!r}, vocabulary {meta.vocab_size}); this run's model is "
            f"{source.model_path!r} with vocabulary {source.vocab_size}"
        )
    try:
        groups = read_groups(path)
    except ValueError as exc:
        raise DumpError(f"step {step}'s dump is damaged: {exc}") from exc
    samples = sum(len(g) for g in groups)
    if samples != meta.samples or meta.trained_groups > len(groups):
        raise DumpError(
            f"{path}: step {step}'s dump holds {samples} samples in {len(groups)} groups, "
            f"{mpath.name} says {meta.samples} samples, {meta.trained_groups} trained groups"
        )
    trained = groups[: meta.trained_groups]
    _check_token_ids(path, step, trained, source.vocab_size)
    return trained


def _read_meta(mpath: Path, step: int) -> DumpMeta:
    if not mpath.is_file():
        raise DumpError(
            f"{mpath}: step {step}'s dump has no meta file (it records the model and the "
            "groups trained); re-run with --dump-rollouts to get replayable dumps"
        )
    try:
        return DumpMeta(**json.loads(mpath.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise DumpError(f"{mpath}: step {step}'s dump meta is damaged ({exc})") from exc


def _check_token_ids(path: Path, step: int, groups: list[Group], vocab_size: int) -> None:
    for group in groups:
        for s in group:
            ids = s.input_ids  # [T]; None on a sample whose fields were never built
            if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise DumpError(
                    f"{path}: step {step}, sample {s.rollout_id}: token ids outside the "
                    f"model's vocabulary [0, {vocab_size}): the dump is from another model"
                )
