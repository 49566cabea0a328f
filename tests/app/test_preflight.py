"""Preflight: what a recipe's tasks need from the machine and their data, checked before the
model loads; every problem listed in one error."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import wide_environ

import rltool.app.run as run_mod
from rltool.app.run import build_run, check_recipe
from rltool.config.loader import load_recipe
from rltool.demo.data import CODING_TASKS_FILE
from rltool.produce.preflight import MAX_RECORDS_NAMED, preflight_problems
from rltool.produce.task_specs import task_specs
from rltool.sandbox.probe import INSTALL_BWRAP, sandbox_problems

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SANDBOX_RECIPE = REPO / "recipes" / "sandbox_code.yaml"
GSM8K_RECIPE = REPO / "recipes" / "gsm8k_tiny.yaml"
CODING_TASKS = "builtin:coding_tasks/tasks.jsonl"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


class VerlShapedLoop:
    """A class with verl's agent-loop interface: the verl loop runs it without verl."""

    async def run(self, sampling_params, **kwargs):
        raise AssertionError("preflight does not run loops")


def agent(client, task):
    raise AssertionError("preflight does not run agents")


@pytest.fixture
def no_model(monkeypatch):
    """A run that gets as far as loading a model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "ensure_builtin_models", refuse)
    monkeypatch.setattr(run_mod, "load_model_and_tokenizer", refuse)


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def problems_of(recipe_path: Path, *overrides: str) -> list[str]:
    return preflight_problems(task_specs(load_recipe(recipe_path, list(overrides))))


def test_sandbox_recipe_without_bwrap_fails_before_the_model_loads(monkeypatch, no_model):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", str(VENV_BIN))  # python and rltool, no bubblewrap
    recipe = load_recipe(SANDBOX_RECIPE)
    with pytest.raises(ValueError) as info:
        build_run(recipe)
    assert str(info.value) == (
        "preflight: 1 problem(s) to fix before the model loads:\n"
        "  - bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
    )


def test_cli_without_bwrap_exits_2_naming_bubblewrap(tmp_path):
    env = wide_environ(PATH=str(VENV_BIN), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [str(VENV_BIN / "rltool"), "train", "recipes/sandbox_code.yaml",
         f"logging.run_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr  # refused before the model loads
    assert "bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap" in done.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory: it stopped before the run began


@needs_bwrap
def test_a_bwrap_that_cannot_start_a_sandbox_is_reported_with_its_stderr(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (problem,) = sandbox_problems()
    assert problem.startswith(
        f"bubblewrap ({fake}) cannot start a sandbox here: bwrap failed to set up the sandbox "
        "(exit 1): bwrap: setting up uid map: Permission denied; bubblewrap needs user namespaces"
    )


@needs_bwrap
def test_a_working_sandbox_passes(monkeypatch):
    monkeypatch.chdir(REPO)
    assert sandbox_problems() == []
    assert problems_of(SANDBOX_RECIPE) == []


def test_sandbox_options_naming_missing_files_are_problems(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("rltool.agent_loops.sandbox.sandbox_problems", lambda: [])
    gone = tmp_path / "gone"
    problems = problems_of(
        SANDBOX_RECIPE,
        f"agent_loop.options.agent_script={gone}.py",
        f"agent_loop.options.work_parent={gone}",
    )
    assert problems == [
        f"agent_loop.options.agent_script: '{gone}.py' is neither a file nor a module",
        f"agent_loop.options.work_parent: {gone} is not a directory; create it or drop the "
        "option (work dirs then go to the system's temp dir)",
    ]


def test_missing_util_linux_tools_are_named(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("rltool.sandbox.probe.HELPER_TOOLS", ("/no/such/prlimit", "nsenter"))
    assert sandbox_problems() == [
        "/no/such/prlimit, nsenter not found: apt-get install -y util-linux (the sandbox runs "
        "these beside bwrap)"
    ]


def test_sandbox_records_are_checked_field_by_field(monkeypatch, tmp_path):
    monkeypatch.setattr("rltool.agent_loops.sandbox.sandbox_problems", lambda: [])
    good = json.loads(CODING_TASKS_FILE.read_text().splitlines()[0])
    no_check = {k: v for k, v in good.items() if k != "check"}
    records = [good, no_check, {**good, "files": ["a.py"]}, *[no_check] * 3]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    missing = tmp_path / "nope.jsonl"
    problems = problems_of(
        SANDBOX_RECIPE, f"data.train_files=[{train}]", f"data.eval_files=[{missing}]"
    )
    assert problems == [
        f"data file {train} record 1: field 'check' must be a non-empty list of strings (argv), "
        "got None",
        f"data file {train} record 2: field 'files' must be an object of file name -> text, "
        "got ['a.py']",
        f"data file {train} record 3: field 'check' must be a non-empty list of strings (argv), "
        "got None",
        f"data file {train}: 2 more record(s) like these",
        f"data file {missing} does not exist",
    ]
    assert MAX_RECORDS_NAMED == 3


def test_gsm8k_records_need_question_and_answer(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}, {"q": "x"}])
    assert problems_of(GSM8K_RECIPE, f"data.train_files=[{train}]") == [
        f"{train}:2: missing field 'question' (fields present: q); if the prompt is named "
        "otherwise, set the recipe's data.prompt_key or data.preset"
    ]


def test_localhost_agent_and_judger_must_import(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}])
    problems = problems_of(
        REPO / "recipes" / "localhost_calculator.yaml",
        "agent_loop.options.agent=no_such_module:run",
        f"agent_loop.options.judger={__name__}:nope",
        f"data.train_files=[{data}]",
        f"data.eval_files=[{data}]",
    )
    assert problems == [
        "agent_loop.options.agent: cannot import 'no_such_module' (No module named "
        "'no_such_module')",
        f"agent_loop.options.judger: {__name__} has no callable 'nope'",
    ]
    ok = problems_of(
        REPO / "recipes" / "localhost_calculator.yaml",
        f"agent_loop.options.agent={__name__}:agent",
        f"data.train_files=[{data}]",
    )
    assert ok == []


def test_verl_needs_verl_only_for_its_own_classes(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1?", "answer": "2"}])
    files = [f"data.train_files=[{data}]", f"data.eval_files=[{data}]"]
    ours = [f"agent_loop.options.loop_class={__name__}.VerlShapedLoop", *files]
    tools = "agent_loop.options.multi_turn.tool_config_path=null"
    assert problems_of(REPO / "recipes" / "verl_tool.yaml", *ours, tools) == []
    missing = [f"agent_loop.options.loop_class={__name__}.NoSuchLoop", *files, tools]
    assert problems_of(REPO / "recipes" / "verl_tool.yaml", *missing) == [
        f"agent_loop.options.loop_class: {__name__!r} has no class 'NoSuchLoop'"
    ]
    if importlib.util.find_spec("verl") is None:
        (problem,) = problems_of(REPO / "recipes" / "verl_tool.yaml", *files)
        assert problem.startswith(
            "agent_loop.options: loop_class verl.experimental.agent_loop.tool_agent_loop."
            "ToolAgentLoop needs verl, which is not installed: run scripts/verl_env.sh"
        )


def test_every_problem_of_every_task_in_one_error_each_once(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", str(VENV_BIN))
    coding = CODING_TASKS
    missing = tmp_path / "gone.jsonl"
    recipe = load_recipe(
        SANDBOX_RECIPE,
        [
            f"tasks=[{{name: a, agent_loop: {{name: sandbox}}, train_files: [{coding}]}},"
            f"{{name: b, agent_loop: {{name: sandbox}}, train_files: [{missing}]}},"
            f"{{name: c, agent_loop: {{name: gsm8k, options: {{typo: 1}}}}, "
            f"train_files: [{coding}]}}]",
        ],
    )
    with pytest.raises(ValueError) as info:
        check_recipe(recipe)
    assert str(info.value) == (
        "preflight: 3 problem(s) to fix before the model loads:\n"
        "  - tasks[0] (task 'a'), tasks[1] (task 'b'): bubblewrap (bwrap) is not installed: "
        "apt-get install -y bubblewrap\n"
        f"  - tasks[1] (task 'b'): data file {missing} does not exist\n"
        "  - tasks[2] (task 'c'): agent_loop.options.typo: agent loop 'gsm8k' has no such "
        "option; its options: system_prompt"
    )
    assert INSTALL_BWRAP in str(info.value)
