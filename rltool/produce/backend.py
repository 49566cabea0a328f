"""Where rollouts are generated: the interface the producer drives.

Implemented by ``InProcessBackend`` and ``RayBackend``; a request is one group, results
come back as ``GroupOutcome`` in completion order. Design: docs/production.md#rollout-backends
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rltool.config.schema import SamplingConfig
from rltool.lora_sync import RolloutWeights
from rltool.rollout.state import RolloutState

Group = list[RolloutState]
DEFAULT_TASK = "default"  # the one task of a recipe without a ``tasks:`` list


@dataclass(slots=True)
class GroupRequest:
    task_name: str  # key of the task (its agent loop) in the backend
    task: dict[str, Any]  # one dataset row, e.g. {"question", "answer"}
    group_id: str
    n: int  # samples in the group
    sampling: SamplingConfig | None = None  # None = the loop's training sampling
    attempt: int = 0  # retries so far (worker death, expired group)


@dataclass(slots=True)
class GroupOutcome:
    request: GroupRequest
    group: Group | None  # None when error is set
    error: str | None = None  # why no group came back (worker died, loop raised)
    gen_time_s: float = 0.0  # wall time from start of generation to the group's end
    worker: str = ""  # which worker produced it (for reports)
    metrics: dict[str, float] = field(default_factory=dict)  # the loop's pop_metrics()


@dataclass(frozen=True, slots=True)
class WorkerDeath:
    """A rollout worker that died and was replaced, for the run's report."""

    worker: str  # e.g. "worker-1"
    reason: str  # what ended it, in a few words
    error: str  # the ``GroupOutcome.error`` of every group it had in flight
    restart_s: float  # from noticing the death to the replacement answering


class RolloutBackend(ABC):
    """Generates groups with the current rollout weights."""

    shares_model = False  # True: generates with the trainer's own model object (no copy)
    # True: its engines load a LoRA policy's adapters (rltool.lora_sync.AdapterPayload)
    takes_adapters = False

    @abstractmethod
    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue requests; returns at once."""

    @abstractmethod
    def collect(self, min_groups: int = 1, timeout: float | None = None) -> list[GroupOutcome]:
        """Finished groups since the last call; blocks until ``min_groups`` are ready
        (or nothing is in flight, or ``timeout`` seconds pass)."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Requests submitted and not yet collected."""

    @abstractmethod
    def update_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        """Give every worker the trainer's weights of train step ``model_step``: a LoRA
        policy's ``AdapterPayload`` where ``takes_adapters``, else a state dict."""

    @abstractmethod
    def evaluate(
        self, task_name: str, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """The task loop's ``evaluate`` on the current rollout weights."""

    def health_metrics(self) -> dict[str, float]:
        """e.g. ``workers/restarts``; empty for a backend that cannot lose workers."""
        return {}

    def pop_deaths(self) -> list[WorkerDeath]:
        """Workers that died and were replaced since the last call; none for a backend
        that cannot lose workers."""
        return []

    def close(self) -> None:  # noqa: B027 - optional: a backend holding nothing needs no close
        """Stop workers and threads; safe to call twice."""
