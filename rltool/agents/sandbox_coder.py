"""The scripted coding agent of the ``sandbox`` loop. Runs INSIDE a sandbox; stdlib only.

Exit status: 0 when it finished its turns, non-zero when it could not talk to the model.
Design: docs/agent-loops.md#the-sandbox-coder-agent
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
from urllib.parse import urlsplit

SYSTEM_PROMPT = (
    "You are a Python programmer. Reply with the complete contents of the requested file "
    "in one ```python code block."
)
HTTP_TIMEOUT_S = 600.0  # the sandbox's wall clock bounds the whole run anyway
SELF_TEST_TIMEOUT_S = 10.0
ERROR_TAIL_CHARS = 800
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over an AF_UNIX stream socket (the session server answers any host name)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def chat(conn: http.client.HTTPConnection, base_path: str, messages: list[dict]) -> str:
    """One chat completion; the reply's text. SystemExit on an error answer."""
    body = json.dumps({"model": "rltool-policy", "messages": messages})
    conn.request(
        "POST", f"{base_path}/chat/completions", body, {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    data = json.loads(response.read())
    if response.status != 200:
        raise SystemExit(f"session server answered {response.status}: {data}")
    return data["choices"][0]["message"]["content"] or ""


def extract_code(reply: str) -> str:
    """The last fenced code block of the reply (an unclosed one counts), else the reply."""
    blocks = _CODE_BLOCK.findall(reply)
    return blocks[-1] if blocks else reply


def run_solution(path: str) -> str | None:
    """None when ``python path`` exits 0, else the tail of what it printed."""
    try:
        done = subprocess.run(
            [sys.executable, path], capture_output=True, text=True, timeout=SELF_TEST_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"running {path} took longer than {SELF_TEST_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    return (done.stdout + done.stderr)[-ERROR_TAIL_CHARS:] or f"exit status {done.returncode}"


def main() -> int:
    with open(os.environ["RLTOOL_TASK_FILE"], encoding="utf-8") as fh:
        task = json.load(fh)
    solution_file = task["solution_file"]
    base_path = urlsplit(os.environ["RLTOOL_BASE_URL"]).path.rstrip("/")
    conn = UnixHTTPConnection(os.environ["RLTOOL_SESSION_SOCKET"], HTTP_TIMEOUT_S)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["prompt"]},
    ]
    for turn in range(int(task.get("max_turns", 2))):
        reply = chat(conn, base_path, messages)
        with open(solution_file, "w", encoding="utf-8") as fh:
            fh.write(extract_code(reply))
        error = run_solution(solution_file)
        print(f"turn {turn}: {len(reply)} chars, run: {'ok' if error is None else 'failed'}")
        if error is None:
            break
        messages += [
            {"role": "assistant", "content": reply},
            {
                "role": "user",
                "content": f"Running {solution_file} failed:\n{error}\n"
                "Reply with the whole corrected file in one ```python code block.",
            },
        ]
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
