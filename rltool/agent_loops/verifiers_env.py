"""The verifiers loop: an installed verifiers 0.4 environment, its harness run as a local
subprocess against rltool's session server, which records the exact tokens.

``options.environment`` names the environment (an importable package whose ``__all__``
exports a ``Taskset``); each task record carries the task's wire data (``vf_task``,
written by ``task_records``). Each rollout is one verifiers episode whose client is bound
to its own session; the trace's reward components become the sample's
``reward["components"]``. Nothing is uploaded and no hosted sandbox is used: the runtime is
verifiers' ``subprocess``. Design: docs/agent-loops.md#the-verifiers-loop
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.session_loops import (
    LoopCounters,
    SessionJob,
    check_max_body_bytes,
    count_session,
    evaluate_sessions,
    regroup,
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

VERIFIERS_MISSING = (
    "agent loop 'verifiers' needs the verifiers package (0.4): pip install "
    "'rltool[verifiers]' (or build .venv-envs: bash scripts/envs_env.sh)"
)
UV_MISSING = (
    "agent loop 'verifiers' runs each rollout's chat program through uv, which is not on "
    "PATH: pip install uv (it comes with 'rltool[verifiers]')"
)
TASK_FIELD = "vf_task"  # a record's task wire data (``TaskData.model_dump``)
MODEL_NAME = "rltool-policy"
_KEY_VAR = "RLTOOL_VERIFIERS_UNUSED_KEY"  # loopback: the session server asks no key


def add_env_dir(env_dir: str) -> None:
    """Make an environment importable from ``env_dir`` here and in the subprocesses
    verifiers starts (its tool servers run ``python -m <module>``)."""
    if not env_dir:
        return
    path = str(Path(env_dir).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    parts = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *[p for p in parts if p]])


def environment_problem(environment: Any, env_dir: str) -> str | None:
    """Why ``options.environment`` cannot be imported, or None."""
    if not isinstance(environment, str) or not environment:
        return "agent_loop.options.environment must name an installed verifiers environment"
    module = environment.replace("-", "_").lower()
    add_env_dir(env_dir)
    if importlib.util.find_spec(module) is None:
        where = f" (looked in agent_loop.options.env_dir {env_dir!r} too)" if env_dir else ""
        return (
            f"agent_loop.options.environment: verifiers environment {environment!r} is not "
            f"installed: no module {module!r}{where}; install it (pip install -e "
            "<its directory>) or set agent_loop.options.env_dir to the directory holding it"
        )
    return None


def find_uv() -> str | None:
    """uv on PATH, or else the one pip installed beside this interpreter (the ``uv``
    package, which 'rltool[verifiers]' brings), then put on PATH for verifiers' own calls:
    a venv's python run without activating the venv has its ``bin`` off PATH."""
    found = shutil.which("uv")
    if found is not None:
        return found
    try:
        from uv import find_uv_bin

        found = find_uv_bin()
    except (ImportError, FileNotFoundError):
        return None
    os.environ["PATH"] = os.pathsep.join([str(Path(found).parent), os.environ.get("PATH", "")])
    return found


