"""The sandbox loop: an agent command runs in a bubblewrap sandbox, a check command judges it.

Per sample: a recorded session, the agent sandbox over the task's files, then the check
sandbox over the same work dir; reward 1.0 when the check exits 0, else 0.0.
Design (task records, environment, failures): docs/agent-loops.md#the-sandbox-loop
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.mcp_bridge import MCP_SOCKET, McpBridge
from rltool.agent_loops.mcp_options import mcp_metrics, mcp_options, mcp_problems
from rltool.agent_loops.mcp_tools import open_tools
from rltool.agent_loops.sandbox_task import (
    CodingTask,
    agent_error,
    check_reward,
    is_argv,
    run_summary,
    temp_dir,
    write_check_dir,
)
from rltool.agent_loops.session_loops import (
    LoopCounters,
    check_max_body_bytes,
    count_session,
    evaluate_sessions,
    regroup,
    session_ids,
    session_metrics,
    session_states,
    session_tokenizer,
)
from rltool.config.schema import SamplingConfig
from rltool.rollout.state import RolloutState
from rltool.sandbox import SandboxError, SandboxLimits, SandboxPool, SandboxSpec, default_env
from rltool.sandbox.bwrap import grant_socket_access
from rltool.sandbox.probe import sandbox_problems
from rltool.sessions import SessionServer
from rltool.sessions.server import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)

AGENT_DIR = "/agent"  # where the agent script is bound read-only
CHECK_DIR = "/check"  # where a task's check_files are bound read-only
TASK_FILE = ".rltool/task.json"  # relative to /work
SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_AGENT_SCRIPT = "rltool.agents.sandbox_coder"
DEFAULT_AGENT_LIMITS = {"wall_clock_s": 300.0, "cpu_seconds": 120}
DEFAULT_CHECK_LIMITS = {"wall_clock_s": 30.0, "cpu_seconds": 10}


def resolve_script(script: str) -> Path:
    """A host file path, or a module import path resolved to its file (not imported)."""
    path = Path(script).expanduser()
    if path.is_file():
        return path.resolve()
    try:
        spec = importlib.util.find_spec(script)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise ValueError(
            f"agent_loop.options.agent_script: {script!r} is neither a file nor a module"
        )
    return Path(spec.origin)


def sandbox_python(choice: str) -> tuple[str, list[tuple[Path, str]]]:
    """(interpreter path inside, read-only binds it needs) for ``options.python``."""
    if choice == "auto":
        choice = "system" if Path(SYSTEM_PYTHON).exists() else "host"
    if choice == "system":
        if not Path(SYSTEM_PYTHON).exists():
            raise ValueError(f"agent_loop.options.python: {SYSTEM_PYTHON} does not exist; use host")
        return SYSTEM_PYTHON, []
    if choice == "host":
        prefix = Path(sys.base_prefix)
        exe = str(prefix / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
        binds = [] if prefix.is_relative_to("/usr") else [(prefix, str(prefix))]
        return exe, binds
    raise ValueError(f"agent_loop.options.python must be auto, system or host, got {choice!r}")


def _limits(values: Mapping[str, Any], option: str) -> SandboxLimits:
    try:
        return SandboxLimits(**values)
    except TypeError as exc:
        raise ValueError(f"agent_loop.options.{option}: {exc}") from exc


def memory_bound_line(limits: SandboxLimits, max_concurrent: int) -> str:
    """The memory the agent sandboxes can hold, as computed (rlimits bound each process, not
    the sandbox: docs/sandbox.md#resource-limits)."""
    gib = 2**30
    one = limits.memory_bound_bytes
    return (
        f"sandbox loop: each agent sandbox can hold at most {one / gib:.1f} GiB "
        f"(max_processes {limits.max_processes} x memory_bytes {limits.memory_bytes / gib:.2f}"
        f" GiB + /tmp and /dev/shm {2 * limits.tmp_bytes / gib:.2f} GiB; as root add its work "
        f"dir tmpfs, disk_bytes {limits.disk_bytes / gib:.2f} GiB); {max_concurrent} at once: "
        f"{max_concurrent * one / gib:.1f} GiB. Lower limits.memory_bytes or "
        "limits.max_processes to tighten it"
    )


@dataclass(frozen=True, slots=True)
class _Job:
    task: CodingTask
    group_id: str
    session_id: str
    check_dir: Path


@register("sandbox")
class SandboxLoop(AgentLoop):
    """Agent command then check command, each sample in its own sandbox and session."""

    def __init__(
        self,
        ctx: LoopContext,
        *,
        max_concurrent: int = 4,
        agent_script: str = DEFAULT_AGENT_SCRIPT,
        agent_command: Sequence[str] | None = None,
        python: str = "auto",
        max_turns: int = 2,
        limits: Mapping[str, Any] | None = None,
        check_limits: Mapping[str, Any] | None = None,
        work_parent: str | None = None,
        honor_sampling: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        mcp_servers: Sequence[Any] | None = None,
        mcp_tool_timeout_s: float = 30.0,
        mcp_start_timeout_s: float = 60.0,
    ):
        if max_concurrent < 1:
            raise ValueError(
                f"agent_loop.options.max_concurrent must be >= 1, got {max_concurrent}"
            )
        if max_turns < 1:
            raise ValueError(f"agent_loop.options.max_turns must be >= 1, got {max_turns}")
        check_max_body_bytes(max_body_bytes)
        super().__init__(ctx)
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.python, python_binds = sandbox_python(python)
        script = resolve_script(agent_script)
        self.agent_binds = [(script, f"{AGENT_DIR}/{script.name}"), *python_binds]
        command = agent_command or ["{python}", f"{AGENT_DIR}/{script.name}"]
        if not is_argv(list(command)):
            raise ValueError(f"agent_loop.options.agent_command must be argv, got {command!r}")
        self.agent_command = self._argv(command)
        self.max_turns = max_turns
        self.limits = _limits({**DEFAULT_AGENT_LIMITS, **(limits or {})}, "limits")
        self.check_limits = _limits(
            {**DEFAULT_CHECK_LIMITS, **(check_limits or {})}, "check_limits"
        )
        self.work_parent = None if work_parent is None else Path(work_parent)
        self.honor_sampling = honor_sampling
        self.mcp = mcp_options(mcp_servers, mcp_tool_timeout_s, mcp_start_timeout_s)
        self.server_tokenizer = session_tokenizer(ctx.tokenizer)
        self.counters = LoopCounters()
        # shown (a warning) when the agent sandboxes together could exhaust this machine
        bound = max_concurrent * self.limits.memory_bound_bytes
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        log.log(
            logging.WARNING if bound > host else logging.INFO,
            "%s (this machine: %.1f GiB)",
            memory_bound_line(self.limits, max_concurrent),
            host / 2**30,
        )

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """bubblewrap and util-linux, a sandbox that starts, the interpreter, the agent
        script and the work dirs' parent the options name."""
        problems = sandbox_problems()
        if options.get("mcp_servers") is not None:
            problems += mcp_problems(options["mcp_servers"])
        for check, option, default in (
            (sandbox_python, "python", "auto"),
            (resolve_script, "agent_script", DEFAULT_AGENT_SCRIPT),
        ):
            try:
                check(options.get(option, default))
            except ValueError as exc:
                problems.append(str(exc))
        work_parent = options.get("work_parent")
        if work_parent is not None and not Path(work_parent).is_dir():
            problems.append(
                f"agent_loop.options.work_parent: {work_parent} is not a directory; create it "
                "or drop the option (work dirs then go to the system's temp dir)"
            )
        return problems

    @classmethod
    def record_problem(cls, record: Mapping[str, Any], where: str) -> str | None:
        """The sandbox fields of a task record (``CodingTask``)."""
        try:
            CodingTask.from_record(record, where)
        except ValueError as exc:
            return str(exc)
        return None

    def _argv(self, command: Sequence[str]) -> list[str]:
        return [a.replace("{python}", self.python) for a in command]

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` sandboxed sessions per task, at most ``max_concurrent`` at once."""
        self.check_group_args(tasks, n, group_ids)
        coding = [
            CodingTask.from_record(t, f"task {gid!r}")
            for t, gid in zip(tasks, group_ids, strict=True)
        ]
        sids = session_ids(group_ids, n)
        with ExitStack() as stack:
            sock_dir = stack.enter_context(temp_dir("rltool-sock-", for_socket=True))
            check_dirs = [
                write_check_dir(stack.enter_context(temp_dir("rltool-check-")), t.check_files)
                for t in coding
            ]
            jobs = [
                _Job(coding[g], gid, sids[g * n + i], check_dirs[g])
                for g, gid in enumerate(group_ids)
                for i in range(n)
            ]
            server = stack.enter_context(
                SessionServer(
                    self.engine,
                    self.server_tokenizer,
                    sampling or self.sampling,
                    unix_socket=sock_dir / "session.sock",
                    honor_sampling=self.honor_sampling,
                    max_body_bytes=self.max_body_bytes,
                )
            )
            bridge = None
            if self.mcp is not None:  # the call's MCP servers, on a socket of their own
                tools = stack.enter_context(open_tools(self.mcp))
                bridge = stack.enter_context(McpBridge(tools, self.counters, sock_dir / "mcp.sock"))
                grant_socket_access(bridge.socket_path)
            pool = stack.enter_context(SandboxPool(self.max_concurrent))
            workers = min(self.max_concurrent, len(jobs))
            with ThreadPoolExecutor(workers, thread_name_prefix="rltool-sandbox") as threads:
                flat = list(
                    threads.map(lambda job: self._run_session(server, pool, job, bridge), jobs)
                )
            self.counters.add(generate_calls=server.batcher.calls)
        return regroup(flat, n)

    def _spec(self, server: SessionServer, job: _Job, mcp_url: str | None) -> SandboxSpec:
        info = {
            "prompt": job.task.prompt,
            "solution_file": job.task.solution_file,
            "max_turns": self.max_turns,
        }
        env = {
            **default_env(),
            # its own session's path and token: the socket is shared by the call's sandboxes
            "RLTOOL_BASE_URL": f"http://localhost{server.session_path(job.session_id)}",
            "RLTOOL_TASK_FILE": f"/work/{TASK_FILE}",
        }
        binds = list(self.agent_binds)
        if mcp_url is not None:  # the session's MCP tools: docs/agent-loops.md#mcp-tools
            env |= {"RLTOOL_MCP_SOCKET": MCP_SOCKET, "RLTOOL_MCP_URL": mcp_url}
            binds.append((server.unix_socket.parent / "mcp.sock", MCP_SOCKET))
        return SandboxSpec(
            command=self.agent_command,
            files={**job.task.files, TASK_FILE: json.dumps(info)},
            env=env,
            limits=self.limits,
            ro_binds=binds,
            socket_path=server.unix_socket,
            work_parent=self.work_parent,
        )

    def _run_session(
        self, server: SessionServer, pool: SandboxPool, job: _Job, bridge: McpBridge | None
    ) -> list[RolloutState]:
        server.open_session(job.session_id)
        tools, mcp_url = bridge.open(job.session_id) if bridge else (None, None)
        run, error = None, None
        try:
            if tools is None or tools.failure is None:  # else the MCP servers did not start
                run = pool.run_check(
                    self._spec(server, job, mcp_url),
                    self._argv(job.task.check),
                    limits=self.check_limits,
                    ro_binds=[(job.check_dir, CHECK_DIR)],
                )
        except (SandboxError, ValueError) as exc:  # setup failure: this sample only, counted
            error = f"sandbox: {exc}"
            self.counters.add(sandbox_errors=1)
        if bridge is not None:
            bridge.close(job.session_id)
        session = server.close_session(job.session_id)
        count_session(self.counters, session)
        reward, extra = None, {}
        if run is not None:
            extra = {"agent": run_summary(run.agent), "check": run_summary(run.check)}
            error = agent_error(run.agent)
            self.counters.add(
                agent_failed=error is not None,
                agent_wall_s=run.agent.wall_s,
                check_wall_s=run.check.wall_s,
            )
            if error is None:
                reward, error = check_reward(run)
                self.counters.add(checks=1, checks_passed=run.passed)
        if tools is not None and tools.failure is not None:  # a server died: no reward
            reward, error = None, tools.failure
        return session_states(self, session, job.group_id, self.task_name, reward, error, extra)

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: session figures plus sandbox failures, pass rate and times."""
        counts = self.counters.pop()
        runs = max(counts.get("sessions", 0.0) - counts.get("sandbox_errors", 0.0), 1.0)
        return {
            **session_metrics(counts),
            "sandbox/errors": counts.get("sandbox_errors", 0.0),
            "sandbox/agent_failed": counts.get("agent_failed", 0.0),
            "sandbox/check_pass_rate": counts.get("checks_passed", 0.0)
            / max(counts.get("checks", 0.0), 1.0),
            "sandbox/agent_wall_s_mean": counts.get("agent_wall_s", 0.0) / runs,
            "sandbox/check_wall_s_mean": counts.get("check_wall_s", 0.0) / runs,
            **(mcp_metrics(counts) if self.mcp else {}),
        }

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """One sandboxed session per task: eval/accuracy is the fraction of checks passed,
        a failed session counting 0 and counted by reason; when all fail, EvaluationFailed."""
        return evaluate_sessions(self, tasks, sampling)
