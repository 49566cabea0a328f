"""A reasoning-gym recipe refused before the model loads: the package missing (named with
its install command), a loop that cannot score the rows, overlapping seed ranges. These run
without reasoning-gym installed (the package is hidden where it is)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import rltool.app.run as run_mod
from rltool.app.run import build_run
from rltool.config.loader import load_recipe
from rltool.config.schema import ReasoningGymConfig
from rltool.data.reasoning_gym import split_seeds
from rltool.produce.task_specs import task_specs

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "reasoning_gym_sums.yaml"


@pytest.fixture
def no_model(monkeypatch):
    """A run that gets as far as building or loading a model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built or loaded")

    monkeypatch.setattr(run_mod, "ensure_builtin_models", refuse)
    monkeypatch.setattr(run_mod, "load_model_and_tokenizer", refuse)


def test_missing_package_is_named_with_its_install_before_the_model_loads(monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    with pytest.raises(ValueError) as info:
        build_run(load_recipe(RECIPE))
    assert str(info.value) == (
        "preflight: 1 problem(s) to fix before the model loads:\n"
        "  - data.preset reasoning_gym needs the reasoning-gym package, which is not "
        "installed; install the extra: pip install 'rltool[reasoning-gym]' (or build the "
        "environments venv: bash scripts/envs_env.sh)"
    )


def test_missing_package_in_a_task_names_the_task(monkeypatch, no_model):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    recipe = load_recipe(
        RECIPE,
        [
            "tasks=[{name: sums, agent_loop: {name: gsm8k}, preset: reasoning_gym, "
            "reasoning_gym: {dataset: chain_sum}}]"
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"tasks\[0\] \(task 'sums'\): tasks\[0\]\.preset "
        r"reasoning_gym needs the reasoning-gym package.*rltool\[reasoning-gym\]",
    ):
        build_run(recipe)


def test_a_loop_that_cannot_score_generator_rows_is_refused():
    recipe = load_recipe(RECIPE, ["agent_loop.name=localhost"])
    with pytest.raises(
        ValueError,
        match=r"data\.preset reasoning_gym needs agent_loop\.name "
        r"gsm8k .*got 'localhost'",
    ):
        task_specs(recipe)


def test_data_files_are_not_read_beside_a_generator():
    spec = task_specs(load_recipe(RECIPE))[0]
    assert (spec.train_files, spec.eval_files) == ([], [])
    assert spec.generator is not None and spec.generator.dataset == "basic_arithmetic"


def test_held_out_seeds_follow_the_training_seeds_by_default():
    train, held_out = split_seeds(ReasoningGymConfig(size=5000, seed=0, eval_size=200), "data")
    assert (train, held_out) == (range(0, 5000), range(5000, 5200))


@pytest.mark.parametrize("eval_seed", [0, 4999, 4801, 100])
def test_overlapping_seed_ranges_are_refused(eval_seed):
    cfg = ReasoningGymConfig(size=5000, seed=0, eval_size=200, eval_seed=eval_seed)
    with pytest.raises(
        ValueError,
        match=r"data\.reasoning_gym: the held-out seeds .* overlap "
        r"the training seeds \[0, 5000\).*set eval_seed >= 5000",
    ):
        split_seeds(cfg, "data")


@pytest.mark.parametrize("eval_seed", [5000, 9000])
def test_disjoint_seed_ranges_pass(eval_seed):
    cfg = ReasoningGymConfig(size=5000, seed=0, eval_size=200, eval_seed=eval_seed)
    assert split_seeds(cfg, "data")[1] == range(eval_seed, eval_seed + 200)


def test_a_range_before_the_training_seeds_is_disjoint():
    cfg = ReasoningGymConfig(size=100, seed=1000, eval_size=200, eval_seed=800)
    assert split_seeds(cfg, "data") == (range(1000, 1100), range(800, 1000))


def test_bad_values_are_named_on_load():
    with pytest.raises(ValueError) as info:
        load_recipe(RECIPE, ["data.reasoning_gym.size=0", "data.reasoning_gym.answer_format=tag"])
    text = str(info.value)
    assert "data.reasoning_gym.size = 0: must be >= 1" in text
    assert "data.reasoning_gym.answer_format = 'tag': must be one of: answer_tag, gsm8k" in text
