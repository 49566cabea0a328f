"""Agents shipped with rltool.

``calculator``: an in-process agent for the ``localhost`` loop (``run(client, task)``
with an ``openai.OpenAI`` client, ``judge(task, final_text)``).
``sandbox_coder``: a stdlib-only script the ``sandbox`` loop runs inside a bubblewrap
sandbox; it reaches the session server over the bound Unix socket.
"""
