"""The batcher of concurrent engine calls: one sampling key, one core, two front ends.

Requests that share a sampling key share one engine call with the largest budget and
each get their result cut to their own; an engine error reaches every request of its
call. The threaded front end (the session server) takes every queued request at once;
the asyncio front end (the verl loop) waits until every running trajectory asks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.engines.batcher import (
    AsyncGenerationBatcher,
    BatchRunner,
    GenerationBatcher,
    Request,
    cut,
    sampling_key,
)


class Echo(RolloutEngine):
    """Answers prompt p with the sampling's budget of tokens ``p[0]``, logprob -0.5 each;
    records every call's prompts and sampling."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        raise AssertionError("not used")

    def load_weights(self, state_dict, model_step: int) -> None:
        raise AssertionError("not used")

    def generate(self, prompts, sampling):
        self.calls.append(([list(p) for p in prompts], sampling))
        n = sampling.max_new_tokens
        return [Generation([p[0]] * n, [-0.5] * n, [0] * n, "length", "all") for p in prompts]


def text(tokens: list[int]) -> str:
    return f"{len(tokens)} tokens"


# --- the key and the cut ------------------------------------------------------------------


def test_sampling_key_is_every_knob_but_the_budget():
    s = SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, stop=["?", "#"])
    assert sampling_key(s) == (0.7, 0.9, 5, ("?", "#"))
    assert sampling_key(SamplingConfig(max_new_tokens=1)) == sampling_key(SamplingConfig())
    assert sampling_key(SamplingConfig(stop=["#"])) != sampling_key(SamplingConfig())


def test_cut() -> None:
    gen = Generation([5, 6, 7], [-1.0, -2.0, -3.0], [1, 1, 2], "stop", "x")
    assert cut(gen, 3, str) is gen
    short = cut(gen, 2, lambda t: " ".join(map(str, t)))
    assert short == Generation([5, 6], [-1.0, -2.0], [1, 1], "length", "5 6")


# --- the core -----------------------------------------------------------------------------


def test_one_call_per_key_with_the_largest_budget_and_each_result_cut():
    engine = Echo()
    runner = BatchRunner(engine, text)
    hot, greedy = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)
    budgets = [(hot, 2), (greedy, 3), (hot, 4), (greedy, 1)]
    requests = [
        Request([k + 1], SamplingConfig(s.temperature, max_new_tokens=n), Future())
        for k, (s, n) in enumerate(budgets)
    ]
    runner.run(requests)
    assert [(c[0], c[1].temperature, c[1].max_new_tokens) for c in engine.calls] == [
        ([[1], [3]], 1.0, 4),  # first-seen order of the keys, the larger budget
        ([[2], [4]], 0.0, 3),
    ]
    results = [r.future.result(timeout=0) for r in requests]
    assert [(g.token_ids, g.finish_reason, g.text) for g in results] == [
        ([1, 1], "length", "2 tokens"),  # cut: decoded again
        ([2, 2, 2], "length", "all"),  # its own budget: the engine's generation as is
        ([3] * 4, "length", "all"),
        ([4], "length", "1 tokens"),
    ]
    assert runner.calls == 2


def test_an_engine_error_reaches_every_request_of_its_call_only():
    class HatesGreedy(Echo):
        def generate(self, prompts, sampling):
            if sampling.temperature == 0:
                raise RuntimeError("engine down")
            return super().generate(prompts, sampling)

    runner = BatchRunner(HatesGreedy(), text)
    greedy = [Request([k], SamplingConfig(temperature=0.0), Future()) for k in (1, 2)]
    hot = Request([3], SamplingConfig(max_new_tokens=1), Future())
    runner.run([greedy[0], hot, greedy[1]])
    for r in greedy:
        with pytest.raises(RuntimeError, match="engine down"):
            r.future.result(timeout=0)
    assert hot.future.result(timeout=0).token_ids == [3]
    assert runner.calls == 2


