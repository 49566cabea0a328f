"""The calculator MCP server plus tools that misbehave, for tests/envs_env/test_mcp_*.py:
``slow`` sleeps past any test timeout, ``broken`` raises a plain exception, ``crash`` kills
the server process mid-call."""

from __future__ import annotations

import os
import time

from rltool.agents.mcp_calculator import build_server

server = build_server()


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "woke up"


@server.tool()
def broken(text: str) -> str:
    """Raise a plain exception (not a ToolError)."""
    raise RuntimeError(f"broken on {text}")


@server.tool()
def crash() -> str:
    """End the server process at once."""
    os._exit(3)


if __name__ == "__main__":
    server.run()
