"""The calculator as an MCP server, and the agent of ``recipes/mcp_calculator.yaml``.

Server: ``python -m rltool.agents.mcp_calculator`` serves one tool, ``calculator``, over
stdio (``--http PORT``: streamable HTTP on 127.0.0.1), evaluating with ``calculate``, the
calculator agent's safe evaluator; a refused expression raises ``ToolError``, which the
client receives as an error result carrying the reason. ``mcp`` is imported when serving.

Agent: ``run(client, task, tools)``, the calculator agent's episode with the tools coming
from the MCP servers: the model's tool calls run through ``tools``; an answer with no tool
call gets the MCP calculator's check of its first operation as feedback, so every episode
has environment tokens (masked) between two answers.
Design: docs/agent-loops.md#mcp-tools
"""

from __future__ import annotations

import argparse
from typing import Any

from rltool.agents.calculator import MODEL, calculate, first_operation
from rltool.agents.mcp_agent import assistant_message

MAX_TOOL_ROUNDS = 2
ASK = "give the final answer as #### N"


def build_server() -> Any:
    """The MCP server object (``mcp.server.mcpserver.MCPServer``) with the calculator tool."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("rltool-calculator")

    @server.tool()
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        try:
            return f"{expression} = {calculate(expression)}"
        except ValueError as exc:
            raise ToolError(str(exc)) from exc

    return server


def check_feedback(answer: str, tools: Any) -> str:
    """The MCP calculator's verdict on the first ``a op b`` of an answer, as a user message."""
    expression = first_operation(answer)
    if expression is None:
        return f"calculator: no expression found in your answer; write it as a + b = c, then {ASK}"
    result = tools.call("calculator", {"expression": expression})
    return f"calculator: {result}; {ASK}"


def run(client: Any, task: dict[str, Any], tools: Any) -> str:
    """One episode; returns the final assistant text (``calculator.judge`` scores it)."""

    def ask() -> Any:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools.schemas
        )
        return response.choices[0].message

    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task["question"])}]
    reply = ask()
    messages.append(assistant_message(reply))
    if not reply.tool_calls:
        messages.append({"role": "user", "content": check_feedback(reply.content or "", tools)})
        return ask().content or ""
    for _ in range(MAX_TOOL_ROUNDS):
        messages += [tools.tool_message(call) for call in reply.tool_calls]
        reply = ask()
        if not reply.tool_calls:
            break
        messages.append(assistant_message(reply))
    return reply.content or ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The calculator MCP server (stdio by default).")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP instead")
    args = parser.parse_args(argv)
    server = build_server()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
