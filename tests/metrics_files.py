"""Hand-written run directories for the report's tests: a metrics.jsonl of the lines
given (one JSON object per line) and, optionally, a config.yaml."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(run_dir: Path, lines: list[dict], config: str | None = "model:\n  path: x\n") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
    if config is not None:
        (run_dir / "config.yaml").write_text(config, encoding="utf-8")
    return run_dir


def train_line(step: int, metrics: dict[str, float | None]) -> dict:
    return {"step": step, "kind": "train", **metrics}


def eval_line(step: int, metrics: dict[str, float | None]) -> dict:
    return {"step": step, "kind": "eval", **metrics}