def lock_chat_program(timeout_s: float = 600.0) -> Path:
    """Lock and install the chat program of the null and bash harnesses where verifiers' subprocess
    runtime keeps it (``<scripts_dir>/<sha256>.py``), so a run needs no network.

    verifiers runs ``uv sync --script`` before each run's first rollout; without a
    lockfile that resolves against the package index every time. With ``<script>.lock``
    beside it (``uv lock --script``) and the wheels in uv's cache, it installs offline.
    Run at install time (scripts/envs_env.sh) and by the loop when the lock is missing.
    """
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if path.with_name(path.name + ".lock").is_file() and path.is_file():
        return path
    uv = find_uv()
    if uv is None:
        raise ValueError(UV_MISSING)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    for verb in ("lock", "sync"):
        done = subprocess.run(
            [uv, verb, "--script", str(path), "-q", "--no-config"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise ValueError(
                f"uv {verb} --script {path} failed (it fetches the chat program's packages "
                f"from the package index once): {done.stderr.strip()[-1000:]}"
            )
    return path


def load_taskset(environment: str, taskset: Mapping[str, Any]) -> Any:
    """The environment's Taskset under ``taskset`` (its config fields, ``split`` ...)."""
    from verifiers.v1.utils.loaders import load_taskset as vf_load_taskset
    from verifiers.v1.utils.loaders import taskset_config_type

    config = taskset_config_type(environment).model_validate({**taskset, "id": environment})
    return vf_load_taskset(config)


def task_records(environment: str, taskset: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One data record per task of the environment's taskset: ``question`` (the prompt
    text, shown by rltool's tools), ``answer`` (the task's, else ""), ``vf_task``."""
    out = []
    for task in load_taskset(environment, taskset):
        data = task.data.model_dump(mode="json", exclude_none=True)
        answer = data.get("answer", "")
        out.append(
            {
                "question": task.data.prompt_text,
                "answer": answer if isinstance(answer, str | int | float) else str(answer),
                TASK_FIELD: data,
            }
        )
    return out


def trace_reward(trace: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(reward, None), or (None, why) when the trace has no reward. The reward's
    ``score`` is verifiers' weighted sum; ``components`` holds each component's raw score
    (logged as ``rollout/reward_components/<name>``, read by the reward_component alarm)."""
    if not trace.ok or any(r is None for r in trace.rewards.values()):
        err = trace.errors[-1] if trace.errors else None
        if err is None:
            return None, f"verifiers: trace not ok ({trace.stop_condition or 'no reason'})"
        first = (err.message or "").strip().splitlines()
        kind = "reward" if err.type == "TaskError" else "verifiers"
        return None, f"{kind}: {err.type}: {first[0] if first else ''}"[:2000]
    if not trace.rewards:
        return None, "reward: the environment's task has no @vf.reward"
    score = float(trace.reward)
    if not math.isfinite(score):
        return None, f"reward: not finite ({score})"
    components = {name: float(r.score) for name, r in trace.rewards.items()}
    weights = {name: float(r.weight) for name, r in trace.rewards.items()}
    return {"score": score, "components": components, "weights": weights}, None


@register("verifiers")
class VerifiersLoop(AgentLoop):
    """One verifiers episode per sample, all of a call at once on one event loop."""

    def __init__(
        self,
        ctx: LoopContext,
        *,
        environment: str,
        env_dir: str = "",
        taskset: Mapping[str, Any] | None = None,
        harness: str = "null",
        max_turns: int = 4,
        max_concurrent: int = 32,
        rollout_timeout_s: float = 600.0,
        honor_sampling: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        problems = self.preflight({"environment": environment, "env_dir": env_dir})
        if problems:
            raise ValueError("; ".join(problems))
        for key, value in (("max_turns", max_turns), ("max_concurrent", max_concurrent)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"agent_loop.options.{key} must be an integer >= 1, got {value!r}")
        if not rollout_timeout_s > 0:
            raise ValueError(
                f"agent_loop.options.rollout_timeout_s must be > 0, got {rollout_timeout_s!r}"
            )
        if harness not in ("null", "bash"):
            raise ValueError(
                f"agent_loop.options.harness {harness!r}: use null (chat with the task's tools) "
                "or bash (the model gets a shell on this machine)"
            )
        check_max_body_bytes(max_body_bytes)
        super().__init__(ctx)
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import load_environment

        self._vf = vf
        self.environment = environment
        config = vf.SingleAgentEnvConfig(
            taskset={**(taskset or {}), "id": environment},
            # subprocess: never a hosted sandbox; nothing is uploaded (no vf-eval here)
            agent=vf.AgentConfig(
                harness={"id": harness}, runtime=vf.SubprocessConfig(), max_turns=max_turns
            ),
        )
        self.env = load_environment(config)
        lock_chat_program()  # null and bash share it; once per machine, then runs are offline
        self.task_cls = type(self.env.taskset).task_type()
        self.max_concurrent = max_concurrent
        self.rollout_timeout_s = float(rollout_timeout_s)
        self.honor_sampling = honor_sampling
        self.max_body_bytes = max_body_bytes
        self.server_tokenizer = session_tokenizer(ctx.tokenizer)
        self.counters = LoopCounters()

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """verifiers and uv installed; the environment importable."""
        if importlib.util.find_spec("verifiers") is None:
            return [VERIFIERS_MISSING]
        problems = [] if find_uv() else [UV_MISSING]
        problem = environment_problem(options.get("environment"), options.get("env_dir", ""))
        return problems + ([problem] if problem else [])

    @classmethod
    def record_problem(cls, record: Mapping[str, Any], where: str) -> str | None:
        if not isinstance(record.get(TASK_FIELD), dict):
            return (
                f"{where}: field {TASK_FIELD!r} (the verifiers task's data) must be an "
                "object; write the records with rltool.agent_loops.verifiers_env.task_records"
            )
        return None

    def _task(self, record: Mapping[str, Any]) -> Any:
        data = self.task_cls.data_type().model_validate(record[TASK_FIELD])
        return self.task_cls(data, self.env.taskset.config.task)

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` episodes per task, run concurrently; their segments grouped per task."""
        self.check_group_args(tasks, n, group_ids)
        jobs = session_jobs(tasks, group_ids, n)
        with self._server(sampling or self.sampling) as server:
            flat = asyncio.run(self._run_all(server, jobs))
            self.counters.add(generate_calls=server.batcher.calls)
        return regroup(flat, n)

    @contextmanager
    def _server(self, sampling: SamplingConfig) -> Iterator[SessionServer]:
        server = SessionServer(
            self.engine,
            self.server_tokenizer,
            sampling,
            model_name=MODEL_NAME,
            honor_sampling=self.honor_sampling,
            max_body_bytes=self.max_body_bytes,
        )
        with server:
            yield server

    async def _run_all(
        self, server: SessionServer, jobs: list[SessionJob]
    ) -> list[list[RolloutState]]:
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(job: SessionJob) -> list[RolloutState]:
            async with gate:
                return await self._run_episode(server, job)

        async with self.env.serving():
            return list(await asyncio.gather(*(one(job) for job in jobs)))

    async def _run_episode(self, server: SessionServer, job: SessionJob) -> list[RolloutState]:
        vf = self._vf
        server.open_session(job.session_id)
        ctx = vf.ModelContext(
            model=MODEL_NAME,
            client=vf.EvalClientConfig(
                base_url=server.base_url(job.session_id), api_key_var=_KEY_VAR
            ),
        )
        reward, error, extra = None, None, {}
        try:
            task = self._task(job.task)
            episode = await asyncio.wait_for(
                self.env.run_episode(task, ctx), self.rollout_timeout_s
            )
        except TimeoutError:
            error = f"verifiers: episode timed out after {self.rollout_timeout_s:g}s"
            self.counters.add(agent_errors=1)
        except Exception as exc:  # a failure outside verifiers' own boundaries: counted
            error = f"verifiers: {type(exc).__name__}: {exc}"
            self.counters.add(agent_errors=1)
        else:
            if episode.errors or not episode.traces:
                err = episode.errors[-1] if episode.errors else None
                error = f"verifiers: {err.type}: {err.message}" if err else "verifiers: no trace"
            else:
                trace = episode.traces[-1]
                reward, error = trace_reward(trace)
                extra = {"vf_stop": trace.stop_condition, "agent_output": trace.last_reply[:2000]}
            if error is not None:
                kind = "reward_errors" if error.startswith("reward:") else "agent_errors"
                self.counters.add(**{kind: 1})
        if error is not None:
            log.warning("session %s: %s", job.session_id, error.splitlines()[0])
        session = server.close_session(job.session_id)
        count_session(self.counters, session)
        return session_states(self, session, job.group_id, self.task_name, reward, error, extra)

    def pop_metrics(self) -> dict[str, float]:
        """Session figures as the localhost loop's (reward components are the producer's
        ``rollout/reward_components/<name>``, from each sample's reward)."""
        return session_metrics(self.counters.pop())

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """One episode per task under ``sampling``: eval/accuracy is the mean reward score,
        a failed episode counting 0 and counted by reason."""
        return evaluate_sessions(self, tasks, sampling)


if __name__ == "__main__":  # python -m rltool.agent_loops.verifiers_env: install-time prefetch
    print(f"verifiers chat program locked and installed: {lock_chat_program()}")