def test_an_engine_that_drops_generations_fails_its_requests():
    class Drops(Echo):
        def generate(self, prompts, sampling):
            return super().generate(prompts, sampling)[:-1]

    requests = [Request([k], SamplingConfig(), Future()) for k in (1, 2)]
    BatchRunner(Drops(), text).run(requests)
    for r in requests:
        with pytest.raises(ValueError, match="engine returned 1 generations for 2 prompts"):
            r.future.result(timeout=0)


# --- the threaded front end (session server) ---------------------------------------------


def test_queued_requests_share_one_call_per_sampling_setting():
    engine = Echo()
    batcher = GenerationBatcher(engine, text)
    greedy, hot = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
    futures = [  # queued before the worker starts: its first batch takes them all
        batcher.submit([1], greedy),
        batcher.submit([2], hot),
        batcher.submit([3], greedy),
        batcher.submit([4, 5], SamplingConfig(temperature=1.0, max_new_tokens=2)),
    ]
    batcher.start()
    gens = [f.result(timeout=10) for f in futures]
    batcher.stop()
    assert [c[0] for c in engine.calls] == [[[1], [3]], [[2], [4, 5]]]
    assert [(c[1].temperature, c[1].max_new_tokens) for c in engine.calls] == [
        (0.0, 64),
        (1.0, 64),  # the largest budget of the two; the second reply is cut to 2
    ]
    assert [g.token_ids for g in gens] == [[1] * 64, [2] * 64, [3] * 64, [4, 4]]
    assert gens[3].text == "2 tokens"
    assert batcher.calls == 2


def test_threaded_engine_errors_reach_every_waiting_request_and_stop_refuses_new_ones():
    class Broken(Echo):
        def generate(self, prompts, sampling):
            raise RuntimeError("engine down")

    batcher = GenerationBatcher(Broken(), text)
    futures = [batcher.submit([1], SamplingConfig()), batcher.submit([2], SamplingConfig())]
    batcher.start()
    for f in futures:
        with pytest.raises(RuntimeError, match="engine down"):
            f.result(timeout=10)
    batcher.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        batcher.submit([3], SamplingConfig())


# --- the asyncio front end (verl loop) ----------------------------------------------------


def test_async_batcher_runs_one_call_with_the_largest_budget_and_cuts() -> None:
    engine = Echo()
    batcher = AsyncGenerationBatcher(engine, text)

    async def one(budget: int, temperature: float, delay: int) -> Generation:
        try:
            for _ in range(delay):  # arrive at different times
                await asyncio.sleep(0)
            return await batcher.generate([9], SamplingConfig(temperature, max_new_tokens=budget))
        finally:
            batcher.trajectory_done()

    async def main():
        batcher.add_trajectories(3)
        return await asyncio.gather(one(2, 1.0, 3), one(4, 1.0, 0), one(3, 0.0, 1))

    a, b, c = asyncio.run(main())
    assert [(len(p), s.max_new_tokens, s.temperature) for p, s in engine.calls] == [
        (2, 4, 1.0),  # the two at temperature 1 together, with the larger budget
        (1, 3, 0.0),
    ]
    assert (a.token_ids, a.text, b.token_ids, len(c.token_ids)) == ([9, 9], "2 tokens", [9] * 4, 3)
    assert (batcher.calls, batcher.requests, batcher.running) == (2, 3, 0)


def test_async_batcher_waits_for_every_running_trajectory() -> None:
    """A finished trajectory no longer holds the batch; until then, nothing runs."""
    engine = Echo()
    batcher = AsyncGenerationBatcher(engine, text)

    async def main():
        batcher.add_trajectories(2)
        first = asyncio.ensure_future(batcher.generate([1], SamplingConfig(max_new_tokens=1)))
        await asyncio.sleep(0)
        assert engine.calls == [] and not first.done()  # the other trajectory may still ask
        batcher.trajectory_done()  # ... it ended without asking: the batch runs
        gen = await first
        batcher.trajectory_done()
        return gen

    assert asyncio.run(main()).token_ids == [1]
    assert (batcher.calls, batcher.requests, batcher.running) == (1, 1, 0)
