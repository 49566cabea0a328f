"""A stand-in RolloutWorker for the Ray backend tests: no model, timed by the request.

Imported by reference in the actor processes (Ray gives them the driver's
``sys.path``), so it stays a plain module beside the tests.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import torch
from produce_fakes import group

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.produce.backend import GroupOutcome, GroupRequest


class SleepyWorker:
    """Sleeps ``task["delay_s"]`` per request, then answers with a two-sample group;
    ``task["gate"]`` (a path): writes ``<gate>.<group_id>.started``, then waits until the
    gate file exists, so a test decides when the request ends instead of timing it;
    ``task["raise"]`` makes the whole call raise (a worker breaking its contract).
    ``shutdown`` writes ``<shutdown_dir>/<name>`` when a directory is given. The workers
    named in ``adapter_workers`` say they take LoRA adapters (``takes_adapters``)."""

    def __init__(
        self,
        recipe: RecipeConfig,
        name: str,
        shutdown_dir: Path | None = None,
        adapter_workers: Collection[str] = (),
    ):
        self.name = name
        self.shutdown_dir = shutdown_dir
        self.takes_adapters = name in adapter_workers
        self._model_step = 0
        self.weight_sum = 0.0  # sum of the last loaded weights: shows which ones arrived

    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutcome]:
        if any(r.task.get("raise") for r in requests):
            raise RuntimeError("fake loop exploded")
        out = []
        for r in requests:
            time.sleep(r.task.get("delay_s", 0.0))
            if "gate" in r.task:
                gate = Path(r.task["gate"])
                Path(f"{gate}.{r.group_id}.started").touch()
                while not gate.exists():
                    time.sleep(0.01)
            out.append(GroupOutcome(r, group(r.group_id, [self._model_step] * 4), worker=self.name))
        return out

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        self.weight_sum = float(sum(t.sum() for t in state_dict.values()))
        self._model_step = model_step

    def evaluate(self, task_name: str, tasks: list[dict], sampling: SamplingConfig) -> dict:
        return {f"eval/{task_name}/n": float(len(tasks)), "eval/weight_sum": self.weight_sum}

    def shutdown(self) -> None:
        if self.shutdown_dir is not None:
            (self.shutdown_dir / self.name).write_text("shut down")

    @property
    def model_step(self) -> int:
        return self._model_step
