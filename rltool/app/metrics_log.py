"""Metrics sinks: ``metrics.jsonl`` always, and each line fanned out to the run's
experiment trackers (``rltool.app.trackers``).

A resumed run first cuts ``metrics.jsonl`` back to the lines written before its
checkpoint was saved (the checkpoint records how many), so after a hard kill and a
resume every (step, kind) appears once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltool.app.trackers import Tracker

METRICS_FILE = "metrics.jsonl"


def trim_metrics(run_dir: Path, keep_lines: int) -> list[dict[str, Any]]:
    """Keep the first ``keep_lines`` lines of ``metrics.jsonl`` (atomically) and return
    them parsed; the lines after them were written after the checkpoint was saved."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)[:keep_lines]
    tmp = path.with_name(f".{METRICS_FILE}.tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return [json.loads(line) for line in lines]


class MetricsWriter:
    def __init__(self, run_dir: Path, trackers: Sequence[Tracker] = ()) -> None:
        self.path = run_dir / METRICS_FILE
        self.lines = 0  # lines in the file, what a checkpoint records
        if self.path.is_file():
            self.lines = len(self.path.read_text(encoding="utf-8").splitlines())
        self._file = self.path.open("a", encoding="utf-8")
        self.trackers = list(trackers)

    def write(self, step: int, metrics: dict[str, float], **fields: Any) -> None:
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **fields, **clean}) + "\n")
        self._file.flush()
        self.lines += 1
        finite = {k: v for k, v in clean.items() if v is not None}
        for tracker in self.trackers:
            tracker.log(step, finite)

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.close()
