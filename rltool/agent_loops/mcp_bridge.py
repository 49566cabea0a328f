"""The sandbox loop's MCP tools: an HTTP bridge on a Unix socket bound into each sandbox.

The agent inside reaches nothing but bound sockets, so the loop serves the call's MCP
tools (``mcp_tools.McpConnections``) on a second socket, ``RLTOOL_MCP_SOCKET`` inside
(``/run/rltool-mcp/tools.sock``), each session under a path with a random token of its
own (``RLTOOL_MCP_URL``):
``GET {path}/tools`` answers ``{"tools": [OpenAI function tools]}``, ``POST {path}/call``
with ``{"name", "arguments"}`` answers ``{"content": tool turn text}`` (a tool error or
timeout is such a text), or 502 ``{"error": ...}`` when the server died (the sample then
FAILS with that reason). Stdlib only. Design: docs/agent-loops.md#mcp-tools
"""

from __future__ import annotations

import json
import secrets
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from rltool.agent_loops.mcp_tools import McpConnections, McpServerDied, McpTools

MCP_SOCKET = "/run/rltool-mcp/tools.sock"  # inside a sandbox (/run/rltool is the sandbox's own)
MAX_BODY_BYTES = 1 << 20


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    bridge: McpBridge


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log on stderr

    def address_string(self) -> str:
        return "sandbox"  # a Unix socket peer has no host

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _tools(self, suffix: str) -> McpTools | None:
        token, _, rest = self.path.strip("/").partition("/")
        tools = self.server.bridge.by_token(token)
        if tools is None or rest != suffix:
            self._answer(404, {"error": f"no such path {self.path!r}"})
            return None
        return tools

    def do_GET(self) -> None:
        tools = self._tools("tools")
        if tools is not None:
            self._answer(200, {"tools": tools.schemas})

    def do_POST(self) -> None:
        tools = self._tools("call")
        if tools is None:
            return
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY_BYTES:
            self._answer(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            return
        try:
            body = json.loads(self.rfile.read(size) or b"{}")
            name, arguments = str(body["name"]), body.get("arguments")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            self._answer(400, {"error": f'body must be {{"name": ..., "arguments": ...}} ({exc})'})
            return
        try:
            self._answer(200, {"content": tools.call(name, arguments)})
        except McpServerDied as exc:
            self._answer(502, {"error": str(exc)})


class McpBridge:
    """The call's MCP tools on ``socket_path`` (context manager); one view per session."""

    def __init__(self, connections: McpConnections | str, counters: Any, socket_path: Path):
        self.connections = connections
        self.counters = counters
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}  # session id -> token
        self._tools: dict[str, McpTools] = {}  # token -> the session's view
        self._server = _Server(str(socket_path), _Handler)
        self._server.bridge = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rltool-mcp-bridge", daemon=True
        )

    def __enter__(self) -> McpBridge:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10.0)

    def open(self, session_id: str) -> tuple[McpTools, str]:
        """The session's tools and its URL inside the sandbox (``http://localhost/TOKEN``)."""
        tools = McpTools(self.connections, self.counters)
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._tokens[session_id] = token
            self._tools[token] = tools
        return tools, f"http://localhost/{token}"

    def close(self, session_id: str) -> None:
        with self._lock:
            self._tools.pop(self._tokens.pop(session_id), None)

    def by_token(self, token: str) -> McpTools | None:
        with self._lock:
            return self._tools.get(token)
