"""The OpenEnv side of the ``openenv`` loop: a local environment server it starts itself, and
one episode's websocket session (connect with retries, reset, step, close, each timed out).

OpenEnv's plain HTTP ``/reset`` and ``/step`` build a fresh environment per request, so an
episode of several steps runs over the ``/ws`` session of ``openenv.core.GenericEnvClient``
(imported lazily: openenv-core is the optional extra ``rltool[openenv]``).
Design: docs/agent-loops.md#the-openenv-loop
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OPENENV_MISSING = (
    "the openenv loop needs openenv-core (the `openenv` module) and websockets: "
    "pip install 'rltool[openenv]' (or bash scripts/envs_env.sh)"
)
UVICORN_MISSING = "agent_loop.options.app: serving it needs uvicorn: pip install 'rltool[openenv]'"
CLOSE_TIMEOUT_S = 2.0  # a session's close never holds up the step longer than this
STDERR_TAIL_CHARS = 2000


def openenv_missing() -> str | None:
    """Why the loop cannot talk to an OpenEnv server here, or None."""
    if any(importlib.util.find_spec(m) is None for m in ("openenv", "websockets")):
        return OPENENV_MISSING
    return None


class EpisodeError(Exception):
    """One episode cannot go on; ``str`` is the sample's error (``openenv: <kind> (...)``)."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float  # opening the websocket (each try)
    step_s: float  # an answer to reset or step
    retries: int  # further connect tries after a failed one (backoff 0.5 s, doubling)


@dataclass(slots=True)
class StepOut:
    """An observation of reset or step: its fields, the step's reward and whether it ended."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class EnvSession:
    """One episode's websocket session with the environment server at ``url``."""

    def __init__(self, url: str, timeouts: Timeouts):
        from openenv.core import GenericEnvClient  # lazy: the optional extra

        self.url = url
        self.timeouts = timeouts
        self.client = GenericEnvClient(
            base_url=url,
            connect_timeout_s=timeouts.connect_s,
            message_timeout_s=timeouts.step_s,
        )

    async def connect(self) -> None:
        """Open the session, retrying ``timeouts.retries`` times; EpisodeError when the
        server stays down (refused, unreachable, or no handshake in time)."""
        delay, last = 0.5, ""
        for attempt in range(self.timeouts.retries + 1):
            try:
                await self.client.connect()
                return
            except ConnectionError as exc:  # openenv wraps every connect failure in one
                last = str(exc.__cause__ or exc)
                log.info("openenv: connect %s try %d failed: %s", self.url, attempt + 1, last)
            if attempt < self.timeouts.retries:
                await asyncio.sleep(delay)
                delay *= 2
        raise EpisodeError(
            f"openenv: server down ({self.url} after {self.timeouts.retries + 1} tries: {last}; "
            "start the server or fix agent_loop.options.url)"
        )

    async def call(self, what: str, coro: Any) -> StepOut:
        """Await a reset or step; a timeout, a server error or a dropped connection is an
        EpisodeError naming it."""
        from websockets.exceptions import WebSocketException  # lazy: the optional extra

        try:
            result = await coro
        except TimeoutError as exc:
            raise EpisodeError(
                f"openenv: {what} timed out (no answer in {self.timeouts.step_s:g} s: "
                "agent_loop.options.step_timeout_s)"
            ) from exc
        except RuntimeError as exc:  # the server answered with an error (its env raised)
            raise EpisodeError(f"openenv: {what} failed on the server ({exc})") from exc
        except (OSError, ValueError, WebSocketException) as exc:  # dropped, or a bad frame
            kind = type(exc).__name__
            raise EpisodeError(f"openenv: {what} connection lost ({kind}: {exc})") from exc
        return StepOut(dict(result.observation or {}), result.reward, bool(result.done))

    async def reset(self, kwargs: Mapping[str, Any]) -> StepOut:
        return await self.call("reset", self.client.reset(**dict(kwargs)))

    async def step(self, action: Mapping[str, Any]) -> StepOut:
        return await self.call("step", self.client.step(dict(action)))

    async def close(self) -> None:
        """Close the session; a close that fails or hangs is logged (the episode's data is
        already recorded), never awaited past CLOSE_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self.client.close(), CLOSE_TIMEOUT_S)
        except (TimeoutError, OSError, RuntimeError) as exc:
            log.warning("openenv: closing the session with %s: %r", self.url, exc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """``uvicorn <app>`` in a subprocess bound to 127.0.0.1 on a free port, stopped with
    ``stop`` (or when the loop is collected); dies with this process (PDEATHSIG)."""

    def __init__(
        self,
        app: str,
        app_dir: str | None,
        env: Mapping[str, str],
        startup_timeout_s: float,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # stderr to a file: a pipe nobody reads could fill up; closed by stop()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        argv = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--log-level", "warning"]
        if app_dir is not None:
            argv += ["--app-dir", str(Path(app_dir).resolve())]
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **{k: str(v) for k, v in env.items()}},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        try:
            self._wait_ready(app, startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, app: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"agent_loop.options.app: the server of {app!r} exited with "
                    f"{self.proc.returncode} before it answered:\n{self.output()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet: polled again until the deadline
            time.sleep(0.1)
        raise ValueError(
            f"agent_loop.options.app: the server of {app!r} did not answer {self.url}/health "
            f"within {timeout_s:g} s (agent_loop.options.startup_timeout_s):\n{self.output()}"
        )

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-STDERR_TAIL_CHARS:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux), so a killed run
    leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux/glibc: stop() and the loop's finalizer still end the server
