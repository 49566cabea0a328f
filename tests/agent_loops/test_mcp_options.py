"""agent_loop.options.mcp_servers checked without the MCP client installed (the fast tier's
.venv): entries parsed with errors naming them, the agent's arity, and the missing package
named before the model loads with its install command."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import wide_environ

import rltool.app.run as run_mod
from rltool.agent_loops.mcp_options import (
    McpServerSpec,
    mcp_options,
    mcp_problems,
    parse_mcp_servers,
)
from rltool.app.run import build_run
from rltool.config.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "mcp_calculator.yaml"
no_mcp = pytest.mark.skipif(
    importlib.util.find_spec("mcp") is not None, reason="needs an environment without mcp"
)
INSTALL = "pip install 'rltool[mcp]'"


def agent3(client, task, tools):
    return ""


def agent2(client, task):
    return ""


def test_entries_are_commands_urls_or_mappings():
    specs = parse_mcp_servers(
        [
            "{python} -m rltool.agents.mcp_calculator",
            "http://127.0.0.1:8000/mcp",
            {"name": "calc2", "command": ["calc", "--x"], "env": {"A": 1}},
        ]
    )
    assert specs == [
        McpServerSpec(
            "rltool.agents.mcp_calculator", (sys.executable, "-m", "rltool.agents.mcp_calculator")
        ),
        McpServerSpec("http://127.0.0.1:8000/mcp", (), "http://127.0.0.1:8000/mcp"),
        McpServerSpec("calc2", ("calc", "--x"), None, (("A", "1"),)),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("python -m x", r"mcp_servers must be a non-empty list"),
        ([], r"mcp_servers must be a non-empty list"),
        ([{"command": "a", "url": "http://x"}], r"mcp_servers\[0\]: give exactly one of"),
        ([{"url": "ftp://x"}], r"mcp_servers\[0\]\.url must start with http"),
        ([{"command": "a", "port": 1}], r"mcp_servers\[0\]: unknown key 'port'"),
        ([{"command": []}], r"mcp_servers\[0\]\.command must be"),
        (["a b", "c b"], r"mcp_servers\[1\]: a second server named 'b'"),
        ([{"url": "http://x", "env": {"A": "1"}}], r"mcp_servers\[0\]\.env must be"),
    ],
)
def test_bad_entries_are_errors_naming_the_entry(value, message):
    with pytest.raises(ValueError, match=message):
        parse_mcp_servers(value)


def test_the_agent_must_take_the_tools_and_timeouts_must_be_positive():
    servers = ["srv"]
    options = mcp_options(servers, 5, 60, agent3, "m:agent3")
    assert options.specs == (McpServerSpec("srv", ("srv",)),)
    assert mcp_options(None, 5, 60, agent2, "m:agent2") is None
    with pytest.raises(ValueError, match=r"options\.agent: with mcp_servers the agent is called"):
        mcp_options(servers, 5, 60, agent2, "m:agent2")
    with pytest.raises(ValueError, match=r"options\.mcp_tool_timeout_s must be seconds > 0"):
        mcp_options(servers, 0, 60, agent3, "m:agent3")


@no_mcp
def test_preflight_names_the_missing_package_with_its_install_command():
    (problem,) = mcp_problems(["{python} -m rltool.agents.mcp_calculator"])
    assert INSTALL in problem and problem.startswith("agent_loop.options.mcp_servers needs")


@no_mcp
def test_mcp_recipe_without_mcp_fails_before_the_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "ensure_builtin_models", refuse)
    monkeypatch.setattr(run_mod, "load_model_and_tokenizer", refuse)
    with pytest.raises(ValueError) as info:
        build_run(load_recipe(RECIPE))
    assert str(info.value).startswith("preflight: 1 problem(s) to fix before the model loads:")
    assert INSTALL in str(info.value)


@no_mcp
@pytest.mark.slow
def test_cli_without_mcp_exits_2_naming_the_install_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "from rltool.cli.app import main; main()", "train",
         str(RECIPE), f"logging.run_dir={tmp_path}"],
        cwd=REPO, env=wide_environ(PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert INSTALL in done.stdout + done.stderr
    assert not (tmp_path / "mcp_calculator" / "checkpoints").exists()
