"""Tiny hand-built groups for the produce tests: P = 2 prompt tokens, R = 4 response tokens."""

from __future__ import annotations

import json

from rltool.produce.buffer import ReplayBuffer
from rltool.produce.result import Accounting, Fate
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status

X = IGNORE_INDEX
PROMPT = [1, 2]
RESPONSE = [30, 31, 32, 33]  # 31 is tool output: never supervised


def generate(s: RolloutState, steps: list[int] | None, score: float | None = 1.0) -> RolloutState:
    """Fill a sample's generated fields in place, as an agent loop would; COMPLETED."""
    s.response_ids = list(RESPONSE)
    s.input_ids = [*s.prompt_ids.tolist(), *RESPONSE]
    s.labels = [X] * len(s.prompt_ids) + [30, X, 32, 33]
    s.logprobs = [0.0] * len(s.prompt_ids) + [-0.1, 0.0, -0.2, -0.3]
    s.response_model_steps = None if steps is None else list(steps)
    s.reward = None if score is None else {"score": score}
    s.response_text = "answer"
    s.finish_reason = "stop"
    s.status = Status.COMPLETED
    return s


def sample(
    rid: str, gid: str, steps: list[int] | None = None, score: float | None = 1.0
) -> RolloutState:
    state = RolloutState(
        rollout_id=rid,
        group_id=gid,
        task_name="t",
        prompt_ids=list(PROMPT),
        messages=[{"role": "user", "content": "q"}],
        extra={"ground_truth": "4"},
    )
    return generate(state, steps, score)


def group(
    gid: str, steps: list[int] | None = None, scores: tuple[float | None, ...] = (1.0, 0.0)
) -> list[RolloutState]:
    """One COMPLETED group, every member with the same model steps."""
    return [sample(f"{gid}/{i}", gid, steps, score) for i, score in enumerate(scores)]


def ids(groups: list[list[RolloutState]]) -> list[str]:
    return [s.rollout_id for g in groups for s in g]


def queued_ids(buffer: ReplayBuffer) -> dict[str, set[str]]:
    """Rollout ids queued in the buffer, by queue, read from its checkpoint state."""
    state = buffer.state_dict()
    return {
        queue: {json.loads(line)["rollout_id"] for g in state[queue] for line in g}
        for queue in ("completed", "aborted", "expired")
    }


def open_ids(accounting: Accounting, fate: Fate) -> set[str]:
    """Open samples of one fate, read from the accounting's checkpoint state."""
    return {rid for rid, f in accounting.state_dict()["open"].items() if f == fate.value}
