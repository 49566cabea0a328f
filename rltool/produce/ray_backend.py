"""``rollout.backend: ray``: rollout workers as Ray actors.

A dead worker is replaced and every request it held comes back as an error, never
dropped. Design: docs/production.md#the-ray-backend
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayError, RayTaskError

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.lora_sync import AdapterPayload, RolloutWeights
from rltool.produce.backend import GroupOutcome, GroupRequest, RolloutBackend, WorkerDeath
from rltool.produce.ray_deaths import death_reason, exit_reason, task_error
from rltool.produce.ray_setup import RaySession, connect_ray

log = logging.getLogger(__name__)

WorkerFactory = Callable[[RecipeConfig, str], Any]  # (recipe, name) -> a RolloutWorker-like object
MAX_RESTARTS_IN_A_ROW = 3  # a worker that dies this often without finishing a call stops the run
SHUTDOWN_WAIT_S = 10.0  # close() waits this long for workers to shut their engines down


def spread(n_requests: int, loads: Sequence[int]) -> list[tuple[int, slice]]:
    """Cut ``n_requests`` into one contiguous, near-equal batch per worker.

    Returns ``(worker index, slice of the requests)``; the largest batches go
    to the least loaded workers (``loads``: requests in flight per worker, ties
    by index). E.g. 7 requests, loads ``[5, 0, 2]``: worker 1 gets 0:3,
    worker 2 gets 3:5, worker 0 gets 5:7.
    """
    k = min(len(loads), n_requests)
    base, extra = divmod(n_requests, k) if k else (0, 0)
    order = sorted(range(len(loads)), key=lambda w: (loads[w], w))[:k]
    out, start = [], 0
    for rank, worker in enumerate(order):
        size = base + (rank < extra)
        out.append((worker, slice(start, start + size)))
        start += size
    return out


def failed_outcomes(
    requests: Sequence[GroupRequest], worker: str, error: str
) -> list[GroupOutcome]:
    """One error outcome per request: the producer retries it or counts it failed."""
    return [GroupOutcome(request=r, group=None, error=error, worker=worker) for r in requests]


class _WorkerActor:
    """A RolloutWorker in its own process; methods run in two concurrency groups
    ("generate": generate and evaluate, one at a time; "weights": load_weights and
    shutdown), so new weights arrive while a generation runs."""

    def __init__(
        self,
        recipe: RecipeConfig,
        name: str,
        factory: WorkerFactory | None,
        weights: RolloutWeights | None,
        model_step: int,
    ):
        torch.set_num_threads(recipe.rollout.worker_threads)
        if factory is None:
            from rltool.produce.worker import RolloutWorker  # the actor process imports it

            factory = lambda r, n: RolloutWorker(r, name=n)  # noqa: E731
        self.worker = factory(recipe, name)
        if weights is not None:  # a restarted worker continues from the current weights
            self.worker.load_weights(weights, model_step)

    def pid(self) -> int:
        return os.getpid()

    def model_step(self) -> int:
        return self.worker.model_step

    def takes_adapters(self) -> bool:
        return self.worker.takes_adapters

    @ray.method(concurrency_group="generate")
    def generate(self, requests: list[GroupRequest]) -> list[GroupOutcome]:
        return self.worker.generate(requests)

    @ray.method(concurrency_group="generate")
    def evaluate(
        self, task_name: str, tasks: list[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        return self.worker.evaluate(task_name, tasks, sampling)

    @ray.method(concurrency_group="weights")
    def load_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        self.worker.load_weights(state_dict, model_step)  # merged, or an AdapterPayload

    @ray.method(concurrency_group="weights")
    def shutdown(self) -> None:
        self.worker.shutdown()


_RemoteWorker = ray.remote(concurrency_groups={"generate": 1, "weights": 1})(_WorkerActor)


@dataclass(slots=True)
class _Slot:
    """One worker name and the actor currently serving it."""

    name: str
    actor: Any  # ray ActorHandle
    incarnation: int = 0  # restarts of this worker so far
    in_flight: int = 0  # requests submitted to it and not yet collected
    deaths_in_a_row: int = 0  # deaths since its last finished call


@dataclass(slots=True)
class _Call:
    """One generate call in flight: which worker (and which actor of it) has which requests."""

    slot: int
    incarnation: int
    requests: list[GroupRequest]


class RayBackend(RolloutBackend):
    """Rollout workers as Ray actors on a local Ray (default) or ``rollout.ray_address``."""

    def __init__(self, recipe: RecipeConfig, worker_factory: WorkerFactory | None = None):
        """``worker_factory(recipe, name)`` builds each actor's worker (default: RolloutWorker);
        it must be importable in the actor processes (tests pass fakes through it)."""
        rollout = recipe.rollout
        self._recipe = recipe
        self._factory = worker_factory
        self._weights: tuple[ray.ObjectRef, int] | None = None  # (ref, model_step) for restarts
        self._pending: dict[ray.ObjectRef, _Call] = {}
        self._ready: list[GroupOutcome] = []  # fetched, not yet collected
        self._restarts = 0
        self._lost = 0  # requests returned as errors because their worker died
        self._deaths: list[WorkerDeath] = []  # not yet reported (pop_deaths)
        # (worker, incarnation) -> the error of its death, one text for all its lost requests
        self._death_errors: dict[tuple[str, int], str] = {}
        self._closed = False
        start = time.perf_counter()
        self._session: RaySession = connect_ray(rollout)
        self._slots = [
            _Slot(f"worker-{i}", self._spawn(f"worker-{i}")) for i in range(rollout.num_workers)
        ]
        try:  # the first answer also says that every actor started
            takes = ray.get([s.actor.takes_adapters.remote() for s in self._slots])
        except RayActorError as e:
            self.close()
            raise RuntimeError(f"a Ray rollout worker failed to start: {e}") from e
        self.takes_adapters = self._agreed_takes_adapters(takes)
        self.ray_start_s = self._session.start_s  # ray.init alone
        self.startup_s = time.perf_counter() - start  # ray.init plus every actor ready

    # --- RolloutBackend ------------------------------------------------------------------

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        self._check_open()
        requests = list(requests)
        for w, part in spread(len(requests), [s.in_flight for s in self._slots]):
            slot = self._slots[w]
            batch = requests[part]
            ref = slot.actor.generate.remote(batch)
            self._pending[ref] = _Call(w, slot.incarnation, batch)
            slot.in_flight += len(batch)

    def collect(self, min_groups: int = 1, timeout: float | None = None) -> list[GroupOutcome]:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending and len(self._ready) < min_groups:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            done, _ = ray.wait(list(self._pending), num_returns=1, timeout=left)
            for ref in done:
                self._finish(ref)
        if self._pending:  # whatever else has finished by now, without waiting
            done, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in done:
                self._finish(ref)
        out, self._ready = self._ready, []
        return out

    @property
    def in_flight(self) -> int:
        return sum(len(c.requests) for c in self._pending.values()) + len(self._ready)

    def update_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        """One copy in the object store, loaded by every actor; returns once all have it.
        A LoRA policy's ``AdapterPayload`` (its tensors already CPU copies) goes as it is,
        to each worker's engine as in process (``RolloutWorker.load_weights``)."""
        self._check_open()
        if isinstance(state_dict, AdapterPayload):
            cpu: RolloutWeights = state_dict
        else:
            cpu = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        ref = ray.put(cpu)
        self._weights = (ref, model_step)
        acks = [(s, s.actor.load_weights.remote(ref, model_step)) for s in self._slots]
        for slot, ack in acks:
            try:
                ray.get(ack)
            except RayActorError as e:  # the replacement starts from these weights
                self._restart(slot, e)

    def evaluate(
        self, task_name: str, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """On the least loaded worker; a worker that dies meanwhile is restarted and asked again."""
        self._check_open()
        slot = min(self._slots, key=lambda s: s.in_flight)
        args = (task_name, list(tasks), sampling)
        try:
            return ray.get(slot.actor.evaluate.remote(*args))
        except RayActorError as e:
            self._restart(slot, e)
        try:
            return ray.get(slot.actor.evaluate.remote(*args))
        except RayActorError as e:
            self._restart(slot, e)
            raise RuntimeError(
                f"evaluate on {slot.name}: the worker died twice ({death_reason(e)})"
            ) from e

    def health_metrics(self) -> dict[str, float]:
        return {
            "workers/restarts": float(self._restarts),
            "workers/lost_requests": float(self._lost),
            "workers/startup_s": self.startup_s,
        }

    def pop_deaths(self) -> list[WorkerDeath]:
        out, self._deaths = self._deaths, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shut_workers_down()
        for slot in self._slots:
            ray.kill(slot.actor)
        self._pending.clear()
        if self._session.owned:
            ray.shutdown()

    # --- inspection (reports, tests, fault drills) ----------------------------------------

    def worker_names(self) -> list[str]:
        return [s.name for s in self._slots]

    def worker_steps(self) -> dict[str, int]:
        """Each worker's model step (the weights it samples from)."""
        self._check_open()
        return dict(
            zip(
                self.worker_names(),
                ray.get([s.actor.model_step.remote() for s in self._slots]),
                strict=True,
            )
        )

    def worker_pids(self) -> dict[str, int]:
        """Process id of each worker's actor (``kill -9`` one to drill a worker death)."""
        self._check_open()
        return dict(
            zip(
                self.worker_names(),
                ray.get([s.actor.pid.remote() for s in self._slots]),
                strict=True,
            )
        )

    def actor(self, name: str) -> Any:
        """The Ray actor handle currently serving worker ``name``."""
        for slot in self._slots:
            if slot.name == name:
                return slot.actor
        raise ValueError(
            f"no rollout worker named {name!r}; workers: {', '.join(self.worker_names())}"
        )

    # --- internals -------------------------------------------------------------------------

    def _agreed_takes_adapters(self, takes: list[bool]) -> bool:
        """The workers' one answer to ``takes_adapters`` (the producer sends all of them
        the same weights); workers that disagree close the backend with an error."""
        if len(set(takes)) > 1:
            self.close()
            yes = [s.name for s, t in zip(self._slots, takes, strict=True) if t]
            no = [s.name for s, t in zip(self._slots, takes, strict=True) if not t]
            raise RuntimeError(
                "Ray rollout workers disagree on LoRA adapters (their engines' takes_adapters):"
                f" {', '.join(yes)} load them, {', '.join(no)} do not, and one weight sync "
                "cannot serve both; run every worker with the same engine (rollout.engine, "
                "model.lora.sync) and the same rltool and engine versions"
            )
        return takes[0]  # rollout.num_workers >= 1

    def _shut_workers_down(self) -> None:
        """Each worker's engine releases what it holds before its actor is killed; a worker
        that is dead, fails or takes over ``SHUTDOWN_WAIT_S`` is killed all the same."""
        calls = {s.actor.shutdown.remote(): s.name for s in self._slots}
        done, late = ray.wait(list(calls), num_returns=len(calls), timeout=SHUTDOWN_WAIT_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayError as e:
                log.warning("rollout worker %s: shutdown failed: %s", calls[ref], death_reason(e))
        for ref in late:
            log.warning("rollout worker %s: no shutdown after %.0f s", calls[ref], SHUTDOWN_WAIT_S)

    def _spawn(self, name: str) -> Any:
        ref, step = self._weights if self._weights is not None else (None, 0)
        threads = self._recipe.rollout.worker_threads
        return _RemoteWorker.options(num_cpus=threads).remote(
            self._recipe, name, self._factory, ref, step
        )

    def _finish(self, ref: ray.ObjectRef) -> None:
        """Turn one finished generate call into outcomes, one per request."""
        call = self._pending.pop(ref)
        slot = self._slots[call.slot]
        slot.in_flight -= len(call.requests)
        try:
            outcomes = ray.get(ref)
        except RayActorError as e:
            self._lost += len(call.requests)
            error = self._death_error(slot.name, call.incarnation, e)
            self._ready += failed_outcomes(call.requests, slot.name, error)
            if call.incarnation == slot.incarnation:  # not yet replaced by an earlier failure
                self._restart(slot, e)
            return
        except RayTaskError as e:  # the worker broke its contract and raised
            error = f"worker {slot.name} raised: {task_error(e)}"
            self._ready += failed_outcomes(call.requests, slot.name, error)
            return
        except RayError as e:  # e.g. the result was lost with its node
            error = f"worker {slot.name} call failed: {death_reason(e)}"
            self._ready += failed_outcomes(call.requests, slot.name, error)
            return
        slot.deaths_in_a_row = 0
        self._ready += self._complete(call, slot.name, outcomes)

    @staticmethod
    def _complete(call: _Call, worker: str, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
        """The worker's outcomes, named, plus an error outcome for any request it left out."""
        for o in outcomes:
            o.worker = o.worker or worker
        returned = {o.request.group_id for o in outcomes}
        missing = [r for r in call.requests if r.group_id not in returned]
        error = f"worker {worker} returned no outcome for this group"
        return outcomes + failed_outcomes(missing, worker, error)

    def _death_error(self, worker: str, incarnation: int, err: BaseException) -> str:
        """The error of every request lost with this actor (the first failure names it)."""
        key = (worker, incarnation)
        return self._death_errors.setdefault(key, f"worker {worker} died: {death_reason(err)}")

    def _restart(self, slot: _Slot, err: BaseException) -> None:
        """Replace a dead worker's actor (same name, current weights) and wait until the
        replacement answers, so the death is reported with its cost."""
        error = self._death_error(slot.name, slot.incarnation, err)
        reason, start = exit_reason(err), time.perf_counter()
        while True:
            slot.deaths_in_a_row += 1
            if slot.deaths_in_a_row > MAX_RESTARTS_IN_A_ROW:
                raise RuntimeError(
                    f"rollout worker {slot.name} died {slot.deaths_in_a_row} times in a row "
                    f"without finishing a call; last: {death_reason(err)}"
                ) from err
            log.info("rollout worker %s died (%s); restarting it", slot.name, death_reason(err))
            ray.kill(slot.actor)  # a crashed actor may linger half-dead; make sure
            slot.actor = self._spawn(slot.name)
            slot.incarnation += 1
            self._restarts += 1
            try:
                ray.get(slot.actor.pid.remote())
                break
            except RayActorError as e:  # the replacement died while starting
                err = e
        self._deaths.append(WorkerDeath(slot.name, reason, error, time.perf_counter() - start))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Ray rollout backend is closed")
