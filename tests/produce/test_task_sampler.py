"""TaskSampler: each step's prompts split between tasks by weight, resumable exactly."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from task_fakes import rows, spec

from rltool.config.loader import load_recipe
from rltool.demo.data import Problem
from rltool.demo.tasks_split import operation_of
from rltool.produce.sampler import PromptSampler
from rltool.produce.task_sampler import TaskSampler
from rltool.produce.task_specs import load_task_data, task_specs

MULTITASK_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k_tiny_multitask.yaml"


def test_take_allocates_groups_by_weight() -> None:
    specs = [spec("add", 2.0), spec("sub"), spec("mul")]
    sampler = TaskSampler(specs, {s.name: rows(50, s.name) for s in specs}, seed=0, shuffle=True)
    # quotas 3.5, 1.75, 1.75 -> floors 3, 1, 1; two left to the largest remainders (sub, mul)
    taken = sampler.take(7)
    assert Counter(t for t, _, _ in taken) == {"add": 3, "sub": 2, "mul": 2}
    assert [t for t, _, _ in taken] == ["add"] * 3 + ["sub"] * 2 + ["mul"] * 2
    assert all(row["question"] == f"{t}{i}" for t, i, row in taken)
    assert Counter(t for t, _, _ in sampler.take(32)) == {"add": 16, "sub": 8, "mul": 8}


def test_zero_weight_task_is_never_drawn() -> None:
    specs = [spec("a"), spec("b", 0.0)]
    sampler = TaskSampler(specs, {"a": rows(3), "b": rows(3)}, seed=0, shuffle=False)
    assert [(t, i) for t, i, _ in sampler.take(4)] == [("a", 0), ("a", 1), ("a", 2), ("a", 0)]


def test_single_task_draws_what_prompt_sampler_drew() -> None:
    sampler = TaskSampler([spec("gsm8k")], {"gsm8k": rows(40)}, seed=3, shuffle=True)
    ref = PromptSampler(40, 3, shuffle=True)
    for n in (7, 30, 11):  # crosses an epoch
        assert [i for _, i, _ in sampler.take(n)] == ref.take(n)


def test_tasks_keep_their_prompt_order_when_listed_differently() -> None:
    data = {"a": rows(20, "a"), "b": rows(20, "b")}
    ab = TaskSampler([spec("a"), spec("b")], data, seed=0, shuffle=True).take(10)
    ba = TaskSampler([spec("b"), spec("a")], data, seed=0, shuffle=True).take(10)
    assert sorted(ab) == sorted(ba)
    a_order = [i for t, i, _ in ab if t == "a"]
    b_order = [i for t, i, _ in ab if t == "b"]
    assert a_order != b_order  # each task has its own seed


def test_resume_continues_exactly() -> None:
    specs = [spec("a", 1.0), spec("b", 3.0)]
    data = {"a": rows(7), "b": rows(11)}
    straight = TaskSampler(specs, data, seed=5, shuffle=True)
    first = [straight.take(6) for _ in range(3)]
    rest = [straight.take(6) for _ in range(4)]  # crosses epochs of both tasks

    interrupted = TaskSampler(specs, data, seed=5, shuffle=True)
    assert [interrupted.take(6) for _ in range(3)] == first
    state = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint stores it
    resumed = TaskSampler(specs, data, seed=5, shuffle=True)
    resumed.load_state_dict(state)
    assert [resumed.take(6) for _ in range(4)] == rest


def test_resume_with_other_tasks_or_data_is_refused() -> None:
    data = {"a": rows(7), "b": rows(11)}
    state = TaskSampler([spec("a"), spec("b")], data, 0, True).state_dict()
    other = TaskSampler([spec("a"), spec("c")], {"a": rows(7), "c": rows(3)}, 0, True)
    with pytest.raises(ValueError, match=r"tasks \['a', 'b'\], the recipe now has \['a', 'c'\]"):
        other.load_state_dict(state)
    grown = TaskSampler([spec("a"), spec("b")], {"a": rows(8), "b": rows(11)}, 0, True)
    with pytest.raises(ValueError, match=r"task 'a': checkpoint was taken on 7 training"):
        grown.load_state_dict(state)


def test_missing_or_empty_rows_are_refused() -> None:
    with pytest.raises(ValueError, match=r"no training rows given for task\(s\) \['b'\]"):
        TaskSampler([spec("a"), spec("b")], {"a": rows(2)}, 0, True)
    with pytest.raises(ValueError, match=r"task 'b' has no training rows"):
        TaskSampler([spec("a"), spec("b")], {"a": rows(2), "b": []}, 0, True)


def test_multitask_recipe_builds_three_weighted_tasks() -> None:
    r = load_recipe(MULTITASK_RECIPE)
    specs = task_specs(r)
    assert [(s.name, s.weight) for s in specs] == [("add", 2.0), ("sub", 1.0), ("mul", 1.0)]
    data = load_task_data(r)
    assert {k: (len(t), len(e)) for k, (t, e) in data.items()} == {
        "add": (1279, 100),
        "sub": (842, 82),
        "mul": (879, 97),
    }
    sampler = TaskSampler(specs, {k: v[0] for k, v in data.items()}, r.trainer.seed, True)
    taken = sampler.take(r.data.prompts_per_step)
    assert Counter(t for t, _, _ in taken) == {"add": 16, "sub": 8, "mul": 8}
    assert all(operation_of(Problem(row["question"], row["answer"])) == t for t, _, row in taken)
