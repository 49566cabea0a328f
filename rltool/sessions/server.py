"""The session server: an OpenAI-compatible HTTP endpoint that records each session.

An ASGI app (asgi.py) served by uvicorn on its own thread and event loop, on loopback and
optionally on a Unix socket; each session has its own base URL, holding a secret token
that every request of the session must carry, so the official ``openai`` client works
unmodified. Design: docs/agent-loops.md#the-session-server
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

import uvicorn
from jinja2 import TemplateError

from rltool.config.schema import SamplingConfig
from rltool.engines.base import RolloutEngine
from rltool.engines.batcher import GenerationBatcher
from rltool.sessions.asgi import build_app
from rltool.sessions.guard import (
    MAX_SESSION_REQUESTS,
    READ_TIMEOUT_S,
    ConnectionGuard,
    SessionSlots,
    default_max_connections,
)
from rltool.sessions.protocol import ApiError, chat_response, parse_chat_request
from rltool.sessions.session import Session
from rltool.sessions.tool_calls import parse_reply

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a long agent history is well under this
BACKLOG = 2048  # connections the kernel queues before the server accepts them
SHUTDOWN_GRACE_S = 30.0  # stop() waits this long for turns in flight, then cancels them
START_TIMEOUT_S = 30.0
# an idle keep-alive connection is closed by the client first (httpx: after 5 s), never
# by the server just as the client sends its next turn on it
KEEP_ALIVE_S = 75.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling another thread when it listens."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class SessionServer:
    """Sessions, the chat turn, and the uvicorn server that serves them."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        sampling: SamplingConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_socket: str | os.PathLike | None = None,
        model_name: str = "rltool-policy",
        honor_sampling: bool = False,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_session_requests: int = MAX_SESSION_REQUESTS,
        max_connections: int | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
    ):
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"session server host {host!r} is not a loopback address: give it an api_key "
                "(every request must then send 'Authorization: Bearer <api_key>'), "
                "or bind 127.0.0.1"
            )
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes {max_body_bytes}: must be at least 1")
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        self.model_name = model_name
        self.honor_sampling = honor_sampling
        self.api_key = api_key or None  # on loopback without one, no key is asked
        self.max_body_bytes = max_body_bytes
        self.slots = SessionSlots(max_session_requests)
        self.guard = ConnectionGuard(max_connections or default_max_connections(), read_timeout_s)
        # a reply cut to its turn's budget is decoded as the engine decodes its replies
        self.batcher = GenerationBatcher(
            engine, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        )
        self._host, self._port = host, port
        self.unix_socket = None if unix_socket is None else Path(unix_socket)
        self.url: str | None = None  # http://host:port once started
        self._sessions: dict[str, Session] = {}
        self._tokens: dict[str, str] = {}  # session id -> the secret its requests carry
        self._turn_locks: dict[str, asyncio.Lock] = {}  # one turn at a time per session
        self._lock = threading.Lock()  # guards _sessions, _tokens and _turn_locks
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._sockets: list[socket.socket] = []
        self._failure: BaseException | None = None  # of the server thread

    # lifecycle

    def _listen(self) -> list[socket.socket]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM)
        socks = [tcp]
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((self._host, self._port))
            tcp.listen(BACKLOG)
            if self.unix_socket is not None:
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                socks.append(unix)
                unix.bind(str(self.unix_socket))
                unix.listen(BACKLOG)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        return socks

    def start(self) -> SessionServer:
        """Listen, start the engine caller and uvicorn; returns once uvicorn serves."""
        if self._thread is not None:
            raise ValueError("the session server is already started")
        if self.unix_socket is not None and self.unix_socket.exists():
            raise ValueError(f"unix socket path {self.unix_socket} already exists; remove it")
        self._sockets = self._listen()
        port = self._sockets[0].getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(
            build_app(self, self.max_body_bytes, self.api_key, self.slots),
            http=self.guard.protocol(),  # h11, with the connection cap and read deadline
            ws="none",
            lifespan="off",
            log_config=None,  # the host program's logging stays as it is
            # not "warning": uvicorn warns once per malformed request, which sandbox code
            # could send by the thousand (our own guards log once and count)
            log_level="error",
            access_log=False,
            backlog=BACKLOG,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            timeout_keep_alive=KEEP_ALIVE_S,
            server_header=False,
        )
        self._server = _Uvicorn(config)
        self._failure = None
        self.batcher.start()
        self._thread = threading.Thread(target=self._serve, name="rltool-sessions", daemon=True)
        self._thread.start()
        if not self._server.ready.wait(START_TIMEOUT_S) or self._failure is not None:
            failure = self._failure
            self.stop()
            raise RuntimeError(f"the session server did not start: {failure!r}") from failure
        return self

    def _serve(self) -> None:
        assert self._server is not None
        try:
            asyncio.run(self._server.serve(sockets=self._sockets))
        except BaseException as exc:  # handed to start(), which raises it
            self._failure = exc
            log.exception("session server: uvicorn failed")
        finally:
            self._server.ready.set()

    def stop(self) -> None:
        """Stop serving (turns in flight finish first), then the engine caller."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        for sock in self._sockets:
            sock.close()
        self.batcher.stop()
        if self.unix_socket is not None and self.unix_socket.exists():
            self.unix_socket.unlink()
        self._server, self._thread, self._sockets = None, None, []

    def __enter__(self) -> SessionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # sessions

    def session_path(self, session_id: str) -> str:
        """The path of one open session's routes, its token included: ``/s/<id>/<token>/v1``.
        Hand it only to that session's agent: the token is what admits its requests."""
        with self._lock:
            token = self._tokens.get(session_id)
        if token is None:
            raise ValueError(f"session {session_id!r} is not open")
        return f"/s/{session_id}/{token}/v1"

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of one open session over TCP."""
        if self.url is None:
            raise ValueError("the session server is not started; call start() first")
        return self.url + self.session_path(session_id)

    def open_session(self, session_id: str | None = None) -> Session:
        """Open a session, with a token of 256 random bits (``secrets``); without an id, one
        of 128 random bits. Ids may be guessed; tokens not."""
        session_id = session_id or secrets.token_hex(16)
        if not _SESSION_ID.fullmatch(session_id):
            raise ValueError(f"session id {session_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            session = self._sessions[session_id] = Session(session_id)
            self._tokens[session_id] = secrets.token_urlsafe(32)
            self._turn_locks[session_id] = asyncio.Lock()
        return session

    def close_session(self, session_id: str) -> Session:
        """Stop serving a session and hand back its recording (to ``export``)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            self._turn_locks.pop(session_id, None)
            self._tokens.pop(session_id, None)
        if session is None:
            raise ValueError(f"session {session_id!r} is not open")
        refused = self.slots.pop_refused(session_id)
        if refused:  # one line per session, however many were refused
            log.warning("session %s: %d requests refused with 429 in all", session_id, refused)
        with session.lock:  # wait for a turn in flight
            return session

    def authorize(self, session_id: str, token: str) -> None:
        """ApiError 404 unless the session is open, 403 unless ``token`` is its token."""
        with self._lock:
            expected = self._tokens.get(session_id)
        if expected is None:
            raise ApiError(404, f"session {session_id!r} is not open on this server", "not_found")
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise ApiError(
                403,
                f"the token in this URL is not session {session_id!r}'s; use the base_url "
                "the session was opened with",
                "permission_denied",
            )

    def _session(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"session {session_id!r} is not open on this server", "not_found")
        return session

    def _open(self, session_id: str) -> tuple[Session, asyncio.Lock]:
        with self._lock:
            session, turn_lock = self._sessions.get(session_id), self._turn_locks.get(session_id)
        if session is None or turn_lock is None:
            raise ApiError(404, f"session {session_id!r} is not open on this server", "not_found")
        return session, turn_lock

    # the turn

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            raise ApiError(400, f"the chat template cannot render these messages: {exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    async def chat(self, session_id: str, body: Any) -> dict[str, Any]:
        """One chat turn: render, extend or rewrite the recording, generate, answer.
        Turns of one session run one at a time; the engine call is awaited, never blocking
        the event loop."""
        session, turn_lock = self._open(session_id)
        request = parse_chat_request(body, self.sampling, self.honor_sampling)
        prompt_ids = self.render(request.messages, request.tools)
        async with turn_lock:
            # held across the engine call: close_session waits for the turn; only this
            # session's turn (the asyncio lock's holder) takes it on the event loop
            with session.lock:
                if self._sessions.get(session_id) is not session:
                    raise ApiError(404, f"session {session_id!r} was closed", "not_found")
                if session.error is not None:
                    raise ApiError(400, f"session {session_id!r} failed earlier: {session.error}")
                turn = session.plan(prompt_ids, self.decode)
                n = session.num_turns
                try:
                    future = self.batcher.submit(turn.context, request.sampling)
                    # shielded: a cancelled request must not cancel the batcher's future
                    gen = await asyncio.shield(asyncio.wrap_future(future))
                except Exception as exc:  # recorded on the session and answered as a 500
                    # the short reason is the exception's kind, not the turn (failures.py)
                    session.error = f"engine: {type(exc).__name__} (turn {n}: {exc!r})"
                    log.exception("session %s turn %d: generation failed", session_id, n)
                    raise ApiError(500, session.error, "server_error") from exc
                reply = parse_reply(gen.text, f"call_{n}")
                messages = [*request.messages, reply.message()]
                session.commit(turn, gen, messages, bool(reply.tool_calls))
        return chat_response(
            f"chatcmpl-{session_id}-{n}",
            self.model_name,
            reply,
            gen.finish_reason,
            prompt_tokens=len(turn.context),
            completion_tokens=len(gen.token_ids),
        )

    def models(self, session_id: str) -> dict[str, Any]:
        """The served model, for an open session (else a 404)."""
        self._session(session_id)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rltool"}
        return {"object": "list", "data": [model]}
