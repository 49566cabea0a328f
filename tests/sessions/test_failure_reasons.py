"""A failed engine call in a session gives a short reason that names the exception's kind,
not the turn, so that the same failure at different turns is one reason (issue 21, item 8)."""

from __future__ import annotations

import openai
import pytest
from test_session_server import USER, FailingEngine, client_for

from rltool.agent_loops.canonical import build_or_fail
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import RolloutState, Status
from rltool.sessions.server import SessionServer


def test_an_engine_failure_reason_is_its_kind_at_any_turn(tokenizer) -> None:
    with SessionServer(FailingEngine(tokenizer, []), tokenizer) as server:
        server.open_session("s")
        with pytest.raises(openai.InternalServerError):
            client_for(server, "s").chat.completions.create(model="p", messages=[USER])
        session = server.close_session("s")
    assert session.error == "engine: RuntimeError (turn 0: RuntimeError('CUDA out of memory'))"
    assert failure_reason(session.error) == "engine: RuntimeError"


def test_mismatched_logprob_counts_are_one_reason_whatever_the_counts() -> None:
    def built(response: list[int], logprobs: list[float]) -> RolloutState:
        s = RolloutState(rollout_id="r", group_id="g", prompt_ids=[1], response_ids=response)
        return build_or_fail(s, logprobs, None)

    a, b = built([2, 3], [-0.1]), built([2, 3, 4, 5], [-0.1, -0.2])
    assert a.status == b.status == Status.FAILED
    assert "(1 response logprobs for 2 response tokens)" in a.error
    assert failure_reason(a.error) == failure_reason(b.error) == (
        "canonicalize: logprob count != token count"
    )  # fmt: skip
