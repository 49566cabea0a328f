"""Multi-task recipes: specs and their checks, loops named per task, data, sampling, metrics."""

from __future__ import annotations

import inspect
import json
import math
from collections import Counter
from pathlib import Path

import pytest

from rltool.agent_loops.base import get_agent_loop, known_agent_loops
from rltool.config.loader import load_recipe
from rltool.config.schema import AgentLoopConfig, RecipeConfig, SamplingConfig, TaskConfig
from rltool.demo.data import GSM8K_TINY_DIR, read_jsonl
from rltool.demo.tasks_split import main as split_main
from rltool.demo.tasks_split import operation_of, split_by_operation
from rltool.engines.base import Generation, RolloutEngine
from rltool.produce.sampler import PromptSampler
from rltool.produce.tasks import (
    TaskSampler,
    TaskSpec,
    build_task_loops,
    evaluate_tasks,
    load_task_data,
    per_task_metrics,
    task_specs,
)
from rltool.rollout.state import RolloutState, Status

REPO = Path(__file__).resolve().parents[2]
MULTITASK_RECIPE = REPO / "recipes" / "gsm8k_tiny_multitask.yaml"


def task(name: str, weight: float = 1.0, loop: str = "gsm8k", **options) -> TaskConfig:
    return TaskConfig(
        name=name,
        weight=weight,
        agent_loop=AgentLoopConfig(name=loop, options=dict(options)),
        train_files=[f"{name}.jsonl"],
        eval_files=[],
    )


def recipe_with(*tasks: TaskConfig, adv: dict[str, float] | None = None) -> RecipeConfig:
    r = RecipeConfig(tasks=list(tasks))
    r.algorithm.task_adv_weight = dict(adv or {})
    return r


def spec(name: str, weight: float = 1.0) -> TaskSpec:
    return TaskSpec(name, weight, AgentLoopConfig(), [f"{name}.jsonl"], [])


def rows(n: int, tag: str = "q") -> list[dict]:
    return [{"question": f"{tag}{i}", "answer": str(i)} for i in range(n)]


# --- specs ----------------------------------------------------------------------------


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


def test_every_builtin_loop_takes_a_task_name_with_a_default() -> None:
    # build_task_loops labels a task's samples through this argument
    for name in known_agent_loops():
        param = inspect.signature(get_agent_loop(name).__init__).parameters.get("task_name")
        assert param is not None and isinstance(param.default, str), name


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
        (recipe_with(task("a", -1.0)), r"tasks\[0\]\.weight of task 'a' must be finite and >= 0"),
        (recipe_with(task("a", math.nan)), r"must be finite"),
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


# --- loops ----------------------------------------------------------------------------


class EchoEngine(RolloutEngine):
    """Answers every prompt with ``reply`` + EOS; counts its calls."""

    def __init__(self, tokenizer, reply: str = "#### 12") -> None:
        self.tokenizer, self.reply, self.calls = tokenizer, reply, 0

    @property
    def model_step(self) -> int:
        return 0

    def sync_weights(self, model_step: int) -> None:
        pass

    def load_weights(self, state_dict, model_step: int) -> None:
        pass

    def generate(self, prompts, sampling):
        self.calls += 1
        ids = [*self.tokenizer.encode(self.reply, add_special_tokens=False)]
        ids.append(self.tokenizer.eos_token_id)
        return [
            Generation(
                token_ids=list(ids),
                logprobs=[-0.5] * len(ids),
                model_steps=[0] * len(ids),
                finish_reason="stop",
                text=self.reply,
            )
            for _ in prompts
        ]


@pytest.fixture(scope="module")
def tokenizer():
    from rltool.demo.tokenizer import train_demo_tokenizer

    return train_demo_tokenizer()


def test_each_task_loop_labels_its_samples_with_the_task_name(tokenizer) -> None:
    calc = {"agent": "rltool.agents.calculator:run", "judger": "rltool.agents.calculator:judge"}
    r = recipe_with(task("add"), task("mul"), task("calc", loop="localhost", **calc))
    loops = build_task_loops(r, EchoEngine(tokenizer), tokenizer)
    assert list(loops) == ["add", "mul", "calc"]
    assert [type(loop).name for loop in loops.values()] == ["gsm8k", "gsm8k", "localhost"]
    q = {"question": "Tom has 7 apples and buys 5 more. How many?", "answer": "#### 12"}
    for name, loop in loops.items():
        (group,) = loop.generate_groups([q], 2, [f"g-{name}"])
        assert [s.task_name for s in group] == [name, name]
        assert all(s.status == Status.COMPLETED and s.score == 1.0 for s in group), name
    # the single-task recipe: the loop's default name
    (only,) = build_task_loops(RecipeConfig(), EchoEngine(tokenizer), tokenizer).values()
    assert only.task_name == "gsm8k"


def test_bad_loop_options_name_the_task(tokenizer) -> None:
    r = recipe_with(task("a"), task("b", system_promt="hi"))
    with pytest.raises(ValueError, match=r"tasks\[1\] \(task 'b'\): agent_loop\.options"):
        build_task_loops(r, EchoEngine(tokenizer), tokenizer)


# --- data -----------------------------------------------------------------------------


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


# --- sampling -------------------------------------------------------------------------


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
    # a checkpoint from before multi-task holds one PromptSampler's state
    resumed = TaskSampler([spec("gsm8k")], {"gsm8k": rows(40)}, seed=3, shuffle=True)
    resumed.load_state_dict(ref.state_dict())
    assert [i for _, i, _ in resumed.take(9)] == ref.take(9)


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


