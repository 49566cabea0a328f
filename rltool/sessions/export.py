"""A recorded session as canonical RolloutStates, one per segment.

Per segment (rollout_id ``{session_id}/seg{k}``, all sharing ``session_id`` so
advantages treat the session as one cluster):

    prompt_ids   = the segment's first render            [P]
    input_ids    = everything recorded                   [T]
    labels       = the id at generated tokens, else -100 [T]
    logprobs     = engine logprob there, else 0.0        [T]
    response_ids = input_ids[P:]                         [R]
    response_model_steps: a generated token keeps its engine step; an
        environment token takes the step of the last generated token before it,
        or of the first generated token after it when none precedes it.
    routed_experts [T, L, k] (MoE, when the engine records routing): each turn's
        routing stitched as its tokens are; a row holds the routing of the turn
        that first fed the token (``rollout.routing.stitch_turns``).

Every segment gets the session's reward. A session whose engine failed exports
FAILED segments carrying the error: the agent did not finish, so its reward
means nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rltool.rollout.routing import stitch_turns
from rltool.rollout.state import RolloutState, Status
from rltool.sessions.session import ENV_STEP, Segment, Session


def fill_env_steps(steps_T: np.ndarray) -> np.ndarray:
    """Replace ENV_STEP entries with the step of the nearest generated token before them
    (after them at the start). Needs at least one generated token."""
    known_T = steps_T != ENV_STEP  # [T]
    assert known_T.any(), "a segment holds at least one generation"
    last_T = np.maximum.accumulate(np.where(known_T, np.arange(steps_T.size), -1))  # [T]
    first = int(np.argmax(known_T))
    return steps_T[np.where(last_T >= 0, last_T, first)]  # [T]


def _segment_state(
    session: Session, k: int, seg: Segment, group_id: str, task_name: str, reward: dict[str, Any]
) -> RolloutState:
    p = seg.prompt_len
    ids_T = np.asarray(seg.ids, dtype=np.int64)  # [T]
    steps_T = fill_env_steps(np.asarray(seg.steps, dtype=np.int64))  # [T]
    state = RolloutState(
        rollout_id=f"{session.session_id}/seg{k}",
        group_id=group_id,
        session_id=session.session_id,
        task_name=task_name,
        messages=seg.messages,
        prompt_ids=ids_T[:p],
        response_ids=ids_T[p:],
        response_text=seg.reply_text,
        finish_reason=seg.finish_reason,
        reward=dict(reward),
        status=Status.COMPLETED,
        extra={"tool_turns": seg.tool_turns, "num_turns": seg.num_turns},
        input_ids=ids_T,
        labels=seg.labels,
        logprobs=seg.logprobs,
        response_model_steps=steps_T[p:],
    )
    if session.error is not None:
        return state.fail(session.error)
    if seg.routings and len(seg.routings) != seg.num_turns:
        return state.fail(
            f"the engine recorded MoE routing for {len(seg.routings)} of {seg.num_turns} turns"
        )
    if seg.routings:
        state.routed_experts = stitch_turns(len(seg.ids), seg.routings)  # [T, L, k]
    return state


def export(
    session: Session, group_id: str, task_name: str, reward: float | Mapping[str, Any]
) -> list[RolloutState]:
    """One canonical RolloutState per segment of ``session``; ``reward`` is a score
    or a reward mapping holding ``score``."""
    if not session.segments:
        raise ValueError(f"session {session.session_id!r} recorded no turn; nothing to export")
    reward = {"score": float(reward)} if isinstance(reward, int | float) else dict(reward)
    return [
        _segment_state(session, k, seg, group_id, task_name, reward)
        for k, seg in enumerate(session.segments)
    ]
