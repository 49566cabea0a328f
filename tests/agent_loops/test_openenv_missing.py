"""The openenv loop where openenv-core is not installed (rltool's own environment): the recipe
is refused before the model loads, naming the package and its install command; and the
loop's options are checked before anything starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import rltool.app.run as run_mod
from rltool.agent_loops.openenv import OpenEnvLoop
from rltool.agent_loops.openenv_server import OPENENV_MISSING
from rltool.app.run import build_run
from rltool.config.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "openenv_guess.yaml"
INSTALL = "pip install 'rltool[openenv]'"


@pytest.fixture
def no_model(monkeypatch):
    """A run that gets as far as loading a model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "ensure_builtin_models", refuse)
    monkeypatch.setattr(run_mod, "load_model_and_tokenizer", refuse)


@pytest.fixture
def without_openenv(monkeypatch):
    """openenv as if not installed, whether or not this environment has it."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.partition(".")[0] == "openenv" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_recipe_without_openenv_is_refused_before_the_model_loads(
    monkeypatch, no_model, without_openenv
):
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError) as info:
        build_run(load_recipe(RECIPE))
    assert str(info.value) == (
        f"preflight: 1 problem(s) to fix before the model loads:\n  - {OPENENV_MISSING}"
    )
    assert INSTALL in OPENENV_MISSING and "openenv-core" in OPENENV_MISSING


def test_in_rltools_own_environment_the_real_check_names_the_package():
    if importlib.util.find_spec("openenv") is not None:
        pytest.skip("openenv-core is installed here (the envs environment)")
    assert OpenEnvLoop.preflight({"app": "guess_number:app"}) == [OPENENV_MISSING]


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({}, "agent_loop.options: give exactly one of url"),
        ({"url": "http://x:1", "app": "m:app"}, "agent_loop.options: give exactly one of url"),
        ({"app": "guess_number"}, "agent_loop.options.app must be 'module:app'"),
        ({"url": "localhost:8000"}, "agent_loop.options.url must be an http(s)://"),
        ({"app": "m:app", "app_dir": "/no/such/dir"}, "agent_loop.options.app_dir: /no/such"),
        ({"url": "http://x:1", "reward_mode": "mean"}, "agent_loop.options.reward_mode must be"),
    ],
)
def test_option_problems_name_the_option(monkeypatch, options, problem):
    monkeypatch.setattr("rltool.agent_loops.openenv.openenv_missing", lambda: None)
    problems = OpenEnvLoop.option_problems(options)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
