"""MoE routing of agentic samples: each turn's routing stitched into the segment as its tokens
are (``stitch_turns``), hand-worked with one layer and one expert per token."""

from __future__ import annotations

import numpy as np
import pytest

from rltool.engines.base import Generation
from rltool.engines.batcher import cut
from rltool.rollout.contract import check_samples
from rltool.rollout.routing import NOT_ROUTED, stitch_turns
from rltool.rollout.state import Status
from rltool.sessions import Session, export
from rltool.verl_compat.server import TrajectoryServer

VOCAB = {1: "a", 2: "b", 4: "c", 5: "<e>", 6: "d"}
X = NOT_ROUTED


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def rows(*experts: int) -> np.ndarray:
    return np.array(experts, dtype=np.int64).reshape(-1, 1, 1)  # [T, L=1, k=1]


def gen(ids: list[int], routing: np.ndarray | None) -> Generation:
    return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop", decode(ids), routing)


def flat(e: np.ndarray) -> list[int]:
    return e.reshape(-1).tolist()


def routed_session() -> Session:
    """Segment 0: prompt [6 1], reply [2 5], tool tokens [4 4], reply [6 5]; the second turn
    routes the first turn's tokens to expert 7 (a re-prefill that disagrees). Segment 1: a
    rewrite, prompt [6 4], reply [1]."""
    s = Session("ep")
    s.commit(s.plan([6, 1], decode), gen([2, 5], rows(0, 1, 2, X)), [], tool_call=True)
    turn = s.plan([6, 1, 2, 5, 4, 4], decode)
    s.commit(turn, gen([6, 5], rows(7, 7, 7, 3, 4, 5, 6, X)), [], tool_call=False)
    s.commit(s.plan([6, 4], decode), gen([1], rows(1, 2, X)), [], tool_call=False)
    return s


def test_each_turn_routing_is_stitched_as_its_tokens_are():
    seg0, seg1 = export(routed_session(), "g", "calc", 1.0)
    # positions 0-2: turn 1's prefill and decode; 3 (turn 1's last token, never fed by turn
    # 1), 4-5 (tool tokens): turn 2's prefill; 6: turn 2's decode; 7: never fed
    assert seg0.input_ids.tolist() == [6, 1, 2, 5, 4, 4, 6, 5]
    assert flat(seg0.routed_experts) == [0, 1, 2, 3, 4, 5, 6, X]
    assert seg1.input_ids.tolist() == [6, 4, 1] and flat(seg1.routed_experts) == [1, 2, X]
    assert check_samples([seg0, seg1], num_experts=8).violations == [[], []]


def test_a_dense_session_carries_no_routing():
    s = Session("d")
    s.commit(s.plan([6, 1], decode), gen([2], None), [], tool_call=False)
    (seg,) = export(s, "g", "t", 0.0)
    assert seg.routed_experts is None and seg.status == Status.COMPLETED


def test_routing_for_some_turns_only_fails_the_segment():
    s = Session("m")
    s.commit(s.plan([6, 1], decode), gen([2], rows(0, 1, X)), [], tool_call=True)
    s.commit(s.plan([6, 1, 2, 4], decode), gen([5], None), [], tool_call=False)
    (seg,) = export(s, "g", "t", 0.0)
    assert seg.status == Status.FAILED and "routing for 1 of 2 turns" in seg.error


def test_routing_of_the_wrong_length_is_refused():
    s = Session("w")
    with pytest.raises(ValueError, match="routing for 2 positions; the turn has 2 context"):
        s.commit(s.plan([6, 1], decode), gen([2], rows(0, X)), [], tool_call=False)


def test_stitch_keeps_the_first_feed_and_drops_rows_past_the_sequence():
    turns = [rows(0, 1, X), rows(9, 9, 2, 3, X)]
    assert flat(stitch_turns(5, turns)) == [0, 1, 2, 3, X]
    assert flat(stitch_turns(4, turns)) == [0, 1, 2, 3]  # a loop that cut its last token
    assert flat(stitch_turns(6, turns)) == [0, 1, 2, 3, X, X]  # trailing tool tokens: unfed
    with pytest.raises(ValueError, match="different shapes"):
        stitch_turns(3, [rows(0, X), np.zeros((3, 2, 1), np.int64)])


def test_cut_generation_drops_the_routing_of_the_cut_tokens():
    g = gen([2, 5, 6], rows(0, 1, 2, 3, X))  # context of 2, 3 generated
    short = cut(g, 1, decode)
    assert short.token_ids == [2] and flat(short.routed_experts) == [0, 1, X]
    assert flat(g.routed_experts) == [0, 1, 2, 3, X]  # the engine's array is left alone


def test_verl_trajectory_routing_is_stitched_over_its_turns():
    server = TrajectoryServer(None, 16, 16, str)  # type: ignore[arg-type]
    server.prompts = [[6, 1], [6, 1, 2, 5, 4]]
    server.generations = [gen([2, 5], rows(0, 1, 2, X)), gen([6], rows(7, 7, 7, 3, 4, X))]
    ids = np.array([6, 1, 2, 5, 4, 6])
    assert flat(server.routed_experts(ids)) == [0, 1, 2, 3, 4, X]
    server.prompts[1] = [6, 1, 2, 4, 4]  # a re-rendered conversation: no place for it
    with pytest.raises(ValueError, match="turn 1's prompt is not a prefix"):
        server.routed_experts(ids)
    server.generations[1] = gen([6], None)
    with pytest.raises(ValueError, match="all but 1 turns"):
        server.routed_experts(ids)
    server.generations = [gen([2], None)]
    assert server.routed_experts(ids) is None
