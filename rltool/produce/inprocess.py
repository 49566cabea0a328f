"""The default rollout backend: one ``RolloutWorker`` in this process.

Sync mode shares the trainer's model; async mode generates on a copy, on a background
thread. Design: docs/production.md#the-in-process-backend
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.lora import engine_model, merged_copy
from rltool.lora_sync import RolloutWeights
from rltool.produce.backend import GroupOutcome, GroupRequest, RolloutBackend
from rltool.produce.worker import RolloutWorker


def async_torch_threads() -> int:
    """Threads per side (trainer, generator) when both run at once in one process."""
    return max(1, (os.cpu_count() or 2) // 2)


class InProcessBackend(RolloutBackend):
    """One worker in this process; inline in sync mode, on a background thread in async."""

    def __init__(self, recipe: RecipeConfig, model: Any = None, tokenizer: Any = None):
        self.concurrent = recipe.produce.mode == "async"
        # sync shares the trainer's model; async generates on its own copy
        self.shares_model = model is not None and not self.concurrent
        if model is not None and self.concurrent:  # LoRA: the adapters merged into the copy
            model = merged_copy(model).requires_grad_(False)
        elif model is not None:  # LoRA: the base model with its live adapter layers
            model = engine_model(model)
        self.worker = RolloutWorker(recipe, model=model, tokenizer=tokenizer, name="inprocess")
        self.takes_adapters = self.worker.takes_adapters
        self._queued: list[GroupRequest] = []  # sync: submitted, generated at collect
        self._jobs: dict[Future, list[GroupRequest]] = {}  # async: one future per submit
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        if self.concurrent:
            torch.set_num_threads(async_torch_threads())
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="rltool-generate")

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        if not requests:
            return
        if self._executor is None:
            self._queued += requests
            return
        batch = list(requests)
        self._jobs[self._executor.submit(self.worker.generate, batch)] = batch

    def collect(self, min_groups: int = 1, timeout: float | None = None) -> list[GroupOutcome]:
        if self._executor is None:
            batch, self._queued = self._queued, []
            return self.worker.generate(batch) if batch else []
        out: list[GroupOutcome] = []
        pending = set(self._jobs)
        while pending:
            done = {f for f in pending if f.done()}
            for f in done:
                out += self._outcomes(f)
            pending -= done
            if len(out) >= min_groups or not pending:
                break
            ready, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if not ready:  # timed out
                break
        return out

    def _outcomes(self, future: Future) -> list[GroupOutcome]:
        batch = self._jobs.pop(future)
        exc = future.exception()
        if exc is None:
            return future.result()
        # RolloutWorker.generate turns loop errors into outcomes; this is the engine itself
        error = f"worker: {type(exc).__name__}: {exc} (generate raised, on worker inprocess)"
        return [GroupOutcome(r, None, error=error, worker="inprocess") for r in batch]

    @property
    def in_flight(self) -> int:
        return len(self._queued) + sum(len(b) for b in self._jobs.values())

    def update_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        if self.shares_model:
            self.worker.sync_weights(model_step)
        else:
            self.worker.load_weights(state_dict, model_step)

    def evaluate(
        self, task_name: str, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        if self._executor is None:
            return self.worker.evaluate(task_name, tasks, sampling)
        # on the generator thread: one generate at a time on the worker's model
        return self._executor.submit(self.worker.evaluate, task_name, tasks, sampling).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._jobs.clear()
        self.worker.shutdown()
