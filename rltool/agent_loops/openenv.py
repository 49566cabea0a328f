"""The OpenEnv loop: an OpenEnv environment server played as multi-turn episodes.

Per sample: a websocket session with the server, ``reset`` (the task record's ``reset``
object as its arguments) gives the first observation, rendered as the user turn; each model
turn is an action (``{action_field: reply text}``); ``step`` answers with an observation (the
next user turn), a reward and ``done``. The turns are recorded token-exactly as the session
server records them (environment tokens labelled -100); the sample's score is the sum of the
step rewards, or the last one (``reward_mode``). The episodes of a call run in lockstep: one
engine call per turn for all of them, their steps concurrent.
Design: docs/agent-loops.md#the-openenv-loop
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rltool.agent_loops.base import AgentLoop, LoopContext, register
from rltool.agent_loops.openenv_server import (
    UVICORN_MISSING,
    EnvSession,
    EpisodeError,
    LocalServer,
    StepOut,
    Timeouts,
    openenv_missing,
)
from rltool.agent_loops.session_loops import (
    LoopCounters,
    SessionJob,
    count_session,
    evaluate_sessions,
    regroup,
    session_jobs,
    session_metrics,
    session_states,
)
from rltool.config.schema import SamplingConfig
from rltool.rollout.state import RolloutState
from rltool.sessions import Session

log = logging.getLogger(__name__)

REWARD_MODES = ("sum", "last")


@dataclass(slots=True)
class _Episode:
    job: SessionJob
    session: Session
    env: EnvSession
    messages: list[dict[str, str]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)  # one per step
    done: bool = False
    error: str | None = None


def episode_reward(rewards: Sequence[float | None], mode: str) -> tuple[float | None, str | None]:
    """(score, error) of an episode's step rewards: ``sum`` of the numbers (a step without
    a reward adds nothing) or the ``last`` number; no number at all, or one that is not
    finite, is an error: the sample must not be scored 0.0 in silence."""
    numbers = [r for r in rewards if r is not None]
    if not numbers:
        return None, "openenv: no reward (no step of the episode returned one)"
    bad = [r for r in numbers if isinstance(r, bool) or not math.isfinite(float(r))]
    if bad:
        return None, f"openenv: reward not a finite number ({bad[0]!r})"
    return (float(sum(numbers)) if mode == "sum" else float(numbers[-1])), None


@register("openenv")
class OpenEnvLoop(AgentLoop):
    """Episodes against an OpenEnv server named by ``url`` or started from ``app``."""

    def __init__(
        self,
        ctx: LoopContext,
        *,
        url: str | None = None,
        app: str | None = None,
        app_dir: str | None = None,
        server_env: Mapping[str, Any] | None = None,
        action_field: str = "message",
        observation_field: str = "message",
        system_prompt: str | None = None,
        max_turns: int = 4,
        reward_mode: str = "sum",
        max_concurrent: int = 64,
        connect_timeout_s: float = 10.0,
        step_timeout_s: float = 60.0,
        retries: int = 2,
        startup_timeout_s: float = 60.0,
    ):
        problems = self.option_problems(
            {"url": url, "app": app, "app_dir": app_dir, "reward_mode": reward_mode}
        )
        if problems:
            raise ValueError(problems[0])
        for name, value in (("max_turns", max_turns), ("max_concurrent", max_concurrent)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"agent_loop.options.{name} must be >= 1, got {value!r}")
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("step_timeout_s", step_timeout_s),
            ("startup_timeout_s", startup_timeout_s),
        ):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"agent_loop.options.{name} must be > 0, got {value!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"agent_loop.options.retries must be >= 0, got {retries!r}")
        super().__init__(ctx)
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.reward_mode = reward_mode
        self.max_concurrent = max_concurrent
        self.timeouts = Timeouts(float(connect_timeout_s), float(step_timeout_s), retries)
        self.counters = LoopCounters()
        self.server = None
        if app is not None:
            self.server = LocalServer(app, app_dir, server_env or {}, startup_timeout_s)
            weakref.finalize(self, self.server.stop)
            log.info("openenv loop: serving %s at %s", app, self.server.url)
        self.url = url if url is not None else self.server.url

    @staticmethod
    def option_problems(options: Mapping[str, Any]) -> list[str]:
        """The package, one of ``url``/``app``, ``app_dir`` and ``reward_mode``, as fix-it
        sentences."""
        missing = openenv_missing()
        if missing:
            return [missing]
        problems = []
        url, app = options.get("url"), options.get("app")
        if (url is None) == (app is None):
            problems.append(
                "agent_loop.options: give exactly one of url (a running OpenEnv server, "
                "http://host:port) and app (module:app, served by the loop on 127.0.0.1)"
            )
        if app is not None and (not isinstance(app, str) or ":" not in app):
            problems.append(f"agent_loop.options.app must be 'module:app', got {app!r}")
        if url is not None and not str(url).startswith(("http://", "https://", "ws://", "wss://")):
            problems.append(
                f"agent_loop.options.url must be an http(s):// or ws(s):// URL, got {url!r}"
            )
        app_dir = options.get("app_dir")
        if app_dir is not None:
            from pathlib import Path

            if not Path(app_dir).is_dir():
                problems.append(
                    f"agent_loop.options.app_dir: {app_dir} is not a directory (a relative path "
                    "is read from the directory the run starts in)"
                )
        mode = options.get("reward_mode", "sum")
        if mode not in REWARD_MODES:
            problems.append(f"agent_loop.options.reward_mode must be sum or last, got {mode!r}")
        return problems

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """openenv-core and websockets installed (and uvicorn for ``app``); the options'
        shape. The server itself is reached only when the loop runs."""
        problems = cls.option_problems(options)
        if not problems and options.get("app") is not None:
            import importlib.util

            if importlib.util.find_spec("uvicorn") is None:
                problems.append(UVICORN_MISSING)
        return problems

    @classmethod
    def record_problem(cls, record: Mapping[str, Any], where: str) -> str | None:
        reset = record.get("reset", {})
        if not isinstance(reset, dict):
            return f"{where}: field 'reset' must be an object of reset arguments, got {reset!r}"
        return None

    def stop(self) -> None:
        """Stop the server the loop started (a no-op for a ``url``)."""
        if self.server is not None:
            self.server.stop()

    # --- episodes -----------------------------------------------------------------------

    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` episodes per task, ``max_concurrent`` at a time in lockstep."""
        self.check_group_args(tasks, n, group_ids)
        jobs = session_jobs(tasks, group_ids, n)
        flat: list[list[RolloutState]] = []
        for start in range(0, len(jobs), self.max_concurrent):
            chunk = jobs[start : start + self.max_concurrent]
            episodes = asyncio.run(self._play(chunk, sampling or self.sampling))
            flat += [self._states(e) for e in episodes]
        return regroup(flat, n)

    async def _play(self, jobs: Sequence[SessionJob], sampling: SamplingConfig) -> list[_Episode]:
        episodes = [
            _Episode(j, Session(j.session_id), EnvSession(self.url, self.timeouts)) for j in jobs
        ]
        try:
            await asyncio.gather(*(self._open(e) for e in episodes))
            for _ in range(self.max_turns):
                live = [e for e in episodes if e.error is None and not e.done]
                if not live:
                    break
                await self._turn(live, sampling)
        finally:
            await asyncio.gather(*(e.env.close() for e in episodes))
        return episodes

    async def _open(self, ep: _Episode) -> None:
        try:
            await ep.env.connect()
            first = await ep.env.reset(ep.job.task.get("reset", {}))
            if self.system_prompt:
                ep.messages.append({"role": "system", "content": self.system_prompt})
            ep.messages.append({"role": "user", "content": self._text(first)})
            ep.done = first.done
        except EpisodeError as exc:
            self._fail(ep, exc)

    async def _turn(self, live: list[_Episode], sampling: SamplingConfig) -> None:
        """One model turn of every live episode (one engine call), then their steps."""
        turns = [e.session.plan(self._render(e.messages), self._decode) for e in live]
        gens = await asyncio.to_thread(self.engine.generate, [t.context for t in turns], sampling)
        if len(gens) != len(live):
            raise ValueError(f"engine returned {len(gens)} generations for {len(live)} prompts")
        stepping = []
        for ep, turn, gen in zip(live, turns, gens, strict=True):
            if gen.error is not None:
                ep.error = gen.error
                continue
            ep.messages.append({"role": "assistant", "content": gen.text})
            ep.session.commit(turn, gen, list(ep.messages), tool_call=False)
            stepping.append(ep)
        await asyncio.gather(*(self._step(e) for e in stepping))

    async def _step(self, ep: _Episode) -> None:
        start = time.monotonic()
        try:
            out = await ep.env.step({self.action_field: ep.messages[-1]["content"]})
        except EpisodeError as exc:
            self._fail(ep, exc)
            return
        finally:
            self.counters.add(env_steps=1, env_step_s=time.monotonic() - start)
        ep.rewards.append(out.reward)
        ep.done = out.done
        try:
            text = self._text(out)
        except EpisodeError as exc:
            self._fail(ep, exc)
            return
        if not ep.done:
            ep.messages.append({"role": "user", "content": text})

    def _text(self, out: StepOut) -> str:
        if self.observation_field not in out.observation:
            fields = ", ".join(sorted(out.observation)) or "none"
            raise EpisodeError(
                f"openenv: observation has no field {self.observation_field!r} (its fields: "
                f"{fields}; set agent_loop.options.observation_field)"
            )
        return str(out.observation[self.observation_field])

    def _fail(self, ep: _Episode, exc: EpisodeError) -> None:
        ep.error = str(exc)
        kind = ep.error.removeprefix("openenv: ").split(" (")[0].replace(" ", "_")
        self.counters.add(env_errors=1, **{f"env_error/{kind}": 1})
        log.warning("episode %s: %s", ep.job.session_id, ep.error)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _states(self, ep: _Episode) -> list[RolloutState]:
        count_session(self.counters, ep.session)
        reward, error = None, ep.error
        if error is None:
            score, error = episode_reward(ep.rewards, self.reward_mode)
            if error is not None:
                self.counters.add(reward_errors=1)
            else:
                reward = {"score": score, "step_rewards": ep.rewards, "done": ep.done}
                self.counters.add(episodes_done=int(ep.done))
        extra = {"env_steps": len(ep.rewards), "done": ep.done}
        return session_states(
            self, ep.session, ep.job.group_id, self.task_name, reward, error, extra
        )

    def pop_metrics(self) -> dict[str, float]:
        """Since the last call: session figures, environment errors by kind, step time."""
        counts = self.counters.pop()
        sessions = max(counts.get("sessions", 0.0), 1.0)
        errors = {
            f"openenv/errors/{k.removeprefix('env_error/')}": v
            for k, v in counts.items()
            if k.startswith("env_error/")
        }
        return {
            **session_metrics(counts),
            "openenv/errors": counts.get("env_errors", 0.0),
            **errors,
            "openenv/done_frac": counts.get("episodes_done", 0.0) / sessions,
            "openenv/step_s_mean": counts.get("env_step_s", 0.0)
            / max(counts.get("env_steps", 0.0), 1.0),
        }

    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """One episode per task: eval/accuracy is the mean episode score, a failed episode
        counting 0 and counted by reason; when all fail, EvaluationFailed."""
        return evaluate_sessions(self, tasks, sampling)
