"""Reading a run directory back: its ``metrics.jsonl`` lines (train and eval), its
resolved recipe, and the figures ``rltool report`` draws from them. Pure reads.
Design: docs/app.md#the-report
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltool import metric_names as mn
from rltool.app.metrics_log import METRICS_FILE
from rltool.config.loader import RUN_CONFIG

TRAIN, EVAL = "train", "eval"  # the ``kind`` of a metrics line (driver.py)
RESUMES_FILE = "resumes.jsonl"

# names that runs wrote before a rename -> the name the figure has now (rltool/metric_names.py);
# a line keeps a name it already has under the new spelling
OLD_NAMES: dict[str, str] = {
    "staleness/stale_tokens_masked": mn.STALE_TOKENS,
    "rollout/response_tokens_mean": mn.ROLLOUT_RESPONSE_LEN_MEAN,
    "eval/mean_response_len": mn.EVAL_RESPONSE_LEN_MEAN,
}


@dataclass(slots=True)
class RunRecord:
    name: str  # the legend label: the directory name, made unique among the runs shown
    path: Path
    lines: dict[str, list[dict[str, Any]]]  # kind -> lines in step order, one per step
    config_text: str | None  # config.yaml as written, None when the run has none
    resumes: int = 0  # lines of resumes.jsonl
    notes: list[str] = field(default_factory=list)  # what was read around (a cut last line)

    def keys(self, kind: str) -> set[str]:
        return {k for line in self.lines.get(kind, []) for k in line}


@dataclass(slots=True, frozen=True)
class Series:
    """One metric of one run over steps; None where the figure was not finite."""

    key: str
    steps: tuple[int, ...]
    values: tuple[float | None, ...]


@dataclass(slots=True, frozen=True)
class RunSummary:
    steps: int  # the last trained step
    final_accuracy: float | None  # eval/accuracy at the last evaluation
    final_accuracy_step: int | None
    best_accuracy: float | None
    best_accuracy_step: int | None
    time_s: float  # time/step of every step plus time/eval of every evaluation


def read_run(run_dir: Path, name: str | None = None) -> RunRecord:
    """The run at ``run_dir``; a ValueError naming the directory when it is not a run
    (no ``metrics.jsonl``), and the file and line when a line is not a metrics object.
    A last line cut short (a run killed mid-write) is left out with a note. A (step, kind)
    written twice keeps its last line."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory; give a run directory (runs/<name>)")
    if not path.is_file():
        raise ValueError(
            f"{run_dir}: no {METRICS_FILE} in it; give a directory that `rltool train` "
            "wrote (runs/<name>)"
        )
    text = path.read_text(encoding="utf-8")
    rows = text.splitlines()
    by_kind: dict[str, dict[int, dict[str, Any]]] = {}
    notes: list[str] = []
    for number, row in enumerate(rows, start=1):
        if not row.strip():
            continue
        try:
            line = json.loads(row)
        except json.JSONDecodeError as exc:
            if number == len(rows) and not text.endswith("\n"):
                notes.append(f"{path}: line {number} is cut short (left out)")
                continue
            raise ValueError(f"{path}: line {number} is not JSON ({exc.msg})") from exc
        if not isinstance(line, dict) or not isinstance(line.get("step"), int):
            raise ValueError(f"{path}: line {number} is not a metrics line (no integer 'step')")
        by_kind.setdefault(str(line.get("kind", TRAIN)), {})[line["step"]] = renamed(line)
    config = run_dir / RUN_CONFIG
    resumes = run_dir / RESUMES_FILE
    return RunRecord(
        name=name or run_dir.resolve().name,
        path=run_dir,
        lines={kind: [lines[s] for s in sorted(lines)] for kind, lines in by_kind.items()},
        config_text=config.read_text(encoding="utf-8") if config.is_file() else None,
        resumes=len(resumes.read_text(encoding="utf-8").splitlines()) if resumes.is_file() else 0,
        notes=notes,
    )


def renamed(line: dict[str, Any]) -> dict[str, Any]:
    """A metrics line with every old name (``OLD_NAMES``) under its new one; per-task
    evaluation figures (``eval/<task>/mean_response_len``) too."""
    out = {key: value for key, value in line.items() if _new_name(key) == key}
    for key, value in line.items():
        out.setdefault(_new_name(key), value)  # a figure also under its new name keeps it
    return out


def _new_name(key: str) -> str:
    if key in OLD_NAMES:
        return OLD_NAMES[key]
    task, _, figure = key.removeprefix(mn.EVAL).rpartition("/")
    old = f"{mn.EVAL}{figure}"
    if key.startswith(mn.EVAL) and task and old in OLD_NAMES:
        return mn.eval_of_task(OLD_NAMES[old], task)
    return key


def read_runs(run_dirs: list[Path]) -> list[RunRecord]:
    """Each run read, named by its directory; runs whose directories share a name are
    named by as many trailing path parts as tell them apart (``a/demo``, ``b/demo``)."""
    paths = [Path(p).resolve() for p in run_dirs]
    return [read_run(d, name) for d, name in zip(run_dirs, unique_names(paths), strict=True)]


def unique_names(paths: list[Path]) -> list[str]:
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) for p in paths]
        longest = max((len(p.parts) for p in paths), default=0)
        if len(set(names)) == len(names) or depth >= longest:
            return names
        depth += 1


def match_key(pattern: str, key: str) -> str | None:
    """What the ``*`` of ``pattern`` matched in ``key`` (one or more characters, slashes
    too), "" when a pattern without ``*`` is ``key``; None when ``key`` does not match."""
    if "*" not in pattern:
        return "" if key == pattern else None
    found = re.fullmatch(re.escape(pattern).replace(r"\*", "(.+)"), key)
    return found.group(1) if found else None


def matching_keys(run: RunRecord, kind: str, pattern: str) -> list[str]:
    """The run's keys of ``kind`` lines that match ``pattern``, sorted."""
    return sorted(k for k in run.keys(kind) - {"step", "kind"} if match_key(pattern, k) is not None)


def series(run: RunRecord, kind: str, key: str) -> Series:
    """``key`` over the ``kind`` lines that hold it (JSON null, a non-finite figure, as
    None)."""
    steps, values = [], []
    for line in run.lines.get(kind, []):
        if key in line:
            value = line[key]
            steps.append(line["step"])
            values.append(float(value) if value is not None else None)
    return Series(key, tuple(steps), tuple(values))


def summarize(run: RunRecord) -> RunSummary:
    train, evals = run.lines.get(TRAIN, []), run.lines.get(EVAL, [])
    acc = [(line["step"], line.get(mn.EVAL_ACCURACY)) for line in evals]
    acc = [(step, a) for step, a in acc if a is not None]
    final = acc[-1] if acc else (None, None)
    best = max(acc, key=lambda sa: (sa[1], -sa[0])) if acc else (None, None)
    times = [line.get(mn.TIME_STEP) for line in train] + [line.get(mn.TIME_EVAL) for line in evals]
    return RunSummary(
        steps=train[-1]["step"] if train else 0,
        final_accuracy=final[1],
        final_accuracy_step=final[0],
        best_accuracy=best[1],
        best_accuracy_step=best[0],
        time_s=math.fsum(t for t in times if t is not None),
    )
