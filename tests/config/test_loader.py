"""load_recipe: fragments, merge order, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltool.config.loader import PACKAGE_CONFIGS, find_recipes, load_recipe, recipe_to_yaml
from rltool.config.schema import RecipeConfig
from rltool.data.examples import load_examples


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with its own configs/ and a recipe under recipes/."""
    (tmp_path / "configs" / "optimizer").mkdir(parents=True)
    (tmp_path / "configs" / "trainer").mkdir()
    (tmp_path / "configs" / "optimizer" / "fast.yaml").write_text(
        "optimizer:\n  lr: 0.01\n  warmup_steps: 3\n"
    )
    (tmp_path / "configs" / "trainer" / "short.yaml").write_text(
        "trainer:\n  steps: 7\n  seed: 11\n"
    )
    (tmp_path / "recipes").mkdir()
    return tmp_path


def write_recipe(project: Path, body: str, name: str = "r.yaml") -> Path:
    path = project / "recipes" / name
    path.write_text(body)
    return path


def test_fragments_then_body_then_overrides(project: Path) -> None:
    recipe = write_recipe(
        project,
        "defaults: [optimizer/fast, trainer/short]\ntrainer:\n  steps: 9\n",
    )
    cfg = load_recipe(recipe, ["trainer.seed=5", "data.train_files=[a.jsonl,b.jsonl]"])
    assert isinstance(cfg, RecipeConfig)
    assert cfg.optimizer.lr == 0.01  # fragment
    assert cfg.optimizer.warmup_steps == 3  # fragment
    assert cfg.optimizer.weight_decay == 0.0  # schema default
    assert cfg.trainer.steps == 9  # body beats fragment
    assert cfg.trainer.seed == 5  # override beats fragment
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]


def test_override_types_and_null(project: Path) -> None:
    recipe = write_recipe(project, "trainer:\n  time_budget_s: 30\n")
    cfg = load_recipe(
        recipe,
        [
            "trainer.time_budget_s=null",
            "optimizer.lr=3e-4",
            "agent_loop.options.system_prompt=Be brief",
        ],
    )
    assert cfg.trainer.time_budget_s is None
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.agent_loop.options == {"system_prompt": "Be brief"}
    assert cfg.optimizer.betas == (0.9, 0.999)


def test_empty_section_keeps_defaults(project: Path) -> None:
    cfg = load_recipe(write_recipe(project, "trainer:\n  # steps: 3\n"))
    assert cfg.trainer.steps == RecipeConfig().trainer.steps


def test_fragment_defaults_nest_and_cycles_are_reported(project: Path) -> None:
    frag = project / "configs" / "trainer" / "nested.yaml"
    frag.write_text("defaults: [trainer/short]\ntrainer:\n  steps: 8\n")
    cfg = load_recipe(write_recipe(project, "defaults: [trainer/nested]\n"))
    assert (cfg.trainer.steps, cfg.trainer.seed) == (8, 11)
    frag.write_text("defaults: [trainer/nested]\n")
    with pytest.raises(ValueError, match="cycle"):
        load_recipe(write_recipe(project, "defaults: [trainer/nested]\n"))


def test_misspelled_key_in_recipe(project: Path) -> None:
    recipe = write_recipe(project, "optimizer:\n  lrr: 0.1\n")
    with pytest.raises(ValueError) as err:
        load_recipe(recipe)
    msg = str(err.value)
    assert "'optimizer.lrr'" in msg
    assert "did you mean 'optimizer.lr'" in msg
    assert str(recipe) in msg


def test_misspelled_key_in_fragment(project: Path) -> None:
    frag = project / "configs" / "optimizer" / "fast.yaml"
    frag.write_text("optimizer:\n  warmup_stpes: 3\n")
    with pytest.raises(ValueError) as err:
        load_recipe(write_recipe(project, "defaults: [optimizer/fast]\n"))
    msg = str(err.value)
    assert "'optimizer.warmup_stpes'" in msg
    assert "did you mean 'optimizer.warmup_steps'" in msg
    assert str(frag) in msg


def test_misspelled_key_in_override(project: Path) -> None:
    recipe = write_recipe(project, "trainer:\n  steps: 3\n")
    with pytest.raises(ValueError) as err:
        load_recipe(recipe, ["rollout.sampling.temprature=0.5"])
    msg = str(err.value)
    assert "command line" in msg
    assert "'rollout.sampling.temprature'" in msg
    assert "did you mean 'rollout.sampling.temperature'" in msg


