"""export(): hand-worked canonical states per segment."""

from __future__ import annotations

import numpy as np
import pytest

from rltool.engines.base import Generation
from rltool.rollout.contract import check_sample
from rltool.rollout.state import Status
from rltool.sessions import Session, export
from rltool.sessions.export import fill_env_steps
from rltool.training.advantages import session_clusters

VOCAB = {1: "a", 2: "b", 4: "c", 5: "<e>", 6: "d"}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def gen(ids: list[int], lp: list[float], step: int) -> Generation:
    return Generation(ids, lp, [step] * len(ids), "stop", decode(ids))


def two_segment_session() -> Session:
    s = Session("ep7")
    s.commit(s.plan([6, 1], decode), gen([2, 5], [-0.5, -0.25], 3), [], tool_call=True)
    s.commit(s.plan([6, 1, 2, 5, 4, 4], decode), gen([6, 5], [-1.0, -2.0], 4), [], False)
    s.commit(s.plan([6, 4], decode), gen([1], [-0.125], 5), [], tool_call=False)  # rewrite
    return s


def test_fill_env_steps():
    steps = np.array([-1, -1, 3, 3, -1, -1, 4, -1])
    assert fill_env_steps(steps).tolist() == [3, 3, 3, 3, 3, 3, 4, 4]


def test_export_hand_worked():
    seg0, seg1 = export(two_segment_session(), "g1", "calc", 0.5)
    assert seg0.rollout_id == "ep7/seg0" and seg1.rollout_id == "ep7/seg1"
    assert seg0.session_id == seg1.session_id == "ep7"
    assert seg0.prompt_ids.tolist() == [6, 1]
    assert seg0.input_ids.tolist() == [6, 1, 2, 5, 4, 4, 6, 5]
    assert seg0.labels.tolist() == [-100, -100, 2, 5, -100, -100, 6, 5]
    assert seg0.logprobs.tolist() == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
    assert seg0.response_ids.tolist() == [2, 5, 4, 4, 6, 5]
    # tool tokens take the step of the assistant turn before them
    assert seg0.response_model_steps.tolist() == [3, 3, 3, 3, 4, 4]
    assert seg0.extra == {"tool_turns": 1, "num_turns": 2}
    assert seg1.input_ids.tolist() == [6, 4, 1] and seg1.labels.tolist() == [-100, -100, 1]
    assert seg1.response_model_steps.tolist() == [5]
    assert seg1.extra == {"tool_turns": 0, "num_turns": 1}
    for s in (seg0, seg1):
        assert s.status == Status.COMPLETED and s.reward == {"score": 0.5}
        assert (s.group_id, s.task_name) == ("g1", "calc")
        assert check_sample(s) == []
    clusters = session_clusters([[seg0, seg1]])
    assert clusters.keys == [(0, "ep7")] and clusters.cluster_S.tolist() == [0, 0]


def test_export_keeps_a_reward_mapping():
    (s, *_) = export(two_segment_session(), "g", "t", {"score": 1.0, "correct": True})
    assert s.reward == {"score": 1.0, "correct": True}


def test_failed_session_exports_failed_segments():
    session = two_segment_session()
    session.error = "turn 3: generation failed: RuntimeError('oom')"
    states = export(session, "g", "t", 0.0)
    assert [s.status for s in states] == [Status.FAILED, Status.FAILED]
    assert states[0].error == session.error


def test_empty_session_is_an_error():
    with pytest.raises(ValueError, match="'ep' recorded no turn"):
        export(Session("ep"), "g", "t", 0.0)
