"""Task specs from a recipe, their checks, and each task's data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from task_fakes import recipe_with, rows, task

from rltool.config.loader import load_recipe
from rltool.config.schema import AgentLoopConfig, RecipeConfig
from rltool.produce.task_specs import load_task_data, task_specs

REPO = Path(__file__).resolve().parents[2]


def test_single_task_spec_comes_from_agent_loop_and_data() -> None:
    r = RecipeConfig()
    (s,) = task_specs(r)
    assert (s.name, s.weight, s.loop.name) == ("gsm8k", 1.0, "gsm8k")
    assert s.train_files == ["builtin:gsm8k_tiny/train.jsonl"]
    assert s.eval_files == ["builtin:gsm8k_tiny/test.jsonl"]
    r.agent_loop.options["task_name"] = "arith"
    assert task_specs(r)[0].name == "arith"
    calc = load_recipe(REPO / "recipes" / "localhost_calculator.yaml")
    assert task_specs(calc)[0].name == "calculator"  # the recipe's options.task_name


def test_without_task_name_option_a_single_task_is_named_after_its_loop() -> None:
    for loop in ("localhost", "sandbox", "verl"):
        (s,) = task_specs(RecipeConfig(agent_loop=AgentLoopConfig(name=loop)))
        assert s.name == loop


def test_multitask_specs_keep_order_and_weights() -> None:
    specs = task_specs(recipe_with(task("a", 2.0), task("b", 0.0)))
    assert [(s.name, s.weight, s.where) for s in specs] == [
        ("a", 2.0, "tasks[0]"),
        ("b", 0.0, "tasks[1]"),
    ]


@pytest.mark.parametrize(
    ("recipe", "match"),
    [
        (recipe_with(task("a"), task("a")), r"tasks\[1\]\.name 'a' is also the name of tasks\[0\]"),
        (recipe_with(task("a"), task("")), r"tasks\[1\]\.name must be a non-empty"),
        (recipe_with(task("a/b")), r"without '/'"),
        (recipe_with(task("a", 0.0), task("b", 0.0)), r"every task weight is 0 \(a, b\)"),
        (
            recipe_with(task("a"), task("b"), adv={"c": 0.0}),
            r"algorithm\.task_adv_weight names task 'c'.*known tasks: a, b",
        ),
        (
            recipe_with(task("a", task_name="other")),
            r"tasks\[0\]\.agent_loop\.options\.task_name is 'other' but the task is named 'a'",
        ),
    ],
)
def test_bad_task_lists_name_the_recipe_key(recipe: RecipeConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        task_specs(recipe)


def test_empty_train_files_name_their_key() -> None:
    t = task("a")
    t.train_files = []
    with pytest.raises(ValueError, match=r"tasks\[0\]\.train_files is empty: task 'a'"):
        task_specs(recipe_with(t))
    single = RecipeConfig()
    single.data.train_files = []
    with pytest.raises(ValueError, match=r"data\.train_files is empty: task 'gsm8k'"):
        task_specs(single)
    single = RecipeConfig()
    single.algorithm.task_adv_weight = {"math": 0.0}
    with pytest.raises(ValueError, match=r"task_adv_weight names task 'math'.*known tasks: gsm8k"):
        task_specs(single)


def write_rows(path: Path, n: int, tag: str) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, tag)))
    return str(path)


def test_load_task_data_cuts_each_tasks_eval_rows(tmp_path: Path) -> None:
    a, b = task("a"), task("b")
    a.train_files = [write_rows(tmp_path / "a.jsonl", 5, "a")]
    b.train_files = [write_rows(tmp_path / "b.jsonl", 3, "b")]
    a.eval_files = [write_rows(tmp_path / "a_eval.jsonl", 4, "ae")]
    r = recipe_with(a, b)
    r.data.eval_limit = 2
    data = load_task_data(r)
    assert {k: (len(t), len(e)) for k, (t, e) in data.items()} == {"a": (5, 2), "b": (3, 0)}
    assert data["a"][1][1]["question"] == "ae1"
    r.data.eval_limit = 0  # 0 = all
    assert len(load_task_data(r)["a"][1]) == 4
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    b.train_files = [str(empty)]
    with pytest.raises(ValueError, match=r"task 'b': the training files .* hold no records"):
        load_task_data(r)


def test_each_task_maps_its_records_or_takes_the_data_mapping(tmp_path: Path) -> None:
    verl = tmp_path / "v.jsonl"
    verl.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "x",
                    "reward_model": {"ground_truth": "2"}}) + "\n"
    )  # fmt: skip
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    a, b = task("a"), task("b")
    a.train_files, b.train_files = [str(verl)], [str(plain)]
    a.preset = "verl"  # its own mapping
    r = recipe_with(a, b)
    r.data.prompt_key, r.data.answer_key = "q", "a"  # b sets none: data.*'s
    data = load_task_data(r)
    assert data["a"][0] == [
        {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "x",
         "reward_model": {"ground_truth": "2"}, "messages": [{"role": "user", "content": "1+1?"}],
         "answer": "2", "task": "x"}
    ]  # fmt: skip
    assert data["b"][0] == [{"q": "2+2?", "a": "4", "question": "2+2?", "answer": "4"}]
