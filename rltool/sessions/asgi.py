"""The session server's HTTP face: a Starlette app (routes, session tokens, body, depth and
concurrency limits, API key) for uvicorn.

Design: docs/agent-loops.md#the-session-server
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from rltool.sessions.guard import SessionSlots
from rltool.sessions.protocol import ApiError, chat_chunks, sse_body, wants_stream

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache"}
MAX_JSON_DEPTH = 64  # nesting of a request body; a chat request with tool schemas is ~10 deep


class SessionRoutes(Protocol):
    """What the routes ask of the session server; an unknown session is an ApiError (404)."""

    def authorize(self, session_id: str, token: str) -> None:
        """ApiError unless ``session_id`` is open and ``token`` is its token (404 / 403)."""

    def models(self, session_id: str) -> dict[str, Any]:
        """The ``/v1/models`` answer for an open session."""

    async def chat(self, session_id: str, body: Any) -> dict[str, Any]:
        """One chat turn of a session: the chat-completions answer."""


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes; this server takes at most {limit} "
        "(the session server's max_body_bytes)",
        "request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 on a declared length over ``limit`` before reading a byte,
    or as soon as a chunked body passes it: memory stays under ``limit`` plus one chunk.
    What the client still sends is discarded by uvicorn."""
    declared = request.headers.get("content-length")
    # h11 answers a Content-Length that is not a byte count with 400 before the app runs
    if declared is not None and int(declared) > limit:
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` is 1), without recursion."""
    depth, level = 0, [value]
    while True:
        containers = [x for x in level if isinstance(x, dict | list)]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]


def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON of a request body; ApiError 400 when it is not JSON or nests too deep
    (later steps of a turn recurse over it; json.loads itself stops near 1000 levels)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ApiError(400, f"the request body is not JSON: {exc}") from exc
    except RecursionError:
        depth = "more than Python's parser allows"
    else:
        depth = json_depth(body)
        if depth <= max_depth:
            return body
    raise ApiError(
        400,
        f"the request body nests JSON {depth} levels deep; this server takes at most {max_depth}",
    )


class BearerKey:
    """Answers 401 to any request without ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                exc = ApiError(
                    401,
                    "this session server needs 'Authorization: Bearer <api_key>' "
                    "(the key it was started with)",
                    "authentication_error",
                )
                await error_response(exc, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_many(session_id: str, cap: int) -> Response:
    exc = ApiError(
        429,
        f"session {session_id!r} has {cap} requests in flight already; this server takes at "
        "most that many at once per session (max_session_requests)",
        "rate_limit_exceeded",
    )
    return error_response(exc, {"Connection": "close"})  # the excess connection is let go


def build_app(
    server: SessionRoutes, max_body_bytes: int, api_key: str | None, slots: SessionSlots
) -> ASGIApp:
    """The routes of ``server``: health, models and chat completions per session, each
    under its session's token; at most ``slots.cap`` requests of a session in flight."""

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        sid = request.path_params["sid"]
        try:
            server.authorize(sid, request.path_params["token"])
            return JSONResponse(server.models(sid))
        except ApiError as exc:
            return error_response(exc)

    async def chat(request: Request) -> Response:
        sid = request.path_params["sid"]
        try:
            server.authorize(sid, request.path_params["token"])
            with slots.hold(sid) as admitted:
                if not admitted:
                    return _too_many(sid, slots.cap)
                body = parse_body(await read_body(request, max_body_bytes))
                stream, include_usage = wants_stream(body)
                answer = await server.chat(sid, body)
                if not stream:
                    return JSONResponse(answer)
                # an error before this point is a JSON error with its status, as OpenAI's
                events = sse_body(chat_chunks(answer, include_usage))
                return Response(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:  # gone (or cut at the read deadline) before its body arrived
            log.debug("session server: client left during POST %s", request.url.path)
            return Response(status_code=400)
        except Exception as exc:  # a server bug: logged with its traceback, answered as a 500
            log.exception("session server: POST %s failed", request.url.path)
            return error_response(ApiError(500, f"internal error: {exc!r}", "server_error"))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; use /s/<session_id>/<token>/v1/..."
            return error_response(ApiError(404, message, "not_found"))
        message = f"{request.method} {request.url.path} is not supported ({exc.detail})"
        return error_response(ApiError(exc.status_code, message))

    app: ASGIApp = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/s/{sid}/{token}/v1/models", models, methods=["GET"]),
            Route("/s/{sid}/{token}/v1/chat/completions", chat, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    return app if api_key is None else BearerKey(app, api_key)
