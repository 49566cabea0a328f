"""GenerationBatcher: queued turns share engine calls, grouped by sampling."""

from __future__ import annotations

import pytest
from session_fakes import ScriptedEngine

from rltool.config.schema import SamplingConfig
from rltool.sessions.batcher import GenerationBatcher


def test_queued_turns_share_one_call_per_sampling_setting(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b", "c", "d"])
    batcher = GenerationBatcher(engine)
    greedy, hot = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
    futures = [  # queued before the worker starts: its first call takes them all
        batcher.submit([1], greedy),
        batcher.submit([2], hot),
        batcher.submit([3], greedy),
        batcher.submit([4, 5], hot),
    ]
    batcher.start()
    texts = [f.result(timeout=10).text for f in futures]
    batcher.stop()
    assert [c[0] for c in engine.calls] == [[[1], [3]], [[2], [4, 5]]]
    assert [c[1].temperature for c in engine.calls] == [0.0, 1.0]
    assert texts == ["a", "c", "b", "d"]  # replies in engine-call order
    assert batcher.calls == 2


def test_engine_errors_reach_every_waiting_turn_and_stop_refuses_new_ones(tokenizer):
    class Broken(ScriptedEngine):
        def generate(self, prompts, sampling):
            raise RuntimeError("engine down")

    batcher = GenerationBatcher(Broken(tokenizer, []))
    futures = [batcher.submit([1], SamplingConfig()), batcher.submit([2], SamplingConfig())]
    batcher.start()
    for f in futures:
        with pytest.raises(RuntimeError, match="engine down"):
            f.result(timeout=10)
    batcher.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        batcher.submit([3], SamplingConfig())
