"""Every name-valued recipe key is checked in the one pass ``rltool train`` (and
``--print-config``) runs right after loading: a misspelled name exits 2 naming the key
and the known names, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli

from rltool.app.recipe_names import RECIPE_REGISTRIES, check_config, name_problems
from rltool.config.checks import (
    FREE_TEXT,
    NAMES,
    REGISTRY_KEYS,
    string_keys,
    unchecked_string_keys,
)
from rltool.config.loader import find_recipes, load_recipe
from rltool.config.schema import RecipeConfig, TaskConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
NAME_KEYS = sorted({*NAMES, *RECIPE_REGISTRIES})


def known_names(pattern: str) -> list[str]:
    rule = NAMES.get(pattern)
    return rule.known() if rule is not None else RECIPE_REGISTRIES[pattern].known()


def test_every_string_key_of_the_schema_has_one_home() -> None:
    assert unchecked_string_keys(RECIPE_REGISTRIES) == []
    assert set(RECIPE_REGISTRIES) == set(REGISTRY_KEYS)  # the app knows every registry key
    homes = [*NAMES, *REGISTRY_KEYS, *FREE_TEXT]
    assert len(homes) == len(set(homes))  # no key in two tables
    assert set(homes) <= set(string_keys())  # no table names a key the schema lacks


def test_defaults_and_shipped_recipes_pass_the_name_checks() -> None:
    check_config(RecipeConfig())
    for path in find_recipes():
        check_config(load_recipe(path), str(path))


def _misspelled(pattern: str) -> tuple[Path, str, str, str]:
    """(recipe, override, the key the error names, the bad value) for one name key."""
    bad = next(n for n in known_names(pattern) if n) + "x"
    if pattern.startswith("tasks[*]."):
        rest = pattern.removeprefix("tasks[*].")
        multitask = RECIPES / "gsm8k_tiny_multitask.yaml"
        return multitask, f"tasks.1.{rest}={bad}", f"tasks[1].{rest}", bad
    if pattern == "algorithm.rollout_correction.reject[*].criterion":
        key = "algorithm.rollout_correction.reject"
        override = f"{key}=[{{criterion: {bad}, upper: 1}}]"
        return RECIPES / "gsm8k_tiny.yaml", override, f"{key}[0].criterion", bad
    if pattern.endswith("[*]"):
        key = pattern.removesuffix("[*]")
        return RECIPES / "gsm8k_tiny.yaml", f"{key}=[{bad}]", f"{key}[0]", bad
    return RECIPES / "gsm8k_tiny.yaml", f"{pattern}={bad}", pattern, bad


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building or loading a model fails the test: the check must come first."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the recipe's names were checked")

    monkeypatch.setattr("rltool.app.run.ensure_builtin_models", boom)
    monkeypatch.setattr("rltool.app.run.load_model_and_tokenizer", boom)


@pytest.mark.parametrize("pattern", NAME_KEYS)
def test_a_misspelled_name_exits_2_naming_the_key_and_the_known_names(
    pattern: str, tmp_path: Path, no_model: None
) -> None:
    recipe, override, key, bad = _misspelled(pattern)
    for extra in (["--print-config"], []):
        result = run_cli(["train", recipe, override, f"logging.run_dir={tmp_path}", *extra])
        assert result.exit_code == 2, result.output
        line = next(x for x in result.output.splitlines() if x.startswith("error:"))
        assert f"{key} = {bad!r}: must be " in line, line
        listed = line.split(": must be ", 1)[1]
        for name in known_names(pattern):
            assert (repr(name) if name == "" else name) in listed, (name, line)
    assert list(tmp_path.iterdir()) == []  # no run directory was made


def test_the_message_suggests_the_nearest_name(tmp_path: Path) -> None:
    result = run_cli(
        ["train", RECIPES / "gsm8k_tiny.yaml", "optimizer.schedule=cosinee", "--print-config"]
    )
    assert result.exit_code == 2
    assert (
        "optimizer.schedule = 'cosinee': must be one of: constant, cosine, linear; "
        "did you mean 'cosine'?"
    ) in result.output


def test_every_bad_name_is_reported_at_once() -> None:
    cfg = RecipeConfig(tasks=[TaskConfig(name="a", preset="verll")])
    cfg.algorithm.estimator, cfg.produce.mode = "grpoo", "later"
    with pytest.raises(ValueError) as err:
        check_config(cfg, "recipe r.yaml")
    lines = str(err.value).splitlines()
    assert lines[0] == "recipe r.yaml: 3 bad values:"
    assert [x.split(":")[0].strip() for x in lines[1:]] == [
        "produce.mode = 'later'",  # config/checks.py's names first, in schema order
        "algorithm.estimator = 'grpoo'",
        "tasks[0].preset = 'verll'",
    ]


def test_an_empty_name_is_allowed_only_where_it_stands_for_a_default() -> None:
    cfg = RecipeConfig()
    cfg.data.preset, cfg.rollout.vllm.dtype = "", ""  # gsm8k, model.dtype
    check_config(cfg)
    cfg.produce.group_filter = ""
    assert name_problems(cfg) == [
        "produce.group_filter = '': must be a known group filter: none, zero_variance"
    ]
