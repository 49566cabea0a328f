"""The localhost loop: the user's agent runs in-process against the session server.

``options.agent`` and ``options.judger`` are import paths: ``agent(client, task)`` runs
with an OpenAI client bound to its own session, ``judger(task, output)`` scores it; each
session is exported with its reward. With ``options.mcp_servers`` the agent is called as
``agent(client, task, tools)``, ``tools`` the MCP servers' (``mcp_tools.McpTools``).
Design: docs/agent-loops.md#the-localhost-loop
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
import math
import re
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from rltool import metric_names as mn
from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.evaluation import check_evaluation, session_eval_metrics
from rltool.agent_loops.mcp_options import mcp_metrics, mcp_options, mcp_problems
from rltool.agent_loops.mcp_tools import McpTools, open_tools
from rltool.config.schema import SamplingConfig
from rltool.rollout.state import RolloutState
from rltool.sessions import TOOL_CHAT_TEMPLATE, Session, SessionServer, export
from rltool.sessions.server import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "rltool_probe_tool", "description": "", "parameters": {}},
}
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")
MAX_TEXT_IN_EXTRA = 2000  # characters of agent output kept in a sample's extra
OPENAI_MISSING = "the localhost loop hands agents an openai.OpenAI client: pip install openai"


# --- helpers shared with the sandbox loop -------------------------------------------------


def load_callable(path: str, option: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function; ValueError naming the recipe option."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent_loop.options.{option}: {path!r} must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"agent_loop.options.{option}: cannot import {module_name!r} ({exc})"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"agent_loop.options.{option}: {module_name} has no callable {attr!r}")
    return fn


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


# --- the loop -----------------------------------------------------------------------------


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


@register("localhost")
class LocalhostLoop(AgentLoop):
    """In-process agents, one session each, all of a step at once on a thread pool."""

    def __init__(
        self,
        ctx: LoopContext,
        *,
        agent: str,
        judger: str,
        max_concurrent: int = 256,
        request_timeout_s: float = 600.0,
        honor_sampling: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        mcp_servers: Sequence[Any] | None = None,
        mcp_tool_timeout_s: float = 30.0,
        mcp_start_timeout_s: float = 60.0,
    ):
        try:
            import openai
        except ImportError as exc:
            raise ValueError(OPENAI_MISSING) from exc
        if max_concurrent < 1:
            raise ValueError(
                f"agent_loop.options.max_concurrent must be >= 1, got {max_concurrent}"
            )
        check_max_body_bytes(max_body_bytes)
        super().__init__(ctx)
        self._openai = openai
        self.agent = load_callable(agent, "agent")
        self.judger = load_callable(judger, "judger")
        self.mcp = mcp_options(
            mcp_servers, mcp_tool_timeout_s, mcp_start_timeout_s, self.agent, agent
        )
        self.max_concurrent = max_concurrent
        self.request_timeout_s = request_timeout_s
        self.honor_sampling = honor_sampling
        self.max_body_bytes = max_body_bytes
        self.server_tokenizer = session_tokenizer(ctx.tokenizer)
        self.counters = LoopCounters()

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """openai installed; the agent and the judger the options name importable; the MCP
        client and the servers' programs when ``mcp_servers`` is set."""
        problems = []
        if importlib.util.find_spec("openai") is None:
            problems.append(OPENAI_MISSING)
        if options.get("mcp_servers") is not None:
            problems += mcp_problems(options["mcp_servers"])
        for option in ("agent", "judger"):
            if isinstance(options.get(option), str):
                try:
                    load_callable(options[option], option)
                except ValueError as exc:
                    problems.append(str(exc))
        return problems

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` agent sessions per task, run concurrently; their segments grouped per task."""
        self.check_group_args(tasks, n, group_ids)
        jobs = session_jobs(tasks, group_ids, n)
        # One HTTP client shared by the call's sessions: one per OpenAI client would cost
        # an SSL context each (~0.4 s of CPU). Closed before the server stops, so no
        # keep-alive connection (and its server thread) outlives the call.
        http = self._openai.DefaultHttpxClient(timeout=self.request_timeout_s)
        # MCP servers per call too, shared by its sessions (docs/agent-loops.md#mcp-tools)
        mcp = open_tools(self.mcp)
        with self._server(sampling or self.sampling) as server, http, mcp as tools:
            workers = min(self.max_concurrent, len(jobs))
            with ThreadPoolExecutor(workers, thread_name_prefix="rltool-agent") as pool:
                flat = list(pool.map(lambda j: self._run_session(server, http, j, tools), jobs))
            self.counters.add(generate_calls=server.batcher.calls)
        return regroup(flat, n)

    @contextmanager
    def _server(self, sampling: SamplingConfig) -> Iterator[SessionServer]:
        # One server per call: nothing outlives the step, and the sampling is the call's.
        server = SessionServer(
            self.engine,
            self.server_tokenizer,
            sampling,
            honor_sampling=self.honor_sampling,
            max_body_bytes=self.max_body_bytes,
        )
        with server:
            yield server

    def _run_session(
        self, server: SessionServer, http: Any, job: SessionJob, mcp: Any = None
    ) -> list[RolloutState]:
        server.open_session(job.session_id)
        client = self._openai.OpenAI(
            base_url=server.base_url(job.session_id),
            api_key="rltool",
            max_retries=0,
            timeout=self.request_timeout_s,
            http_client=http,  # shared: not closed per session
        )
        tools = None if mcp is None else McpTools(mcp, self.counters)
        output, error = None, None
        try:
            if tools is None:
                output = self.agent(client, job.task)
            elif tools.failure is None:  # else the call's MCP servers did not start
                output = self.agent(client, job.task, tools)
        except Exception as exc:  # the agent's failure is recorded on its samples, counted
            error = f"agent: {error_text(exc)}"
        if tools is not None and tools.failure is not None:  # counted by McpTools
            error = tools.failure
        elif error is not None:
            self.counters.add(agent_errors=1)
            log.warning("session %s: %s", job.session_id, error)
        session = server.close_session(job.session_id)
        count_session(self.counters, session)
        reward = None
        if error is None and session.error is None and session.segments:
            reward, error = self._judge(job, output)
        extra = {"agent_output": output[:MAX_TEXT_IN_EXTRA]} if isinstance(output, str) else {}
        return session_states(self, session, job.group_id, self.task_name, reward, error, extra)

    def _judge(self, job: SessionJob, output: Any) -> tuple[dict[str, Any] | None, str | None]:
        try:
            return reward_mapping(self.judger(job.task, output)), None
        except Exception as exc:  # a reward that cannot be computed fails the sample, counted
            self.counters.add(reward_errors=1)
            return None, f"reward: judger raised {error_text(exc)}"

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: agent/reward errors, sessions, turns and batching figures
        (and ``mcp/*`` with MCP servers)."""
        counts = self.counters.pop()
        return {**session_metrics(counts), **(mcp_metrics(counts) if self.mcp else {})}

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """One session per task under ``sampling``: eval/accuracy is the mean judged score
        (the fraction solved for a 0/1 judger), a failed session counting 0 and counted by
        reason (``eval/failures/<reason>``); when all fail, EvaluationFailed."""
        if not tasks:
            raise ValueError("evaluate() needs at least one task")
        training_counts = self.counters.pop()  # evaluation sessions are not training figures
        groups = self.generate_groups(tasks, 1, [f"eval-{i}" for i in range(len(tasks))], sampling)
        self.counters.pop()
        self.counters.add(**training_counts)
        return check_evaluation(self.task_name, session_eval_metrics(groups))
