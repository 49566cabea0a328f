"""Prompts for each step, drawn per task: one ``PromptSampler`` per task.

Each step's groups are split between tasks by weight with ``allocate`` (floor,
then largest remainder). A single-task recipe draws exactly the prompts
``PromptSampler(seed)`` draws.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from rltool.produce.allocation import allocate
from rltool.produce.sampler import PromptSampler
from rltool.produce.task_specs import TaskSpec


def task_seed_offset(name: str, n_tasks: int) -> int:
    """Seed offset of a task's prompt order: 0 for a lone task (``PromptSampler(seed)``'s
    order), else a hash of its name, so listing tasks in another order keeps each task's
    prompts."""
    return 0 if n_tasks == 1 else zlib.crc32(name.encode("utf-8"))


class TaskSampler:
    """One ``PromptSampler`` per task; each ``take`` splits the groups by weight."""

    def __init__(
        self,
        specs: Sequence[TaskSpec],
        train_rows: Mapping[str, list[dict]],
        seed: int,
        shuffle: bool,
    ) -> None:
        missing = [s.name for s in specs if s.name not in train_rows]
        if missing:
            raise ValueError(f"no training rows given for task(s) {missing}")
        self.weights = {s.name: s.weight for s in specs}
        self.rows = {s.name: train_rows[s.name] for s in specs}
        self.samplers: dict[str, PromptSampler] = {}
        for s in specs:
            if not self.rows[s.name]:
                raise ValueError(f"task {s.name!r} has no training rows")
            seed_s = seed + task_seed_offset(s.name, len(specs))
            self.samplers[s.name] = PromptSampler(len(self.rows[s.name]), seed_s, shuffle)

    def take(self, n_groups: int) -> list[tuple[str, int, dict]]:
        """(task name, row index, row) for the next ``n_groups`` prompts, tasks in spec order."""
        out: list[tuple[str, int, dict]] = []
        for name, k in allocate(n_groups, self.weights).items():
            rows = self.rows[name]
            out.extend((name, i, rows[i]) for i in self.samplers[name].take(k))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": {name: s.state_dict() for name, s in self.samplers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["tasks"]
        if set(saved) != set(self.samplers):
            raise ValueError(
                f"checkpoint was taken with tasks {sorted(saved)}, the recipe now has "
                f"{sorted(self.samplers)}; resume with the same tasks"
            )
        for name, sampler in self.samplers.items():
            try:
                sampler.load_state_dict(saved[name])
            except ValueError as exc:
                raise ValueError(f"task {name!r}: {exc}") from exc
