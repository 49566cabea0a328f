"""build_task_loops: one agent loop per task, its samples labelled with the task's name."""

from __future__ import annotations

import pytest
from fake_engines import FixedReplyEngine
from task_fakes import recipe_with, task

from rltool.config.schema import RecipeConfig
from rltool.produce.task_loops import build_task_loops
from rltool.rollout.state import Status


@pytest.fixture(scope="module")
def tokenizer():
    from rltool.demo.tokenizer import train_demo_tokenizer

    return train_demo_tokenizer()


def test_each_task_loop_labels_its_samples_with_the_task_name(tokenizer) -> None:
    calc = {"agent": "rltool.agents.calculator:run", "judger": "rltool.agents.calculator:judge"}
    r = recipe_with(task("add"), task("mul"), task("calc", loop="localhost", **calc))
    loops = build_task_loops(r, FixedReplyEngine(tokenizer, "#### 12"), tokenizer)
    assert list(loops) == ["add", "mul", "calc"]
    assert [type(loop).name for loop in loops.values()] == ["gsm8k", "gsm8k", "localhost"]
    q = {"question": "Tom has 7 apples and buys 5 more. How many?", "answer": "#### 12"}
    for name, loop in loops.items():
        (group,) = loop.generate_groups([q], 2, [f"g-{name}"])
        assert [s.task_name for s in group] == [name, name]
        assert all(s.status == Status.COMPLETED and s.score == 1.0 for s in group), name
    # the single-task recipe: the loop's name
    (only,) = build_task_loops(
        RecipeConfig(), FixedReplyEngine(tokenizer, "#### 12"), tokenizer
    ).values()
    assert only.task_name == "gsm8k"


def test_the_task_name_option_names_the_task_and_is_not_a_loop_option(tokenizer) -> None:
    r = RecipeConfig()
    r.agent_loop.options = {"task_name": "arith", "system_prompt": "be brief"}
    loops = build_task_loops(r, FixedReplyEngine(tokenizer, "#### 12"), tokenizer)
    assert list(loops) == ["arith"]
    assert (loops["arith"].task_name, loops["arith"].system_prompt) == ("arith", "be brief")
    listed = recipe_with(task("add", task_name="add"))  # the same name: allowed
    assert (
        build_task_loops(listed, FixedReplyEngine(tokenizer, "#### 12"), tokenizer)["add"].task_name
        == "add"
    )


def test_the_loops_share_the_recipes_engine_tokenizer_and_sampling(tokenizer) -> None:
    r = recipe_with(task("add"), task("mul"))
    r.rollout.sampling.max_new_tokens = 7
    engine = FixedReplyEngine(tokenizer, "#### 12")
    add, mul = build_task_loops(r, engine, tokenizer).values()
    assert add.engine is engine and mul.engine is engine
    assert add.tokenizer is tokenizer
    assert add.sampling == r.rollout.sampling and add.sampling.max_new_tokens == 7


def test_bad_loop_options_name_the_task(tokenizer) -> None:
    r = recipe_with(task("a"), task("b", system_promt="hi"))
    with pytest.raises(
        ValueError,
        match=r"^tasks\[1\] \(task 'b'\): agent_loop\.options\.system_promt: agent loop 'gsm8k' "
        r"has no such option; its options: system_prompt$",
    ):
        build_task_loops(r, FixedReplyEngine(tokenizer, "#### 12"), tokenizer)
    single = RecipeConfig()
    single.agent_loop.options = {"system_promt": "hi"}
    with pytest.raises(ValueError, match=r"^agent_loop\.options\.system_promt: agent loop"):
        build_task_loops(single, FixedReplyEngine(tokenizer, "#### 12"), tokenizer)
