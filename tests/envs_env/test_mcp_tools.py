"""MCP tools in the localhost loop (agent_loop.options.mcp_servers), run in .venv-envs: the
client against a real stdio server, tool errors and timeouts as tool turns, tool results
masked, a server that crashes mid-episode failing its sample with a counted reason while
the next call starts it afresh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="MCP tests run in .venv-envs (bash scripts/envs_env.sh)")

from agent_loops.loop_fakes import ContextEngine, decode, spans

from rltool.agent_loops.base import LoopContext
from rltool.agent_loops.localhost import LocalhostLoop
from rltool.agent_loops.mcp_options import parse_mcp_servers
from rltool.agent_loops.mcp_tools import McpConnections, McpServerDied, McpTools
from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.rollout.contract import check_sample
from rltool.rollout.failures import count_reasons
from rltool.rollout.state import Status

FAKE_SERVER = Path(__file__).with_name("mcp_fake_server.py")
FAKE = {"name": "fake", "command": [sys.executable, str(FAKE_SERVER)]}
TOM = {"question": "Tom has 7 apples and buys 5 more. How many?", "answer": "#### 12"}


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


class Counts:
    def __init__(self):
        self.counts: dict[str, float] = {}

    def add(self, **kw):
        for k, v in kw.items():
            self.counts[k] = self.counts.get(k, 0) + v


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()


def make_loop(tokenizer, reply, **options):
    engine = ContextEngine(tokenizer, reply, model_step=1)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=32), task_name="mcp")
    options = {
        "agent": "rltool.agents.mcp_agent:run",
        "judger": "rltool.agents.calculator:judge",
        "mcp_servers": [FAKE],
        "mcp_tool_timeout_s": 1.0,
        **options,
    }
    return LocalhostLoop(ctx, **options)


def test_client_lists_calls_and_reports_errors_timeouts_and_a_dead_server():
    counts = Counts()
    with McpConnections(parse_mcp_servers([FAKE]), 1.0, 60.0) as conn:
        tools = McpTools(conn, counts)
        names = [t["function"]["name"] for t in tools.schemas]
        assert names == ["calculator", "slow", "broken", "crash"]
        assert tools.schemas[0]["function"]["parameters"]["required"] == ["expression"]
        assert tools.call("calculator", '{"expression": "7 * 6"}') == "7 * 6 = 42"
        # a ToolError, a plain exception, bad arguments, an unknown tool: tool turns, no raise
        assert tools.call("calculator", {"expression": "1 / 0"}).startswith("error: ")
        assert "division by zero" in tools.call("calculator", {"expression": "1 / 0"})
        assert "broken on x" in tools.call("broken", {"text": "x"})
        assert tools.call("calculator", "{not json").startswith("error: the arguments of")
        assert tools.call("nope", {}).startswith("error: unknown tool 'nope'; tools: calculator")
        assert tools.call("slow", {"seconds": 30}) == "error: tool 'slow' timed out after 1 s"
        assert tools.call("calculator", {"expression": "2 + 2"}) == "2 + 2 = 4"  # still up
        assert tools.failure is None
        with pytest.raises(McpServerDied, match=r"server 'fake' died .* tool call 'crash'"):
            tools.call("crash", {})
        with pytest.raises(McpServerDied):  # remembered: no call reaches a dead server
            tools.call("calculator", {"expression": "1 + 1"})
        assert tools.failure.startswith("mcp: server 'fake' died")
    assert counts.counts == {
        "mcp_tool_calls": 8,
        "mcp_tool_errors": 5,
        "mcp_tool_timeouts": 1,
        "mcp_server_deaths": 1,
    }


def test_tool_call_runs_through_mcp_and_its_result_is_masked(tokenizer):
    def reply(context: str) -> str:
        return "#### 12" if "<tool_response>" in context else call("calculator", expression="7 + 5")

    loop = make_loop(tokenizer, reply)
    (group,) = loop.generate_groups([TOM], 2, ["g"])
    for s in group:
        assert s.status == Status.COMPLETED and s.reward == {"score": 1.0}
        assert s.extra["tool_turns"] == 1 and check_sample(s) == []
        (a1, b1), (a2, b2) = spans(s)[0]
        assert decode(tokenizer, s.input_ids[a1:b1]) == reply("") + "<|im_end|>"
        assert decode(tokenizer, s.input_ids[b1:a2]) == (
            "\n<|im_start|>user\n<tool_response>\n7 + 5 = 12\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert decode(tokenizer, s.input_ids[a2:b2]) == "#### 12<|im_end|>"
        assert '"name": "calculator"' in decode(tokenizer, s.prompt_ids)  # the schema, rendered
    metrics = loop.pop_metrics()
    assert metrics["mcp/tool_calls"] == 2 and metrics["mcp/server_deaths"] == 0


@pytest.mark.parametrize(
    ("tool_call", "said"),
    [
        (call("broken", text="q"), "error: Error executing tool broken: broken on q"),
        (call("slow", seconds=30), "error: tool 'slow' timed out after 1 s"),
    ],
)
def test_a_raising_or_hanging_tool_is_a_tool_turn_saying_so(tokenizer, tool_call, said):
    loop = make_loop(tokenizer, lambda c: "#### 12" if "<tool_response>" in c else tool_call)
    ((s,),) = loop.generate_groups([TOM], 1, ["g"])
    assert s.status == Status.COMPLETED and s.reward == {"score": 1.0}
    (_, b1), (a2, _) = spans(s)[0]
    assert f"<tool_response>\n{said}\n</tool_response>" in decode(tokenizer, s.input_ids[b1:a2])
    metrics = loop.pop_metrics()
    assert metrics["mcp/tool_errors"] + metrics["mcp/tool_timeouts"] == 1


def test_a_server_crashing_mid_episode_fails_the_sample_and_the_next_call_goes_on(tokenizer):
    crash = {"question": "crash", "answer": "#### 1"}

    def reply(context: str) -> str:
        if "<tool_response>" in context:
            return "#### 12"
        return (
            call("crash")
            if "crash" in context.split("</tools>")[-1]
            else call("calculator", expression="7 + 5")
        )

    loop = make_loop(tokenizer, reply)
    ((s,),) = loop.generate_groups([crash], 1, ["c"])
    assert s.status == Status.FAILED and s.reward is None
    assert s.error.startswith("mcp: server 'fake' died (connection closed)")
    assert count_reasons([s]) == {"mcp: server 'fake' died": 1}
    assert check_sample(s) == []  # the recorded turn is kept, untrained
    metrics = loop.pop_metrics()
    assert metrics["mcp/server_deaths"] == 1 and metrics["agent/errors"] == 0
    # the next call (the next step) starts the server afresh
    ((ok,),) = loop.generate_groups([TOM], 1, ["t"])
    assert ok.status == Status.COMPLETED and ok.reward == {"score": 1.0}


def test_a_server_that_cannot_start_fails_the_calls_samples_with_its_reason(tokenizer):
    bad = {"name": "bad", "command": [sys.executable, "-c", "raise SystemExit(1)"]}
    loop = make_loop(tokenizer, lambda c: "#### 12", mcp_servers=[bad])
    (group,) = loop.generate_groups([TOM], 2, ["g"])
    assert [s.status for s in group] == [Status.FAILED] * 2
    assert all(s.error.startswith("mcp: server 'bad' did not start") for s in group)
    assert loop.pop_metrics()["mcp/start_failures"] == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_url_server_is_connected_to_and_one_that_is_down_does_not_start():
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    server = subprocess.Popen(
        [sys.executable, "-m", "rltool.agents.mcp_calculator", "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        with McpConnections(parse_mcp_servers([url]), 5.0, 60.0) as conn:
            tools = McpTools(conn, Counts())
            assert [t["function"]["name"] for t in tools.schemas] == ["calculator"]
            assert tools.call("calculator", {"expression": "6 * 7"}) == "6 * 7 = 42"
    finally:
        server.terminate()
        server.wait(10)
    with pytest.raises(RuntimeError, match=rf"mcp: server '{url}' did not start"):
        McpConnections(parse_mcp_servers([url]), 5.0, 60.0).__enter__()


def test_a_server_that_never_answers_fails_to_start_within_the_timeout_and_is_stopped(tmp_path):
    marker = tmp_path / "hang-marker"  # in the hanging server's argv: found in /proc while it lives
    hang = {
        "name": "hang",
        "command": [sys.executable, "-c", "import time; time.sleep(120)", str(marker)],
    }
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"mcp: the servers did not start within 2 s"):
        McpConnections(parse_mcp_servers([hang]), 1.0, 2.0).__enter__()
    assert time.monotonic() - started < 30
    living = [
        pid
        for pid in filter(str.isdigit, os.listdir("/proc"))
        if str(marker).encode() in _cmdline(pid)
    ]
    assert living == []


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
