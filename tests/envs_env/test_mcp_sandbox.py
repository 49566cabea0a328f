"""MCP tools in the sandbox loop, run in .venv-envs with bubblewrap: the agent inside reaches
the call's MCP tools through the bridge socket bound at /run/rltool-mcp/tools.sock; the tool turn
is masked; a server that crashes mid-episode fails the sample with its counted reason."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="MCP tests run in .venv-envs (bash scripts/envs_env.sh)")

from agent_loops.loop_fakes import ContextEngine, decode, spans

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.sandbox import SandboxLoop
from rltool.config.schema import SamplingConfig
from rltool.data import load_examples
from rltool.demo.data import CODING_TASKS_FILE
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.rollout.contract import check_sample
from rltool.rollout.failures import count_reasons
from rltool.rollout.state import Status

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

FAKE = {
    "name": "fake",
    "command": [sys.executable, str(Path(__file__).with_name("mcp_fake_server.py"))],
}
ADD = next(t for t in load_examples([CODING_TASKS_FILE]) if t["name"] == "add")
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
# A stdlib agent: the tools from the bridge, one model call with them, each tool call run
# through the bridge and answered as a tool turn, a second call; its code is the solution.
TOOL_AGENT = r"""
import http.client, json, os, re, socket, sys
from urllib.parse import urlsplit

class Conn(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)

def ask(conn, method, path, body=None):
    conn.request(method, path, None if body is None else json.dumps(body))
    response = conn.getresponse()
    data = json.loads(response.read())
    if response.status != 200:
        sys.exit(f"{path}: {response.status} {data}")
    return data

chat, tools = Conn(os.environ["RLTOOL_SESSION_SOCKET"]), Conn(os.environ["RLTOOL_MCP_SOCKET"])
chat_path = urlsplit(os.environ["RLTOOL_BASE_URL"]).path + "/chat/completions"
mcp_path = urlsplit(os.environ["RLTOOL_MCP_URL"]).path
schemas = ask(tools, "GET", mcp_path + "/tools")["tools"]
messages = [{"role": "user", "content": "write add"}]
reply = ask(chat, "POST", chat_path, {"messages": messages, "tools": schemas})
message = reply["choices"][0]["message"]
for call in message.get("tool_calls") or []:
    messages.append(message)
    fn = call["function"]
    body = {"name": fn["name"], "arguments": fn["arguments"]}
    content = ask(tools, "POST", mcp_path + "/call", body)["content"]
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    reply = ask(chat, "POST", chat_path, {"messages": messages, "tools": schemas})
    message = reply["choices"][0]["message"]
code = re.findall(r"```python\n(.*?)```", message["content"] or "", re.S)
open("solution.py", "w").write(code[-1] if code else "")
"""


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


def make_loop(tokenizer, tmp_path, first_call: str) -> SandboxLoop:
    agent = tmp_path / "tool_agent.py"
    agent.write_text(TOOL_AGENT)

    def reply(context: str) -> str:
        return GOOD if "<tool_response>" in context else first_call

    ctx = LoopContext(
        ContextEngine(tokenizer, reply), tokenizer, SamplingConfig(max_new_tokens=64), "sandbox"
    )
    return SandboxLoop(
        ctx, agent_script=str(agent), mcp_servers=[FAKE], mcp_tool_timeout_s=5.0, max_concurrent=2
    )


def test_a_sandboxed_agent_calls_mcp_tools_through_the_bridge(tokenizer, tmp_path):
    loop = make_loop(tokenizer, tmp_path, call("calculator", expression="2 + 3"))
    (group,) = loop.generate_groups([ADD], 2, ["g"])
    for s in group:
        assert s.status == Status.COMPLETED and s.reward["score"] == 1.0, s.error
        assert check_sample(s) == []
        (_, b1), (a2, _) = spans(s)[0]
        assert "<tool_response>\n2 + 3 = 5\n</tool_response>" in decode(
            tokenizer, s.input_ids[b1:a2]
        )
    metrics = loop.pop_metrics()
    assert metrics["mcp/tool_calls"] == 2 and metrics["sandbox/check_pass_rate"] == 1.0


def test_a_server_crash_under_a_sandboxed_agent_fails_its_sample(tokenizer, tmp_path):
    loop = make_loop(tokenizer, tmp_path, call("crash"))
    ((s,),) = loop.generate_groups([ADD], 1, ["g"])
    assert s.status == Status.FAILED and s.reward is None
    assert count_reasons([s]) == {"mcp: server 'fake' died": 1}
    assert loop.pop_metrics()["mcp/server_deaths"] == 1
