"""Agents shipped with rltool.

``calculator``: an in-process agent for the ``localhost`` loop (``run(client, task)``
with an ``openai.OpenAI`` client, ``judge(task, final_text)``).
``sandbox_coder``: a stdlib-only script the ``sandbox`` loop runs inside a bubblewrap
sandbox; it reaches the session server over the bound Unix socket.
``mcp_agent``: a generic tool-calling agent over the MCP servers' tools
(``run(client, task, tools)``); ``mcp_calculator``: the calculator as an MCP server
(``python -m rltool.agents.mcp_calculator``) and the agent of recipes/mcp_calculator.yaml.
"""