# --- metrics --------------------------------------------------------------------------


def done(rid: str, task_name: str, reward: dict | None, finish: str = "stop") -> RolloutState:
    return RolloutState(
        rollout_id=rid,
        group_id=rid.split("/")[0],
        task_name=task_name,
        prompt_ids=[1, 2],
        reward=reward,
        finish_reason=finish,
        status=Status.COMPLETED if reward else Status.FAILED,
    )


def test_per_task_metrics_hand_worked() -> None:
    groups = [
        [
            done("g0/0", "add", {"score": 1.0, "correct": True}),
            done("g0/1", "add", {"score": 0.0, "correct": False}, "length"),
        ],
        [
            done("g1/0", "add", {"score": 1.0, "correct": True}),
            done("g1/1", "add", None, "length"),
        ],
        [done("g2/0", "calc", {"score": 0.5}), done("g2/1", "calc", {"score": 0.25})],
    ]
    m = per_task_metrics(groups)
    assert m == {
        "task/add/reward_mean": pytest.approx(2 / 3),
        "task/add/accuracy": pytest.approx(2 / 3),
        "task/add/samples": 4.0,
        "task/add/truncated_frac": 0.5,
        "task/calc/reward_mean": 0.375,  # no 'correct' in its rewards: no accuracy
        "task/calc/samples": 2.0,
        "task/calc/truncated_frac": 0.0,
    }
    assert math.isnan(per_task_metrics([[done("g/0", "x", None)]])["task/x/reward_mean"])
    assert per_task_metrics([]) == {}


def test_evaluate_tasks_weights_the_overall_figures_by_eval_rows() -> None:
    calls = []

    def evaluate_fn(name, task_rows, sampling):
        calls.append((name, len(task_rows), sampling))
        acc = {"add": 1.0, "mul": 0.0}[name]
        return {
            "eval/accuracy": acc,
            "eval/mean_response_len": 4.0 if name == "add" else 8.0,
            "eval/reward_errors": 1.0,
            "eval/n": float(len(task_rows)),
        }

    specs = [spec("add"), spec("mul"), spec("none")]
    greedy = SamplingConfig(temperature=0.0)
    m = evaluate_tasks(evaluate_fn, specs, {"add": rows(3), "mul": rows(1), "none": []}, greedy)
    assert calls == [("add", 3, greedy), ("mul", 1, greedy)]  # a task without rows is skipped
    assert m == {
        "eval/add/accuracy": 1.0,
        "eval/add/mean_response_len": 4.0,
        "eval/add/reward_errors": 1.0,
        "eval/add/n": 3.0,
        "eval/mul/accuracy": 0.0,
        "eval/mul/mean_response_len": 8.0,
        "eval/mul/reward_errors": 1.0,
        "eval/mul/n": 1.0,
        "eval/accuracy": 0.75,  # (3 * 1.0 + 1 * 0.0) / 4
        "eval/mean_response_len": 5.0,  # (3 * 4 + 1 * 8) / 4
        "eval/reward_errors": 2.0,  # summed
        "eval/n": 4.0,
    }
    with pytest.raises(ValueError, match="no task has evaluation rows"):
        evaluate_tasks(evaluate_fn, specs, {}, greedy)


# --- the shipped multi-task demo ------------------------------------------------------


def test_shipped_split_files_equal_a_fresh_split(tmp_path: Path) -> None:
    split_main(["--out", str(tmp_path)])
    for op in ("add", "sub", "mul"):
        for split in ("train", "test"):
            name = f"{op}_{split}.jsonl"
            assert (tmp_path / name).read_bytes() == (GSM8K_TINY_DIR / name).read_bytes(), name


def test_split_keeps_every_problem_once_in_its_operation() -> None:
    train = read_jsonl(GSM8K_TINY_DIR / "train.jsonl")
    parts = split_by_operation(train)
    assert sum(len(p) for p in parts.values()) == len(train)
    assert {op: {operation_of(p) for p in ps} for op, ps in parts.items()} == {
        "add": {"add"},
        "sub": {"sub"},
        "mul": {"mul"},
    }
    assert parts["add"][0].answer.startswith(tuple(f"{a} + " for a in range(10)))
    with pytest.raises(ValueError, match="does not start with"):
        split_by_operation([train[0].__class__("q", "#### 3")])


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
    assert all(operation_of_row(row) == t for t, _, row in taken)


def operation_of_row(row: dict) -> str:
    from rltool.demo.data import Problem

    return operation_of(Problem(row["question"], row["answer"]))


def test_a_loop_without_task_name_is_refused(tokenizer, monkeypatch) -> None:
    from rltool.agent_loops import base

    class Nameless(base.AgentLoop):
        name = "nameless"

        def __init__(self, engine, tokenizer, sampling, task_name_prefix: str = "x"):
            pass

        def generate_groups(self, tasks, n, group_ids, sampling=None):
            return []

    monkeypatch.setitem(base._REGISTRY, "nameless", Nameless)
    r = recipe_with(task("a", loop="nameless"))
    with pytest.raises(ValueError, match=r"tasks\[0\]: agent loop 'nameless' takes no task_name"):
        build_task_loops(r, EchoEngine(tokenizer), tokenizer)
    with pytest.raises(ValueError, match=r"agent loop 'nameless' has no default task name"):
        task_specs(RecipeConfig(agent_loop=AgentLoopConfig(name="nameless")))
