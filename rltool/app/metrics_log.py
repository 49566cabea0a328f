"""Metrics sinks: ``metrics.jsonl`` always, TensorBoard when enabled."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is an optional extra
                raise ValueError(
                    "logging.tensorboard=true needs the tensorboard package: "
                    "pip install tensorboard"
                ) from exc
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float], **fields: Any) -> None:
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **fields, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
