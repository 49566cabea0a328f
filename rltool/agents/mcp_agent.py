"""A generic tool-calling agent for the MCP servers of ``agent_loop.options.mcp_servers``.

``agent: rltool.agents.mcp_agent:run`` in a ``localhost`` recipe: the task's ``question``
(or ``prompt``) as the user turn, the MCP servers' tools offered to the model, each tool
call run through the MCP client and answered as a tool turn (never trained), until the
model answers without a call or ``MAX_TOOL_ROUNDS`` rounds are done. Returns the final
assistant text for the recipe's judger. Design: docs/agent-loops.md#mcp-tools
"""

from __future__ import annotations

from typing import Any

MODEL = "rltool-policy"  # the session server serves one model, whatever the name
MAX_TOOL_ROUNDS = 4


def user_text(task: dict[str, Any]) -> str:
    """The task's first user turn: ``question``, else ``prompt`` (a string)."""
    for key in ("question", "prompt"):
        if isinstance(task.get(key), str):
            return task[key]
    raise ValueError("the MCP agent needs a task field 'question' or 'prompt' (a string)")


def assistant_message(reply: Any) -> dict[str, Any]:
    """The assistant reply echoed back as the request history expects it."""
    out: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in reply.tool_calls]
    return out


def run(client: Any, task: dict[str, Any], tools: Any) -> str:
    """One episode of model turns and MCP tool turns; the final assistant text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": user_text(task)}]
    for _ in range(MAX_TOOL_ROUNDS + 1):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools.schemas
        )
        reply = response.choices[0].message
        if not reply.tool_calls:
            break
        messages.append(assistant_message(reply))
        messages += [tools.tool_message(call) for call in reply.tool_calls]
    return reply.content or ""
