"""A rollout worker: an engine plus the agent loops of every task; no trainer, no optimizer.

Design: docs/production.md#the-rollout-worker
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.engines.batcher import sampling_key
from rltool.engines.registry import build_engine
from rltool.lora_sync import RolloutWeights
from rltool.produce.backend import GroupOutcome, GroupRequest
from rltool.produce.task_loops import build_task_loops

# GroupOutcome.metrics key: wall-clock time (time.time()) at which the group's
# generation ended, so the producer can measure generation/training overlap
# across processes. The producer pops it before aggregating loop metrics.
FINISHED_AT = "time/finished_at"


def _batch_key(r: GroupRequest) -> tuple:
    # a loop generates a batch with one sampling: its budget must agree too (None: the loop's)
    s = r.sampling
    return r.task_name, r.n, None if s is None else (sampling_key(s), s.max_new_tokens)


def batches(requests: Sequence[GroupRequest]) -> list[list[GroupRequest]]:
    """Requests split into batches of one task, group size and sampling, in first-seen order."""
    out: dict[tuple, list[GroupRequest]] = {}
    for r in requests:
        out.setdefault(_batch_key(r), []).append(r)
    return list(out.values())


class RolloutWorker:
    """An engine plus the agent loops of every task; no trainer, no optimizer."""

    def __init__(
        self,
        recipe: RecipeConfig,
        model: Any = None,
        tokenizer: Any = None,
        name: str = "worker-0",
    ):
        if model is None:
            from rltool.models import load_model_and_tokenizer

            model, tokenizer, _ = load_model_and_tokenizer(recipe.model)
        if tokenizer is None:
            raise ValueError(f"RolloutWorker {name}: a model was given without its tokenizer")
        self.name = name
        self.engine = build_engine(recipe.rollout, recipe.model, model, tokenizer)
        if recipe.trainer.deterministic:  # an engine that cannot is warned about at start
            self.engine.seed_per_sample(recipe.trainer.seed)
        self.loops = build_task_loops(recipe, self.engine, tokenizer)

    @property
    def model_step(self) -> int:
        return self.engine.model_step

    @property
    def takes_adapters(self) -> bool:
        """Whether ``load_weights`` takes a LoRA policy's ``AdapterPayload`` (its engine's)."""
        return self.engine.takes_adapters

    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutcome]:
        """One outcome per request, in request order within each batch."""
        out: list[GroupOutcome] = []
        for batch in batches(requests):
            out += self._generate_batch(batch)
        return out

    def _generate_batch(self, batch: list[GroupRequest]) -> list[GroupOutcome]:
        first = batch[0]
        t0 = time.perf_counter()
        loop = self.loops.get(first.task_name)
        if loop is None:
            known = ", ".join(sorted(self.loops))
            why = f"worker: unknown task {first.task_name!r} (known: {known})"
            return self._failed(batch, why, t0)
        try:
            groups = loop.generate_groups(
                [r.task for r in batch], first.n, [r.group_id for r in batch], first.sampling
            )
            metrics = loop.pop_metrics() | self.engine.pop_metrics()
        except Exception as exc:  # a loop's bug or environment failure: outcomes, not a crash
            return self._failed(batch, f"{loop.name}: {type(exc).__name__}: {exc}", t0)
        if len(groups) != len(batch):
            why = f"worker: loop {loop.name!r} returned {len(groups)} groups for {len(batch)} tasks"
            return self._failed(batch, why, t0)
        elapsed, end = time.perf_counter() - t0, time.time()
        # the loop's counters belong to the whole batch: they ride on its first outcome
        return [
            GroupOutcome(
                request=r,
                group=g,
                gen_time_s=elapsed,
                worker=self.name,
                metrics=({**metrics} if i == 0 else {}) | {FINISHED_AT: end},
            )
            for i, (r, g) in enumerate(zip(batch, groups, strict=True))
        ]

    def _failed(self, batch: list[GroupRequest], error: str, t0: float) -> list[GroupOutcome]:
        """Error outcomes: ``error`` starts with its short reason (``gsm8k: ValueError``,
        rltool.rollout.failures), the worker's name follows."""
        elapsed, end = time.perf_counter() - t0, time.time()
        return [
            GroupOutcome(
                request=r,
                group=None,
                error=f"{error} (on worker {self.name})",
                gen_time_s=elapsed,
                worker=self.name,
                metrics={FINISHED_AT: end},
            )
            for r in batch
        ]

    def load_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        """Merged weights, or an ``AdapterPayload`` where ``takes_adapters``: the engine
        loads either (in process and in a Ray actor alike)."""
        self.engine.load_weights(state_dict, model_step)

    def sync_weights(self, model_step: int) -> None:
        """Shared-model case (sync, in process): only the step that stamps tokens changes."""
        self.engine.sync_weights(model_step)

    def shutdown(self) -> None:
        """The run is ending: the engine releases what it holds."""
        self.engine.shutdown()

    def evaluate(
        self, task_name: str, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        if task_name not in self.loops:
            known = ", ".join(sorted(self.loops))
            raise ValueError(f"evaluate: unknown task {task_name!r}; known: {known}")
        return self.loops[task_name].evaluate(tasks, sampling)
