"""``agent_loop.options.mcp_servers`` and its companions, checked without the MCP client:
the server entries, the timeouts, the agent's arity, preflight problems, ``mcp/*`` figures.
The client itself is ``mcp_tools``. Design: docs/agent-loops.md#mcp-tools
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MCP_MISSING = (
    "agent_loop.options.mcp_servers needs the MCP client (mcp>=2.0,<3): "
    "pip install 'rltool[mcp]' (or bash scripts/envs_env.sh)"
)
_URL_PREFIXES = ("http://", "https://")


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    """One entry of ``mcp_servers``: a stdio server's argv, or a streamable-HTTP URL."""

    name: str
    argv: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # over rltool's own environment (stdio only)


def parse_mcp_servers(value: Any) -> list[McpServerSpec]:
    """``mcp_servers`` -> specs. An entry is a command line (``"{python} -m pkg.server"``:
    ``{python}`` is rltool's own interpreter), a URL (``http(s)://...``), or a mapping
    ``{name, command | url, env}``; ValueError naming the entry."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(
            f"agent_loop.options.mcp_servers must be a non-empty list of commands or URLs, "
            f"got {value!r}"
        )
    specs: list[McpServerSpec] = []
    for i, entry in enumerate(value):
        where = f"agent_loop.options.mcp_servers[{i}]"
        fields = dict(entry) if isinstance(entry, Mapping) else {"command": entry}
        unknown = sorted(set(fields) - {"name", "command", "url", "env"})
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; keys: name, command, url, env")
        command, url = fields.get("command"), fields.get("url")
        if isinstance(command, str) and command.startswith(_URL_PREFIXES):
            command, url = None, command
        if (command is None) == (url is None):
            raise ValueError(f"{where}: give exactly one of command (a stdio server) or url")
        argv: tuple[str, ...] = ()
        if command is not None:
            parts = shlex.split(command) if isinstance(command, str) else command
            if (
                not isinstance(parts, Sequence)
                or not parts
                or not all(isinstance(a, str) for a in parts)
            ):
                raise ValueError(f"{where}.command must be a command line or an argv list")
            argv = tuple(a.replace("{python}", sys.executable) for a in parts)
        elif not isinstance(url, str) or not url.startswith(_URL_PREFIXES):
            raise ValueError(f"{where}.url must start with http:// or https://, got {url!r}")
        env = fields.get("env") or {}
        if not isinstance(env, Mapping) or (env and url is not None):
            raise ValueError(f"{where}.env must be a mapping, and only for a command")
        name = str(fields.get("name") or (url if url else os.path.basename(argv[-1])))
        if name in {s.name for s in specs}:
            raise ValueError(f"{where}: a second server named {name!r}; give it its own name")
        env_items = tuple(sorted((str(k), str(v)) for k, v in env.items()))
        specs.append(McpServerSpec(name, argv, url, env_items))
    return specs


def mcp_problems(value: Any) -> list[str]:
    """What running ``mcp_servers`` needs from this machine, as fix-it sentences (preflight)."""
    if importlib.util.find_spec("mcp") is None:
        return [MCP_MISSING]
    version = importlib.metadata.version("mcp")
    if version.split(".")[0] != "2":
        return [f"{MCP_MISSING}; found mcp {version}"]
    try:
        specs = parse_mcp_servers(value)
    except ValueError as exc:
        return [str(exc)]
    return [
        f"agent_loop.options.mcp_servers: server {s.name!r}: {s.argv[0]!r} is not a program "
        "on PATH; install it or give its full path"
        for s in specs
        if s.argv and shutil.which(s.argv[0]) is None
    ]


@dataclass(frozen=True, slots=True)
class McpOptions:
    """A loop's checked ``mcp_*`` options."""

    specs: tuple[McpServerSpec, ...]
    tool_timeout_s: float
    start_timeout_s: float


def mcp_options(
    servers: Any,
    tool_timeout_s: float,
    start_timeout_s: float,
    agent: Any = None,
    agent_path: str = "",
) -> McpOptions | None:
    """The checked options (None without ``mcp_servers``); the agent must take ``tools``."""
    if servers is None:
        return None
    specs = parse_mcp_servers(servers)
    for key, value in (
        ("mcp_tool_timeout_s", tool_timeout_s),
        ("mcp_start_timeout_s", start_timeout_s),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"agent_loop.options.{key} must be seconds > 0, got {value!r}")
    try:
        if agent is not None:  # the sandbox loop's agent is a command, not a callable
            inspect.signature(agent).bind(None, None, None)
    except TypeError as exc:
        raise ValueError(
            f"agent_loop.options.agent: with mcp_servers the agent is called as "
            f"agent(client, task, tools); {agent_path} cannot be ({exc}). Take the tools, or "
            "use rltool.agents.mcp_agent:run"
        ) from exc
    except ValueError:  # a builtin without a signature: let the call tell
        pass
    return McpOptions(tuple(specs), float(tool_timeout_s), float(start_timeout_s))


def mcp_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """``mcp/*`` figures from a loop's counts."""
    return {
        "mcp/tool_calls": counts.get("mcp_tool_calls", 0.0),
        "mcp/tool_errors": counts.get("mcp_tool_errors", 0.0),
        "mcp/tool_timeouts": counts.get("mcp_tool_timeouts", 0.0),
        "mcp/server_deaths": counts.get("mcp_server_deaths", 0.0),
        "mcp/start_failures": counts.get("mcp_start_failures", 0.0),
    }
