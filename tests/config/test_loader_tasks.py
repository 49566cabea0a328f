"""load_recipe on a `tasks:` list: each item checked like a section, errors name `tasks[i].key`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltool.config.loader import load_recipe

TASKS = """\
tasks:
  - name: add
    weight: 2
    agent_loop: {name: gsm8k, options: {system_prompt: be brief}}
    train_files: [a.jsonl]
  - name: mul
    train_files: [m.jsonl]
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(TASKS)
    return path


def test_items_get_schema_defaults_and_overrides_edit_one_item(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    add, mul = cfg.tasks
    assert (add.name, add.weight, add.agent_loop.options) == (
        "add",
        2.0,
        {"system_prompt": "be brief"},
    )
    assert (mul.name, mul.weight, mul.agent_loop.name, mul.eval_files) == ("mul", 1.0, "gsm8k", [])
    cfg = load_recipe(recipe, ["tasks.1.weight=3", "tasks.0.agent_loop.name=localhost"])
    assert [(t.name, t.weight, t.agent_loop.name) for t in cfg.tasks] == [
        ("add", 2.0, "localhost"),
        ("mul", 3.0, "gsm8k"),
    ]
    assert cfg.tasks[0].agent_loop.options == {"system_prompt": "be brief"}  # merged, not replaced


def test_misspelled_key_in_an_item_names_the_item(recipe: Path) -> None:
    recipe.write_text(TASKS.replace("weight: 2", "wieght: 2"))
    with pytest.raises(ValueError) as err:
        load_recipe(recipe)
    msg = str(err.value)
    assert f"{recipe}: unknown key 'tasks[0].wieght'; did you mean 'tasks[0].weight'?" in msg
    assert "valid keys in 'tasks[0]': name, weight, agent_loop, train_files, eval_files" in msg


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "tasks.1.wieght=3",
            r"'tasks\[1\]\.wieght'; did you mean 'tasks\[1\]\.weight'",
        ),
        ("tasks.0.agent_loop.nme=x", r"did you mean 'tasks\[0\]\.agent_loop\.name'"),
        ("tasks.0.lr=1", r"unknown key 'tasks\[0\]\.lr' \(valid keys"),  # no other section's key
        ("tasks.0.weight=abc", r"tasks\[0\]\.weight expects float, got 'abc'"),
        (
            "tasks.2.weight=1",
            r"tasks\.2: no such item; the recipe lists 2 tasks \(indices 0..1\)",
        ),
        ("tasks=3", r"tasks takes a list of TaskConfig mappings, got 3"),
        ("tasks=[1]", r"tasks\[0\] must be a mapping of TaskConfig keys, got 1"),
        (
            "tasks=[{name: a, wieght: 2}]",
            r"'tasks\[0\]\.wieght'; did you mean 'tasks\[0\]\.weight'",
        ),
    ],
)
def test_bad_overrides_name_the_item(recipe: Path, override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_recipe(recipe, [override])


def test_a_yaml_list_replaces_the_whole_list(recipe: Path) -> None:
    cfg = load_recipe(recipe, ["tasks=[{name: sub, train_files: [s.jsonl]}]"])
    assert [(t.name, t.weight, t.train_files) for t in cfg.tasks] == [("sub", 1.0, ["s.jsonl"])]
