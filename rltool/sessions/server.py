"""The session server: an OpenAI-compatible HTTP endpoint that records each session.

On loopback and optionally on a Unix socket; each session has its own base URL, so the
official ``openai`` client works unmodified. Design: docs/agent-loops.md#the-session-server
"""

from __future__ import annotations

import json
import logging
import os
import re
import socketserver
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from rltool.config.schema import SamplingConfig
from rltool.engines.base import RolloutEngine
from rltool.engines.batcher import GenerationBatcher
from rltool.sessions.protocol import ApiError, chat_response, parse_chat_request
from rltool.sessions.session import Session
from rltool.sessions.tool_calls import parse_reply

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ROUTE = re.compile(r"/s/(?P<sid>[^/]+)/v1/(?P<rest>chat/completions|models)")


class SessionServer:
    """Sessions, the chat turn, and the HTTP listeners that serve them."""

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
    ):
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingConfig()
        self.model_name = model_name
        self.honor_sampling = honor_sampling
        # a reply cut to its turn's budget is decoded as the engine decodes its replies
        self.batcher = GenerationBatcher(
            engine, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        )
        self._host, self._port = host, port
        self.unix_socket = None if unix_socket is None else Path(unix_socket)
        self.url: str | None = None  # http://host:port once started
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()  # guards _sessions
        self._listeners: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []

    # lifecycle

    def start(self) -> SessionServer:
        if self.unix_socket is not None and self.unix_socket.exists():
            raise ValueError(f"unix socket path {self.unix_socket} already exists; remove it")
        handler = type("Handler", (_Handler,), {"app": self})
        tcp = ThreadingHTTPServer((self._host, self._port), handler)
        self._listeners.append(tcp)
        self.url = f"http://{self._host}:{tcp.server_address[1]}"
        if self.unix_socket is not None:
            self._listeners.append(_UnixHTTPServer(str(self.unix_socket), handler))
        self.batcher.start()
        for listener in self._listeners:
            t = threading.Thread(
                target=listener.serve_forever, args=(0.05,), name="rltool-sessions", daemon=True
            )  # poll interval 0.05 s: how long stop() waits for the accept loop
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        for listener in self._listeners:
            listener.shutdown()
            listener.server_close()
        for t in self._threads:
            t.join()
        self.batcher.stop()
        if self.unix_socket is not None and self.unix_socket.exists():
            self.unix_socket.unlink()
        self._listeners, self._threads = [], []

    def __enter__(self) -> SessionServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # sessions

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of one session over TCP."""
        if self.url is None:
            raise ValueError("the session server is not started; call start() first")
        return f"{self.url}/s/{session_id}/v1"

    def open_session(self, session_id: str | None = None) -> Session:
        session_id = session_id or uuid.uuid4().hex
        if not _SESSION_ID.fullmatch(session_id):
            raise ValueError(f"session id {session_id!r}: use 1-128 of A-Z a-z 0-9 . _ -")
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open")
            session = self._sessions[session_id] = Session(session_id)
        return session

    def close_session(self, session_id: str) -> Session:
        """Stop serving a session and hand back its recording (to ``export``)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise ValueError(f"session {session_id!r} is not open")
        with session.lock:  # wait for a turn in flight
            return session

    def _session(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"session {session_id!r} is not open on this server", "not_found")
        return session

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

    def chat(self, session_id: str, body: Any) -> dict[str, Any]:
        """One chat turn: render, extend or rewrite the recording, generate, answer."""
        session = self._session(session_id)
        request = parse_chat_request(body, self.sampling, self.honor_sampling)
        prompt_ids = self.render(request.messages, request.tools)
        with session.lock:
            if session.error is not None:
                raise ApiError(400, f"session {session_id!r} failed earlier: {session.error}")
            turn = session.plan(prompt_ids, self.decode)
            n = session.num_turns
            try:
                gen = self.batcher.generate(turn.context, request.sampling)
            except Exception as exc:  # recorded on the session and answered as a 500
                session.error = f"turn {n}: generation failed: {exc!r}"
                log.exception("session %s turn %d: generation failed", session_id, n)
                raise ApiError(500, session.error, "server_error") from exc
            reply = parse_reply(gen.text, f"call_{n}")
            session.commit(turn, gen, [*request.messages, reply.message()], bool(reply.tool_calls))
        return chat_response(
            f"chatcmpl-{session_id}-{n}",
            self.model_name,
            reply,
            gen.finish_reason,
            prompt_tokens=len(turn.context),
            completion_tokens=len(gen.token_ids),
        )

    def models(self) -> dict[str, Any]:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rltool"}
        return {"object": "list", "data": [model]}


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection
    app: SessionServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("session server: " + format, *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.log_request(status)
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        # status, headers and body in one write: two small writes on a keep-alive
        # TCP connection meet Nagle and delayed ACK, a 40 ms stall per response
        self.wfile.write(head.encode() + data)

    def _route(self) -> tuple[str, str]:
        match = _ROUTE.fullmatch(self.path.split("?", 1)[0])
        if match is None:
            raise ApiError(404, f"no route {self.path}; use /s/<session_id>/v1/...", "not_found")
        return match["sid"], match["rest"]

    def do_GET(self) -> None:
        try:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
                return
            self.app._session(self._route()[0])
            self._send(200, self.app.models())
        except ApiError as exc:
            self._send(exc.status, exc.body())

    def do_POST(self) -> None:
        # read the body first: left unread, it would corrupt the next request on this connection
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            session_id, rest = self._route()
            if rest != "chat/completions":
                raise ApiError(405, f"POST {self.path} is not supported")
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"the request body is not JSON: {exc}") from exc
            self._send(200, self.app.chat(session_id, body))
        except ApiError as exc:
            self._send(exc.status, exc.body())
        except Exception as exc:  # a server bug: logged with its traceback, answered as a 500
            log.exception("session server: POST %s failed", self.path)
            self._send(500, ApiError(500, f"internal error: {exc!r}", "server_error").body())
