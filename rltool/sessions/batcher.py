"""Batches the turns of concurrent sessions into engine calls.

One worker thread owns the engine. While it runs a batch, new turns queue; its
next call takes every queued turn at once, one ``generate`` per distinct
sampling setting. A group of agents running side by side thus shares batched
forward passes, and the engine, which is not thread-safe, sees one caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine


def sampling_key(s: SamplingConfig) -> tuple:
    return (s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop))


@dataclass(slots=True)
class _Job:
    context: list[int]
    sampling: SamplingConfig
    future: Future = field(default_factory=Future)


_STOP = None  # queue sentinel


class GenerationBatcher:
    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders submit against stop: nothing queues after stop
        self._stopped = False
        self.calls = 0  # engine.generate calls made (for tests and benchmarks)

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

    def submit(self, context: Sequence[int], sampling: SamplingConfig) -> Future:
        job = _Job(list(context), sampling)
        with self._lock:
            if self._stopped:
                raise RuntimeError("the session server is stopped")
            self._queue.put(job)
        return job.future

    def generate(self, context: Sequence[int], sampling: SamplingConfig) -> Generation:
        return self.submit(context, sampling).result()

    def _take_queued(self) -> tuple[list[_Job], bool]:
        """Every job queued now, and whether a stop was queued among them."""
        jobs, stopping = [], False
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return jobs, stopping
            if job is _STOP:
                stopping = True
            else:
                jobs.append(job)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                break
            more, stopping = self._take_queued()
            self._run_batch([first, *more])
            if stopping:
                break
        leftover, _ = self._take_queued()
        for job in leftover:
            job.future.set_exception(
                RuntimeError("the session server stopped before this turn ran")
            )

    def _run_batch(self, jobs: list[_Job]) -> None:
        by_sampling: dict[tuple, list[_Job]] = {}
        for job in jobs:
            by_sampling.setdefault(sampling_key(job.sampling), []).append(job)
        for group in by_sampling.values():
            self.calls += 1
            try:
                gens = self.engine.generate([j.context for j in group], group[0].sampling)
            except Exception as exc:  # handed to each waiting turn, which answers it as a 500
                for job in group:
                    job.future.set_exception(exc)
                continue
            assert len(gens) == len(group), "the engine must return one Generation per prompt"
            for job, gen in zip(group, gens, strict=True):
                job.future.set_result(gen)
