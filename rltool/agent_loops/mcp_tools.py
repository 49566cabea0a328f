"""MCP servers' tools for an agentic loop: ``agent_loop.options.mcp_servers``.

Ownership: the loop opens one ``McpConnections`` per ``generate_groups`` call, which starts
each stdio server (or connects to each URL) once, lists the tools, and stops the servers when
the call ends, as the session server is per call: nothing outlives the step, and a server
that died is started afresh for the next one. The call's sessions share the connections
(MCP requests carry ids, so concurrent calls interleave); each agent gets its own
``McpTools`` view, which records whether a server died under it (the sample then FAILS with
that reason). The client runs on one asyncio event loop in a thread of its own.
``mcp`` (>=2.0,<3, the ``mcp`` extra) is imported lazily.
Design: docs/agent-loops.md#mcp-tools
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AsyncExitStack, contextmanager
from typing import Any

from rltool.agent_loops.mcp_options import McpOptions, McpServerSpec

CONNECTION_CLOSED = -32000  # mcp_types.jsonrpc: the server's connection is gone
REQUEST_TIMEOUT = -32001
MAX_RESULT_CHARS = 4000  # a tool result longer than this is cut (a tool turn, never trained)

log = logging.getLogger(__name__)


class McpServerDied(RuntimeError):
    """A server's connection closed under a call: the sample cannot go on."""


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP ``Tool`` as the OpenAI function tool the chat template renders."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object", "properties": {}},
        },
    }


def result_text(result: Any) -> str:
    """A ``CallToolResult`` as a tool turn's text: its text parts, else its structured content;
    an error result says so."""
    parts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    text = text[:MAX_RESULT_CHARS]
    return f"error: {text}" if result.is_error else text


class McpConnections:
    """The call's MCP clients (context manager): start, list tools, call, stop."""

    def __init__(
        self, specs: Sequence[McpServerSpec], tool_timeout_s: float, start_timeout_s: float
    ):
        self.specs = list(specs)
        self.tool_timeout_s = tool_timeout_s
        self.start_timeout_s = start_timeout_s
        self.schemas: list[dict[str, Any]] = []  # OpenAI function tools, in server order
        self._owner: dict[str, str] = {}  # tool name -> server name
        self._clients: dict[str, Any] = {}
        self._dead: dict[str, str] = {}  # server name -> why
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rltool-mcp", daemon=True
        )
        # made before the loop runs, so no thread races it; set and awaited on the loop only
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._close = asyncio.Event()
        self._owner_task: Any = None
        self._task: asyncio.Task[None] | None = None  # the owner, on the loop
        self._cancelled = False  # set on the loop: stop starting
        self._done = threading.Event()  # the owner has left every client
        self._started = False

    def __enter__(self) -> McpConnections:
        """Starts every server and lists its tools; RuntimeError ``mcp: ...`` when one cannot."""
        self._thread.start()
        self._owner_task = asyncio.run_coroutine_threadsafe(self._own(), self._loop)
        started = asyncio.run_coroutine_threadsafe(self._wait_ready(), self._loop)
        try:
            started.result(self.start_timeout_s)
            self._started = True
        except FutureTimeout:
            self.__exit__(None, None, None)
            raise RuntimeError(
                f"mcp: the servers did not start within {self.start_timeout_s:g} s "
                "(agent_loop.options.mcp_start_timeout_s)"
            ) from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # still starting: the owner is cancelled on the loop and unwinds what it entered
        # (a concurrent future's cancel() would return before that unwinding ran)
        stop = self._close.set if self._started else self._cancel_owner
        self._loop.call_soon_threadsafe(stop)
        self._done.wait(30.0)  # stdio_client stops each process (stdin, then kill)
        if self._started and self._owner_task.done() and self._owner_task.exception():
            log.warning("mcp: stopping the servers: %r", self._owner_task.exception())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)

    def _cancel_owner(self) -> None:
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()

    async def _wait_ready(self) -> None:
        await asyncio.shield(self._ready)

    async def _own(self) -> None:
        """Enters every client and leaves them in this one task (anyio's scopes require it)."""
        self._task = asyncio.current_task()
        try:
            if self._cancelled:
                raise asyncio.CancelledError
            async with AsyncExitStack() as stack:
                for spec in self.specs:
                    await self._start(stack, spec)
                self._ready.set_result(None)
                await self._close.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise
        finally:
            self._done.set()

    async def _start(self, stack: AsyncExitStack, spec: McpServerSpec) -> None:
        from mcp.client import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        if spec.url is not None:
            client = Client(spec.url)
        else:  # mcp 2.0: Client(StdioServerParameters) fails, a transport works
            params = StdioServerParameters(
                command=spec.argv[0], args=list(spec.argv[1:]), env={**os.environ, **dict(spec.env)}
            )
            client = Client(stdio_client(params))
        try:
            await stack.enter_async_context(client)
            tools, cursor = [], None
            while True:
                page = await client.list_tools(cursor=cursor)
                tools += page.tools
                cursor = page.next_cursor
                if not cursor:
                    break
        except Exception as exc:
            raise RuntimeError(f"mcp: server {spec.name!r} did not start ({exc!r})") from exc
        self._clients[spec.name] = client
        for tool in tools:
            if tool.name in self._owner:
                raise ValueError(
                    f"agent_loop.options.mcp_servers: tool {tool.name!r} is served by both "
                    f"{self._owner[tool.name]!r} and {spec.name!r}; tool names must be unique"
                )
            self._owner[tool.name] = spec.name
            self.schemas.append(openai_tool(tool))

    def call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, str]:
        """(tool turn text, outcome: ok, error or timeout); McpServerDied when the server
        is gone."""
        from mcp.shared.exceptions import MCPError

        server = self._owner.get(name)
        if server is None:
            return f"error: unknown tool {name!r}; tools: {', '.join(self._owner)}", "error"
        if server in self._dead:
            raise McpServerDied(self._dead[server])
        coro = self._clients[server].call_tool(
            name, dict(arguments), read_timeout_seconds=self.tool_timeout_s
        )
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            result = future.result(self.tool_timeout_s + 5.0)  # the client's own timeout is first
        except FutureTimeout:
            future.cancel()
            return self._timeout(name), "timeout"
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                return self._timeout(name), "timeout"
            if exc.code == CONNECTION_CLOSED:
                why = f"mcp: server {server!r} died (connection closed) during tool call {name!r}"
                self._dead.setdefault(server, why)
                raise McpServerDied(self._dead[server]) from exc
            return f"error: tool {name!r} failed: {exc}", "error"
        text = result_text(result)
        return text, "error" if result.is_error else "ok"

    def _timeout(self, name: str) -> str:
        return f"error: tool {name!r} timed out after {self.tool_timeout_s:g} s"


