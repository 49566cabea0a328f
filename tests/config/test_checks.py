"""Range checks of numeric recipe keys: run by load_recipe, all bad keys named at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltool.config.checks import RANGES, Range, check_values, unchecked_numeric_keys
from rltool.config.loader import find_recipes, load_recipe
from rltool.config.schema import RecipeConfig, TaskConfig


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text("trainer:\n  steps: 3\n")
    return path


def test_every_numeric_key_of_the_schema_has_a_range() -> None:
    assert unchecked_numeric_keys() == []


def test_defaults_and_shipped_recipes_pass() -> None:
    assert check_values(RecipeConfig()) == []
    for path in find_recipes():
        load_recipe(path)  # raises if any value is out of range


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("algorithm.clip_low=5", "algorithm.clip_low = 5: must be in [0, 1)"),
        ("algorithm.clip_low=1.0", "algorithm.clip_low = 1: must be in [0, 1)"),
        ("data.group_size=0", "data.group_size = 0: must be >= 1"),
        ("data.group_size=-1", "data.group_size = -1: must be >= 1"),
        ("data.prompts_per_step=0", "data.prompts_per_step = 0: must be >= 1"),
        ("algorithm.dual_clip=1.0", "algorithm.dual_clip = 1: must be > 1 or null"),
        ("optimizer.lr=0", "optimizer.lr = 0: must be > 0"),
        ("optimizer.lr=inf", "optimizer.lr = inf: must be a finite number > 0"),
        ("optimizer.betas=[0.9,1.0]", "optimizer.betas[1] = 1: must be in [0, 1)"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p = 0: must be in (0, 1]"),
        ("rollout.eval_sampling.temperature=-0.5",
         "rollout.eval_sampling.temperature = -0.5: must be >= 0"),
        ("rollout.chunk_tokens=0", "rollout.chunk_tokens = 0: must be >= 1 or null"),
        ("trainer.pack_max_length=1", "trainer.pack_max_length = 1: must be >= 2"),
        ("trainer.time_budget_s=0", "trainer.time_budget_s = 0: must be > 0 or null"),
        ("trainer.seed=-1", "trainer.seed = -1: must be in [0, 4294967296)"),
        ("algorithm.sync_interval=0", "algorithm.sync_interval = 0: must be >= 1"),
        ("algorithm.max_staleness=-1", "algorithm.max_staleness = -1: must be >= 0 or null"),
        ("algorithm.task_adv_weight.math=-2", "algorithm.task_adv_weight.math = -2: must be >= 0"),
        ("distill.top_k=0", "distill.top_k = 0: must be >= 1"),
        ("produce.max_inflight_steps=0", "produce.max_inflight_steps = 0: must be >= 1"),
    ],
)  # fmt: skip
def test_a_bad_value_names_key_value_and_range(recipe: Path, override: str, line: str) -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(recipe, [override])
    assert str(err.value) == f"recipe {recipe}: {line}"


def test_boundaries_that_are_allowed(recipe: Path) -> None:
    cfg = load_recipe(
        recipe,
        [
            "algorithm.clip_low=0",
            "algorithm.dual_clip=null",
            "algorithm.max_staleness=0",
            "rollout.sampling.top_p=1",
            "rollout.sampling.temperature=0",
            "trainer.steps=0",
            "trainer.pack_max_length=2",
            "optimizer.grad_clip=0",
        ],
    )
    assert cfg.algorithm.clip_low == 0 and cfg.algorithm.dual_clip is None


def test_all_bad_keys_are_reported_together(recipe: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(recipe, ["data.group_size=0", "optimizer.eps=0", "algorithm.clip_low=-0.1"])
    assert str(err.value).splitlines() == [
        f"recipe {recipe}: 3 bad values:",
        "  data.group_size = 0: must be >= 1",
        "  algorithm.clip_low = -0.1: must be in [0, 1)",
        "  optimizer.eps = 0: must be > 0",
    ]


def test_task_items_are_named_by_index() -> None:
    cfg = RecipeConfig(tasks=[TaskConfig(name="a"), TaskConfig(name="b", weight=-1.0)])
    assert check_values(cfg) == ["tasks[1].weight = -1: must be >= 0"]


def test_sandbox_open_files_are_range_checked_inside_the_options() -> None:
    from rltool.config.schema import AgentLoopConfig

    def options(limits: dict) -> dict:
        return {"limits": limits, "check_limits": {"max_open_files": 64}}

    cfg = RecipeConfig(
        agent_loop=AgentLoopConfig(name="sandbox", options=options({"max_open_files": 4})),
        tasks=[TaskConfig(name="a"), TaskConfig(name="b")],
    )
    cfg.tasks[1].agent_loop.options = options({"max_open_files": 2**21, "cpu_seconds": 5})
    assert check_values(cfg) == [
        "agent_loop.options.limits.max_open_files = 4: must be in [16, 1048576]",
        "tasks[1].agent_loop.options.limits.max_open_files = 2097152: must be in [16, 1048576]",
    ]


def test_range_text_and_membership() -> None:
    r = Range(low=0, high=1, high_open=True)
    assert (r.allows(0), r.allows(0.999), r.allows(1), r.allows(None)) == (True, True, False, False)
    assert r.allows(float("nan")) is False
    assert Range(low=1, low_open=True, null=True).text() == "> 1 or null"
    assert RANGES["optimizer.min_lr_ratio"].text() == "in [0, 1]"


def test_train_exits_2_naming_the_key_before_loading_anything(tmp_path: Path) -> None:
    from cli_runner import run_cli

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k_tiny.yaml"
    for extra in ([], ["--print-config"]):
        result = run_cli(
            ["train", recipe, "algorithm.clip_low=5", f"logging.run_dir={tmp_path}", *extra],
        )
        assert result.exit_code == 2
        assert "algorithm.clip_low = 5: must be in [0, 1)" in result.output
    assert list(tmp_path.iterdir()) == []  # no run directory was made