def test_misspelled_section_and_key_in_wrong_section(project: Path) -> None:
    recipe = write_recipe(project, "")
    with pytest.raises(ValueError, match=r"'optimiser'; did you mean 'optimizer'"):
        load_recipe(recipe, ["optimiser.lr=1"])
    with pytest.raises(ValueError, match=r"'trainer.lr'; did you mean 'optimizer.lr'"):
        load_recipe(recipe, ["trainer.lr=1"])


def test_type_errors_name_key_and_expected_type(project: Path) -> None:
    recipe = write_recipe(project, "")
    with pytest.raises(ValueError, match=r"trainer\.steps expects int, got 'abc'"):
        load_recipe(recipe, ["trainer.steps=abc"])
    with pytest.raises(ValueError, match=r"algorithm\.dual_clip expects float or null"):
        load_recipe(recipe, ["algorithm.dual_clip=high"])
    with pytest.raises(ValueError, match=r"optimizer is a section"):
        load_recipe(recipe, ["optimizer=3"])
    bad = write_recipe(project, "trainer:\n  pack_max_length: lots\n", "bad.yaml")
    with pytest.raises(ValueError, match=r"bad\.yaml: trainer\.pack_max_length expects int"):
        load_recipe(bad)


def test_bad_override_syntax_and_missing_fragment(project: Path) -> None:
    recipe = write_recipe(project, "defaults: [optimizer/fsat]\n")
    with pytest.raises(
        ValueError, match=r"'optimizer/fsat' not found.*did you mean 'optimizer/fast'"
    ):
        load_recipe(recipe)
    recipe = write_recipe(project, "")
    with pytest.raises(ValueError, match="not of the form key=value"):
        load_recipe(recipe, ["trainer.steps"])
    with pytest.raises(ValueError, match="does not exist"):
        load_recipe(project / "recipes" / "missing.yaml")


def test_yaml_round_trip(project: Path) -> None:
    cfg = load_recipe(write_recipe(project, "defaults: [optimizer/fast]\n"), ["trainer.steps=4"])
    text = recipe_to_yaml(cfg)
    again = load_recipe(write_recipe(project, text, "again.yaml"))
    assert again == cfg


@pytest.mark.parametrize("recipe", find_recipes(), ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    assert isinstance(cfg, RecipeConfig)


def test_shipped_recipes_exist_and_gsm8k_tiny_values() -> None:
    names = {p.name for p in find_recipes()}
    assert "gsm8k_tiny.yaml" in names
    (path,) = [p for p in find_recipes() if p.name == "gsm8k_tiny.yaml"]
    cfg = load_recipe(path, ["trainer.steps=5"])
    assert cfg.trainer.steps == 5
    assert cfg.model.path == "builtin:tiny-gsm8k"
    assert cfg.algorithm.estimator == "grpo"
    assert (cfg.data.prompts_per_step, cfg.data.group_size) == (32, 8)
    assert cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.optimizer.warmup_steps > 0
    assert cfg.agent_loop.name == "gsm8k"


def test_algorithm_fragments_set_their_estimator(tmp_path: Path) -> None:
    # A recipe outside the repository still finds rltool's own configs/ (package data).
    for name, estimator in [("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("rloo", "rloo")]:
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"defaults: [algorithm/{name}, model/tiny, logging/default]\n")
        assert load_recipe(recipe).algorithm.estimator == estimator


@pytest.mark.parametrize("recipe", find_recipes(), ids=lambda p: p.name)
def test_a_copy_of_a_shipped_recipe_loads_and_reaches_its_data_anywhere(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the checkout (issue 19): the fragments come from the package's configs/ and
    every data file is reached by name (``builtin:``), never by a path from the checkout."""
    copy = tmp_path / recipe.name
    copy.write_text(recipe.read_text())
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe(copy)
    assert cfg == load_recipe(recipe)
    files = [*cfg.data.train_files, *cfg.data.eval_files]
    files += [f for task in cfg.tasks for f in (*task.train_files, *task.eval_files)]
    assert files and all(f.startswith("builtin:") for f in files), files
    for f in dict.fromkeys(files):
        assert load_examples([f]), f


def test_the_package_configs_are_found_last(project: Path) -> None:
    """A project's own configs/ wins over rltool's fragment of the same name."""
    (project / "configs" / "model").mkdir()
    (project / "configs" / "model" / "tiny.yaml").write_text("model:\n  path: /my/model\n")
    assert (PACKAGE_CONFIGS / "model" / "tiny.yaml").is_file()
    recipe = write_recipe(project, "defaults: [model/tiny, algorithm/rloo]\n")
    cfg = load_recipe(recipe)
    assert (cfg.model.path, cfg.algorithm.estimator) == ("/my/model", "rloo")