class McpTools:
    """One agent's view of the call's MCP tools: ``schemas`` to pass as ``tools=``, and calls.

    A tool that errors or times out answers with a text saying so; a server that died raises
    ``McpServerDied`` and is remembered in ``failure`` (the loop fails the sample with it,
    even when the agent catches the exception).
    """

    def __init__(self, connections: McpConnections | str, counters: Any):
        self._counters = counters
        self.failure: str | None = None
        if isinstance(connections, str):  # the servers did not start: the reason
            self.failure = connections
            counters.add(mcp_start_failures=1)
        else:
            self._conn = connections

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return self._conn.schemas

    def call(self, name: str, arguments: str | Mapping[str, Any] | None) -> str:
        """The tool turn's text for one call; ``arguments`` as JSON text or a mapping."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                self._counters.add(mcp_tool_calls=1, mcp_tool_errors=1)
                return f"error: the arguments of {name!r} are not JSON ({exc.msg})"
        if not isinstance(arguments, Mapping):
            self._counters.add(mcp_tool_calls=1, mcp_tool_errors=1)
            return f"error: the arguments of {name!r} must be a JSON object"
        try:
            text, outcome = self._conn.call(name, arguments)
        except McpServerDied as exc:
            if self.failure is None:
                self.failure = str(exc)
                self._counters.add(mcp_server_deaths=1)
            raise
        self._counters.add(
            mcp_tool_calls=1,
            mcp_tool_errors=int(outcome == "error"),
            mcp_tool_timeouts=int(outcome == "timeout"),
        )
        return text

    def tool_message(self, call: Any) -> dict[str, Any]:
        """The ``role: tool`` message answering one OpenAI tool call of a reply."""
        content = self.call(call.function.name, call.function.arguments)
        return {"role": "tool", "tool_call_id": call.id, "content": content}


@contextmanager
def open_tools(options: McpOptions | None) -> Iterator[McpConnections | str | None]:
    """A call's MCP tools: None without servers, the connections, or (when a server cannot
    start) the reason, with which every session of the call then fails."""
    if options is None:
        yield None
        return
    try:
        connections = McpConnections(
            options.specs, options.tool_timeout_s, options.start_timeout_s
        ).__enter__()
    except (RuntimeError, ValueError, OSError) as exc:
        why = str(exc) if str(exc).startswith("mcp: ") else f"mcp: {exc}"
        log.warning("%s", why)
        yield why
        return
    try:
        yield connections
    finally:
        connections.__exit__(None, None, None)
