"""The AgentLoop interface: the registry of loops, construction from options, evaluate."""

from __future__ import annotations

import dataclasses

import pytest

from rltool.agent_loops.base import AGENT_LOOPS, AgentLoop, LoopContext
from rltool.config.schema import SamplingConfig


class Counting(AgentLoop):
    """A loop with one required and one optional option."""

    name = "counting"

    def __init__(self, ctx: LoopContext, *, start: int, step: int = 1):
        super().__init__(ctx)
        self.start, self.step = start, step

    def generate_groups(self, tasks, n, group_ids, sampling=None):
        return [[] for _ in tasks]

    def evaluate(self, tasks, sampling):
        return {"eval/n": float(len(tasks))}


CTX = LoopContext(engine=None, tokenizer=None, sampling=SamplingConfig(), task_name="count")


def test_builtin_loops_are_registered_under_their_names() -> None:
    assert AGENT_LOOPS.names() == ["gsm8k", "localhost", "openenv", "sandbox", "verifiers", "verl"]
    for name in AGENT_LOOPS.names():
        assert AGENT_LOOPS.get(name).name == name
    with pytest.raises(
        ValueError,
        match=r"^agent_loop\.name: unknown agent loop 'gsm9k'; known: gsm8k, localhost, openenv, "
        r"sandbox, verifiers, verl$",
    ):
        AGENT_LOOPS.get("gsm9k")
    with pytest.raises(ValueError, match="agent loop 'gsm8k' is registered twice"):
        AGENT_LOOPS.register("gsm8k")(Counting)


def test_from_config_passes_options_and_the_context() -> None:
    loop = Counting.from_config({"start": 3}, CTX)
    assert (loop.start, loop.step) == (3, 1)
    assert (loop.engine, loop.tokenizer, loop.sampling, loop.task_name) == (
        None,
        None,
        CTX.sampling,
        "count",
    )
    assert Counting.from_config({"start": 0, "step": 5}, CTX).step == 5


def test_from_config_names_an_unknown_or_missing_option() -> None:
    with pytest.raises(
        ValueError,
        match=r"^agent_loop\.options\.stpe: agent loop 'counting' has no such option; "
        r"its options: start, step$",
    ):
        Counting.from_config({"start": 0, "stpe": 2}, CTX)
    with pytest.raises(
        ValueError, match=r"^agent_loop\.options\.start is required by agent loop 'counting'$"
    ):
        Counting.from_config({"step": 2}, CTX)


def test_task_name_is_the_contexts_not_an_option() -> None:
    with pytest.raises(ValueError, match=r"agent_loop\.options\.task_name: .* has no such option"):
        Counting.from_config({"start": 0, "task_name": "x"}, CTX)
    for name in AGENT_LOOPS.names():  # no builtin loop takes it as an option either
        with pytest.raises(ValueError, match=r"options\.task_name: .* has no such option"):
            AGENT_LOOPS.get(name).from_config({"task_name": "x"}, CTX)


def test_a_loop_must_define_evaluate() -> None:
    class NoEval(AgentLoop):
        def generate_groups(self, tasks, n, group_ids, sampling=None):
            return []

    with pytest.raises(TypeError, match="evaluate"):
        NoEval(CTX)
    for name in AGENT_LOOPS.names():
        assert "evaluate" not in AGENT_LOOPS.get(name).__abstractmethods__, name


def test_the_context_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CTX.task_name = "other"  # type: ignore[misc]
