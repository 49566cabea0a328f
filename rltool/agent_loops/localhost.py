"""The localhost loop: the user's agent runs in-process against the session server.

``options.agent`` and ``options.judger`` are import paths: ``agent(client, task)`` runs
with an OpenAI client bound to its own session, ``judger(task, output)`` scores it; each
session is exported with its reward. With ``options.mcp_servers`` the agent is called as
``agent(client, task, tools)``, ``tools`` the MCP servers' (``mcp_tools.McpTools``).
Design: docs/agent-loops.md#the-localhost-loop
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.mcp_options import mcp_metrics, mcp_options, mcp_problems
from rltool.agent_loops.mcp_tools import McpTools, open_tools
from rltool.agent_loops.session_loops import (
    MAX_TEXT_IN_EXTRA,
    LoopCounters,
    SessionJob,
    check_max_body_bytes,
    count_session,
    error_text,
    evaluate_sessions,
    regroup,
    reward_mapping,
    session_jobs,
    session_metrics,
    session_states,
    session_tokenizer,
)
from rltool.config.schema import SamplingConfig
from rltool.rollout.state import RolloutState
from rltool.sessions import SessionServer
from rltool.sessions.server import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

OPENAI_MISSING = "the localhost loop hands agents an openai.OpenAI client: pip install openai"


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


# --- the loop -----------------------------------------------------------------------------


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
        return evaluate_sessions(self, tasks, sampling)
