"""What the session-based loops share (localhost, sandbox, openenv, verifiers): session
ids and jobs, the tokenizer the session server renders with, a session's samples and the
loops' counters, and one evaluation per task.
Design: docs/agent-loops.md#the-session-server
"""

from __future__ import annotations

import copy
import logging
import math
import re
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from rltool import metric_names as mn
from rltool.agent_loops.base import AgentLoop
from rltool.agent_loops.evaluation import check_evaluation, session_eval_metrics
from rltool.config.schema import SamplingConfig
from rltool.rollout.state import RolloutState
from rltool.sessions import TOOL_CHAT_TEMPLATE, Session, export

log = logging.getLogger(__name__)

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "rltool_probe_tool", "description": "", "parameters": {}},
}


_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")


MAX_TEXT_IN_EXTRA = 2000  # characters of agent output kept in a sample's extra


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the ``tools`` it is given."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ping"}],
            tools=[_PROBE_TOOL],
            add_generation_prompt=True,
            tokenize=False,
        )
    except (TemplateError, TypeError, ValueError, KeyError):  # cannot render tools at all
        return False
    return "rltool_probe_tool" in text


def session_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer the session server renders with: ``tokenizer`` when its template
    renders tools, else a copy carrying ``TOOL_CHAT_TEMPLATE`` (ChatML templates only)."""
    if renders_tools(tokenizer):
        return tokenizer
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise ValueError(
            "the tokenizer's chat template renders no tools and is not ChatML, so rltool "
            "cannot substitute its tool template; give the checkpoint a chat template that "
            "renders `tools` and `tool_calls`"
        )
    tool_tok = copy.copy(tokenizer)  # shares the vocabulary; only the template differs
    tool_tok.chat_template = TOOL_CHAT_TEMPLATE
    log.info("session server: the chat template renders no tools; using TOOL_CHAT_TEMPLATE")
    return tool_tok


def session_ids(group_ids: Sequence[str], n: int) -> list[str]:
    """``{group_id}.{i}`` per sample, task-major, made safe for a session id.

    A group id given twice in one call (a step whose prompts cross an epoch may draw
    a prompt twice) gets ``-r{k}`` on its k-th repeat, so sessions stay distinct.
    """
    used: set[str] = set()
    ids = []
    for gid in group_ids:
        base = stem = _UNSAFE_ID_CHARS.sub("_", gid)[:96]
        repeat = 0
        while stem in used:
            repeat += 1
            stem = f"{base}-r{repeat}"
        used.add(stem)
        ids += [f"{stem}.{i}" for i in range(n)]
    return ids


def error_text(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` of an exception, one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        where = f" (at {Path(f.filename).name}:{f.lineno} in {f.name})"
    return f"{type(exc).__name__}: {exc}{where}"


def session_states(
    loop: AgentLoop,
    session: Session,
    group_id: str,
    task_name: str,
    reward: Mapping[str, Any] | None,
    error: str | None,
    extra: Mapping[str, Any] | None = None,
) -> list[RolloutState]:
    """The canonical, checked states of one finished session.

    ``reward`` None means the session has no valid reward: every segment is FAILED
    with ``error``. A session with no recorded turn becomes one FAILED sample
    without train fields (the contract's record of a sample that could not be built).
    """
    sid = session.session_id
    if not session.segments:
        why = error or "agent: made no model call; nothing to train on"
        return [
            RolloutState(
                rollout_id=f"{sid}/seg0",
                group_id=group_id,
                session_id=sid,
                task_name=task_name,
                agent_loop=loop.name,
                prompt_ids=[],
                extra=dict(extra or {}),
            ).fail(why)
        ]
    states = export(session, group_id, task_name, reward if reward is not None else 0.0)
    out = []
    for state in states:
        state.agent_loop = loop.name
        state.extra = {**(state.extra or {}), **(extra or {})}
        if reward is None:
            state.reward = None  # a placeholder score must not reach reward means
            state.fail(error or session.error or "the session has no reward")
        out.append(loop.check_train_fields(state))
    return out


def reward_mapping(value: Any) -> dict[str, Any]:
    """A judger's return value as a reward mapping with a finite float ``score``."""
    reward = dict(value) if isinstance(value, Mapping) else {"score": value}
    score = reward.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise ValueError(
            f"the judger must return a finite number or {{'score': number}}, got {value!r}"
        )
    reward["score"] = float(score)
    return reward


class LoopCounters:
    """Thread-safe counters a loop reports through ``pop_metrics``, reset on each pop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, **counts: float) -> None:
        with self._lock:
            for key, value in counts.items():
                self._counts[key] = self._counts.get(key, 0.0) + value

    def pop(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, {}
        return counts


def check_max_body_bytes(max_body_bytes: int) -> None:
    """``agent_loop.options.max_body_bytes``: the session server's request body limit."""
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(
            f"agent_loop.options.max_body_bytes must be a whole number of bytes >= 1, "
            f"got {max_body_bytes!r}"
        )


def session_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """Slash-namespaced figures from the raw counts of ``LoopCounters``."""
    sessions = max(counts.get("sessions", 0.0), 1.0)
    calls = max(counts.get("generate_calls", 0.0), 1.0)
    return {
        "agent/errors": counts.get("agent_errors", 0.0),
        mn.REWARD_ERRORS: counts.get("reward_errors", 0.0),
        "agent/sessions": counts.get("sessions", 0.0),
        "agent/segments_per_session": counts.get("segments", 0.0) / sessions,
        "agent/turns_per_session": counts.get("turns", 0.0) / sessions,
        "agent/tool_turns_per_session": counts.get("tool_turns", 0.0) / sessions,
        "agent/generate_calls": counts.get("generate_calls", 0.0),
        "agent/turns_per_generate_call": counts.get("turns", 0.0) / calls,
    }


def count_session(counters: LoopCounters, session: Session) -> None:
    counters.add(
        sessions=1,
        segments=len(session.segments),
        turns=session.num_turns,
        tool_turns=sum(s.tool_turns for s in session.segments),
    )


def regroup(flat: Sequence[list[RolloutState]], n: int) -> list[list[RolloutState]]:
    """Task-major per-session state lists -> one list of states per task."""
    return [[s for sess in flat[g * n : (g + 1) * n] for s in sess] for g in range(len(flat) // n)]


@dataclass(frozen=True, slots=True)
class SessionJob:
    """One sample's session: its task, group and session id."""

    task: dict[str, Any]
    group_id: str
    session_id: str


def session_jobs(
    tasks: Sequence[dict[str, Any]], group_ids: Sequence[str], n: int
) -> list[SessionJob]:
    """``n`` sessions per task, task-major (the order ``regroup`` undoes)."""
    sids = session_ids(group_ids, n)
    return [
        SessionJob(task, gid, sids[g * n + i])
        for g, (task, gid) in enumerate(zip(tasks, group_ids, strict=True))
        for i in range(n)
    ]


def evaluate_sessions(
    loop: AgentLoop, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
) -> dict[str, float]:
    """One session per task under ``sampling``: eval/accuracy is the mean reward score, a
    failed session counting 0 and counted by reason (``eval/failures/<reason>``); when all
    fail, EvaluationFailed. The evaluation's sessions are kept out of the training figures
    of ``loop.counters``."""
    if not tasks:
        raise ValueError("evaluate() needs at least one task")
    training_counts = loop.counters.pop()
    groups = loop.generate_groups(tasks, 1, [f"eval-{i}" for i in range(len(tasks))], sampling)
    loop.counters.pop()
    loop.counters.add(**training_counts)
    return check_evaluation(loop.task_name, session_eval_metrics(groups))
