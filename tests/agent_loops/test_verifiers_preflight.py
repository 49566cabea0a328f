"""The verifiers loop's preflight, which needs no verifiers: a missing package or
environment is named, with its install command, before any model loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from cli_runner import run_cli

from rltool.agent_loops import verifiers_env
from rltool.agent_loops.verifiers_env import (
    VERIFIERS_MISSING,
    VerifiersLoop,
    environment_problem,
)

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "verifiers_arith.yaml"
HAS_VERIFIERS = importlib.util.find_spec("verifiers") is not None


def test_a_missing_verifiers_package_is_named_with_its_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        verifiers_env.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "verifiers" else real(name, *a),
    )
    assert VerifiersLoop.preflight({"environment": "vf_arith"}) == [VERIFIERS_MISSING]
    assert "pip install 'rltool[verifiers]'" in VERIFIERS_MISSING
    assert "scripts/envs_env.sh" in VERIFIERS_MISSING


def test_a_missing_environment_module_is_named_with_the_fix():
    problem = environment_problem("no-such-env", "")
    assert problem is not None
    assert "verifiers environment 'no-such-env' is not installed: no module 'no_such_env'" in (
        problem
    )
    assert "pip install -e" in problem and "agent_loop.options.env_dir" in problem
    assert "must name" in environment_problem("", "")


def test_an_environment_found_through_env_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.setenv("PYTHONPATH", "")
    (tmp_path / "my_env_pkg").mkdir()
    (tmp_path / "my_env_pkg" / "__init__.py").write_text("")
    assert environment_problem("my-env-pkg", str(tmp_path)) is None
    assert str(tmp_path.resolve()) in __import__("os").environ["PYTHONPATH"]


@pytest.mark.skipif(HAS_VERIFIERS, reason="this environment has verifiers; the run would train")
def test_the_shipped_recipe_without_verifiers_stops_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names its files from the checkout
    result = run_cli(["train", str(RECIPE), f"logging.run_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    assert "pip install 'rltool[verifiers]'" in result.output
    assert "Loading weights" not in result.output
