"""Batches concurrent generate requests into engine calls: one key, one core, two front ends.

``GenerationBatcher`` (threads: the session server) and ``AsyncGenerationBatcher``
(coroutines: the verl agent loop). Design: docs/engines.md#batching-concurrent-requests
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.rollout.routing import NOT_ROUTED

Decode = Callable[[list[int]], str]  # token ids -> text, as the engine's Generation.text


def sampling_key(s: SamplingConfig) -> tuple:
    """What must agree for two requests to share an engine call (the budget need not)."""
    return (s.temperature, s.top_p, s.top_k, tuple(s.stop))


def cut(gen: Generation, max_new_tokens: int, decode: Decode) -> Generation:
    """``gen`` as if sampled with ``max_new_tokens``: its first tokens, finish ``length``."""
    if len(gen.token_ids) <= max_new_tokens:
        return gen
    tokens = gen.token_ids[:max_new_tokens]
    routed = None
    if gen.routed_experts is not None:  # [C + R, L, k] -> [C + max_new_tokens, L, k]
        routed = gen.routed_experts[: len(gen.routed_experts) - len(gen.token_ids) + len(tokens)]
        routed = routed.copy()
        routed[-1] = NOT_ROUTED  # the new last token is no longer fed back
    return Generation(
        token_ids=tokens,
        logprobs=gen.logprobs[:max_new_tokens],
        model_steps=gen.model_steps[:max_new_tokens],
        finish_reason="length",
        text=decode(tokens),
        routed_experts=routed,
    )


@dataclass(slots=True)
class Request:
    prompt: list[int]
    sampling: SamplingConfig
    future: Any  # a concurrent.futures.Future or an asyncio.Future: where the result goes


class BatchRunner:
    """The core both front ends share: runs batches of requests on one engine."""

    def __init__(self, engine: RolloutEngine, decode: Decode):
        self.engine = engine
        self.decode = decode
        self.calls = 0  # engine.generate calls made (counted as each call starts)

    def run(self, requests: Sequence[Request]) -> None:
        """One ``engine.generate`` per distinct ``sampling_key``, in first-seen order, with
        the largest budget of its requests; settles every request's future with its result
        cut to its budget, or with the call's exception."""
        by_key: dict[tuple, list[Request]] = {}
        for r in requests:
            by_key.setdefault(sampling_key(r.sampling), []).append(r)
        for group in by_key.values():
            budget = max(r.sampling.max_new_tokens for r in group)
            sampling = dataclasses.replace(group[0].sampling, max_new_tokens=budget)
            self.calls += 1
            try:
                gens = self.engine.generate([r.prompt for r in group], sampling)
                if len(gens) != len(group):
                    raise ValueError(
                        f"engine returned {len(gens)} generations for {len(group)} prompts"
                    )
            except Exception as exc:  # handed to every waiting request, each fails alone
                for r in group:
                    r.future.set_exception(exc)
                continue
            for r, gen in zip(group, gens, strict=True):
                own = r.sampling.max_new_tokens  # the call's budget: the generation as is
                r.future.set_result(gen if own == budget else cut(gen, own, self.decode))


_STOP = None  # queue sentinel


class GenerationBatcher:
    """One worker thread owns the engine (which is not thread-safe). While it runs a batch,
    new requests queue; its next batch takes every queued request at once. A group of
    agents running side by side thus shares batched forward passes."""

    def __init__(self, engine: RolloutEngine, decode: Decode):
        self.runner = BatchRunner(engine, decode)
        self._queue: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders submit against stop: nothing queues after stop
        self._stopped = False

    @property
    def calls(self) -> int:
        """engine.generate calls made (for tests and benchmarks)."""
        return self.runner.calls

    def start(self) -> None:
        assert self._thread is None, "the batcher is already started"
        self._thread = threading.Thread(target=self._run, name="rltool-generate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the running batch, fail whatever is still queued, join the worker."""
        with self._lock:
            self._stopped = True
            self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, prompt: Sequence[int], sampling: SamplingConfig) -> Future:
        request = Request(list(prompt), sampling, Future())
        with self._lock:
            if self._stopped:
                raise RuntimeError("the generation batcher is stopped")
            self._queue.put(request)
        return request.future

    def generate(self, prompt: Sequence[int], sampling: SamplingConfig) -> Generation:
        return self.submit(prompt, sampling).result()

    def _take_queued(self) -> tuple[list[Request], bool]:
        """Every request queued now, and whether a stop was queued among them."""
        requests, stopping = [], False
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return requests, stopping
            if request is _STOP:
                stopping = True
            else:
                requests.append(request)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                break
            more, stopping = self._take_queued()
            self.runner.run([first, *more])
            if stopping:
                break
        leftover, _ = self._take_queued()
        for request in leftover:
            request.future.set_exception(
                RuntimeError("the generation batcher stopped before this request ran")
            )


class AsyncGenerationBatcher:
    """One engine caller for the coroutines of one event loop (verl runs every trajectory
    of a step as its own coroutine, each awaiting the server between turns).

    It counts the running trajectories and holds each request until every running
    trajectory waits on one (or has finished), then runs them all as one batch: a
    step costs one engine call per turn, and the batch a request lands in does not
    depend on thread timing. All of it runs on the event loop's thread: when the
    engine runs, every trajectory is waiting for it anyway. Call
    ``add_trajectories(n)`` before starting n trajectories and ``trajectory_done()``
    as each one ends; they generate through ``await batcher.generate(prompt, sampling)``.
    """

    def __init__(self, engine: RolloutEngine, decode: Decode):
        self.runner = BatchRunner(engine, decode)
        self.running = 0  # trajectories counted and not done
        self.pending: list[Request] = []
        self.requests = 0  # generate requests served

    @property
    def calls(self) -> int:
        """engine.generate calls made."""
        return self.runner.calls

    def add_trajectories(self, n: int) -> None:
        """Count ``n`` trajectories as running. Call it before any of them starts: a
        trajectory not yet counted could miss the batch of the first turn."""
        self.running += n

    def trajectory_done(self) -> None:
        """One trajectory ended (returned or raised): the others may all be waiting now."""
        assert self.running > 0, "trajectory_done() without a running trajectory"
        self.running -= 1
        self._flush_if_all_waiting()

    async def generate(self, prompt: Sequence[int], sampling: SamplingConfig) -> Generation:
        assert self.running > 0, "generate() from a trajectory that was not counted"
        future = asyncio.get_running_loop().create_future()
        self.pending.append(Request(list(prompt), sampling, future))
        self._flush_if_all_waiting()
        return await future

    def _flush_if_all_waiting(self) -> None:
        if not self.pending or len(self.pending) < self.running:
            return
        requests, self.pending = self.pending, []
        self.requests += len(requests)
        self.runner.run(requests)
