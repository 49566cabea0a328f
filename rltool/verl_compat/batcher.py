"""Gathers the concurrent generate requests of many agent-loop coroutines into one engine call.

verl runs every trajectory of a step as its own coroutine, each awaiting the
server between turns. The batcher counts the trajectories that are running and
holds each request until every running trajectory is waiting on one (or has
finished); then it issues ONE ``engine.generate`` per distinct sampling setting
for all of them. A step of n samples x k tasks thus costs one engine call per
turn, not one per trajectory and turn, and the batch a request lands in does
not depend on thread timing.

Requests differ in their token budget (a later turn has less room left), so the
budget is not part of the sampling key: the batch runs with the largest budget
and each result is cut to its own. Cutting a sample after ``m`` tokens gives
exactly the distribution of sampling ``m`` tokens, so this changes no result.

All of it runs on the event loop's thread: when the engine runs, every
trajectory is waiting for it anyway.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine


def batch_key(s: SamplingConfig) -> tuple:
    """What must agree for two requests to share an engine call (the budget need not)."""
    return (s.temperature, s.top_p, s.top_k, tuple(s.stop))


def cut(gen: Generation, max_new_tokens: int, decode: Callable[[list[int]], str]) -> Generation:
    """``gen`` as if sampled with ``max_new_tokens``: its first tokens, finish ``length``."""
    if len(gen.token_ids) <= max_new_tokens:
        return gen
    tokens = gen.token_ids[:max_new_tokens]
    return Generation(
        token_ids=tokens,
        logprobs=gen.logprobs[:max_new_tokens],
        model_steps=gen.model_steps[:max_new_tokens],
        finish_reason="length",
        text=decode(tokens),
    )


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    sampling: SamplingConfig
    future: asyncio.Future


class AsyncGenerationBatcher:
    """One engine caller for the coroutines of one event loop.

    ``add_trajectories(n)`` before starting n trajectories, ``trajectory_done()``
    when each one ends; their generate calls go through ``await
    batcher.generate(prompt, sampling)``.
    """

    def __init__(self, engine: RolloutEngine, decode: Callable[[list[int]], str]):
        self.engine = engine
        self.decode = decode
        self.running = 0  # trajectories counted and not done
        self.pending: list[_Request] = []
        self.calls = 0  # engine.generate calls made
        self.requests = 0  # generate requests served

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
        self.pending.append(_Request(list(prompt), sampling, future))
        self._flush_if_all_waiting()
        return await future

    def _flush_if_all_waiting(self) -> None:
        if not self.pending or len(self.pending) < self.running:
            return
        requests, self.pending = self.pending, []
        self.requests += len(requests)
        by_key: dict[tuple, list[_Request]] = {}
        for r in requests:
            by_key.setdefault(batch_key(r.sampling), []).append(r)
        for group in by_key.values():
            self._run(group)

    def _run(self, group: list[_Request]) -> None:
        budget = max(r.sampling.max_new_tokens for r in group)
        sampling = dataclasses.replace(group[0].sampling, max_new_tokens=budget)
        self.calls += 1
        try:
            gens = self.engine.generate([r.prompt for r in group], sampling)
        except Exception as exc:  # handed to every waiting trajectory, each of which fails alone
            for r in group:
                r.future.set_exception(exc)
            return
        if len(gens) != len(group):
            exc = ValueError(f"engine returned {len(gens)} generations for {len(group)} prompts")
            for r in group:
                r.future.set_exception(exc)
            return
        for r, gen in zip(group, gens, strict=True):
            r.future.set_result(cut(gen, r.sampling.max_new_tokens, self.decode))
