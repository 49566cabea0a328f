"""reasoning-gym rows as rltool tasks (``data.preset: reasoning_gym``): the mapping of a
generator's entries to task rows, the disjoint held-out seeds, extraction and the
generator's own ``score_answer`` worked by hand, and the gsm8k loop's rewards on them.

Runs only where reasoning-gym is installed (``bash scripts/envs_env.sh``, then
``.venv-envs/bin/python -m pytest tests/envs_env``); elsewhere the module is skipped.
"""

from __future__ import annotations

import pytest

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")

from fake_engines import FixedReplyEngine  # noqa: E402

from rltool.agent_loops.base import LoopContext  # noqa: E402
from rltool.agent_loops.gsm8k import GSM8KLoop  # noqa: E402
from rltool.config.schema import ReasoningGymConfig, SamplingConfig  # noqa: E402
from rltool.data.reasoning_gym import generator_rows, task_row  # noqa: E402
from rltool.demo.data import Problem  # noqa: E402
from rltool.demo.tokenizer import train_demo_tokenizer  # noqa: E402
from rltool.rewards.reasoning_gym import extract, reasoning_gym_reward  # noqa: E402
from rltool.rollout.contract import check_group, errors  # noqa: E402
from rltool.rollout.state import Status  # noqa: E402

SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}  # fmt: skip


def sums(**kw) -> ReasoningGymConfig:
    base = dict(dataset="basic_arithmetic", size=4, seed=10, eval_size=3, config=dict(SUMS))
    return ReasoningGymConfig(**{**base, **kw})


def test_an_entry_maps_to_a_task_row_holding_the_entry():
    entry = {"question": "Calculate 6 + 2.", "answer": "8", "metadata": {"expression": "6 + 2"}}
    row = task_row(entry, sums(answer_format="gsm8k"), seed=13)
    assert row == {
        "question": "Calculate 6 + 2.",
        "answer": "8",
        "reasoning_gym": {"dataset": "basic_arithmetic", "config": SUMS,
                          "answer_format": "gsm8k", "seed": 13, "entry": entry},
    }  # fmt: skip


def test_an_integer_answer_becomes_a_string():
    row = task_row({"question": "q", "answer": 8, "metadata": {}}, sums(), seed=0)
    assert row["answer"] == "8"


def test_row_i_of_a_split_is_the_generator_entry_drawn_with_seed_plus_i():
    cfg = sums()
    train = generator_rows(cfg, "data", evaluation=False)
    held_out = generator_rows(cfg, "data", evaluation=True)
    assert [w for w, _ in train] == [f"reasoning_gym:basic_arithmetic seed {s}" for s in
                                     (10, 11, 12, 13)]  # fmt: skip
    assert [w for w, _ in held_out] == [f"reasoning_gym:basic_arithmetic seed {s}" for s in
                                        (14, 15, 16)]  # fmt: skip
    for seed, (_, row) in zip((10, 11, 12, 13, 14, 15, 16), train + held_out, strict=True):
        entry = rg.create_dataset("basic_arithmetic", seed=seed, size=1, **SUMS)[0]
        kept = row["reasoning_gym"]["entry"]  # the same draw; its index is the split's
        assert kept["metadata"].pop("source_index") == seed - (10 if seed < 14 else 14)
        entry["metadata"].pop("source_index")
        assert kept == entry
        assert (row["question"], row["answer"]) == (entry["question"], entry["answer"])


def test_held_out_rows_are_disjoint_from_the_training_rows():
    """A large generator (3-4-digit sums of 3-6 terms): the held-out seeds [500, 600) draw
    no question of the training seeds [0, 500); seeds that overlapped would share rows."""
    big = {"min_terms": 3, "min_digits": 3}
    cfg = ReasoningGymConfig(dataset="chain_sum", size=500, seed=0, eval_size=100, config=big)
    train = {r["question"] for _, r in generator_rows(cfg, "data", evaluation=False)}
    held_out = {r["question"] for _, r in generator_rows(cfg, "data", evaluation=True)}
    assert len(held_out) == 100 and not train & held_out
    shifted = ReasoningGymConfig(dataset="chain_sum", size=500, seed=1, eval_size=100, config=big)
    again = {r["question"] for _, r in generator_rows(shifted, "data", evaluation=False)}
    assert len(train & again) == 499  # why the seed ranges, not the seeds, must differ


def test_bad_generator_names_and_configs_are_named():
    with pytest.raises(
        ValueError,
        match=r"data\.reasoning_gym\.dataset 'chain_sums' is not "
        r"a reasoning-gym generator; known: .*chain_sum",
    ):
        generator_rows(sums(dataset="chain_sums"), "data", evaluation=False)
    with pytest.raises(
        ValueError,
        match=r"tasks\[1\]\.reasoning_gym\.config is not a valid "
        r"basic_arithmetic config: .*bogus",
    ):
        generator_rows(sums(config={"bogus": 1}), "tasks[1]", evaluation=False)
    with pytest.raises(ValueError, match=r"data\.reasoning_gym\.config sets seed: set "):
        generator_rows(sums(config={**SUMS, "seed": 3}), "data", evaluation=False)


@pytest.mark.parametrize(
    ("text", "answer_format", "extracted"),
    [
        ("6 + 2 = 8\n#### 8", "gsm8k", "8"),
        ("#### 18\nmore", "gsm8k", "18"),
        ("#### 1\n#### 8 ", "gsm8k", "8"),  # the last one
        ("8", "gsm8k", None),
        ("####", "gsm8k", None),
        ("<answer>8</answer>", "answer_tag", "8"),
        ("think <answer> 1 </answer> then <answer>\n 18 \n</answer>", "answer_tag", "18"),
        ("#### 8", "answer_tag", None),
        ("<answer> </answer>", "answer_tag", None),
    ],
)
def test_extraction_follows_the_answer_format(text, answer_format, extracted):
    assert extract(text, answer_format) == extracted


def rg_fields(answer: str, answer_format: str = "gsm8k") -> dict:
    entry = {"question": "Calculate 6 + 2.", "answer": answer, "metadata": {}}
    return task_row(entry, sums(answer_format=answer_format), seed=0)["reasoning_gym"]


@pytest.mark.parametrize(
    ("text", "score", "extracted"),
    [
        ("#### 8", 1.0, "8"),
        ("#### 18", 0.5, "18"),  # basic_arithmetic's partial credit: len("8") / len("18")
        ("#### 7", 0.0, "7"),
        ("6 + 2 = 8", 0.0, None),  # no "####": nothing extracted, nothing scored
        ("#### the answer is 8", 1 / 15, "the answer is 8"),  # why extraction comes first
    ],
)
def test_score_answer_on_the_extracted_answer(text, score, extracted):
    result = reasoning_gym_reward(text, rg_fields("8"))
    assert (result.status, result.extracted) == ("ok", extracted)
    assert result.score == pytest.approx(score)


def test_a_scorer_that_raises_is_an_error_result_not_zero():
    fields = rg_fields("8")
    fields["entry"] = {"question": "q", "metadata": {}}  # no "answer": score_answer raises
    result = reasoning_gym_reward("#### 8", fields)
    assert result.status == "error" and result.score is None
    assert result.error == ("KeyError: reasoning-gym basic_arithmetic score_answer failed: "
                            "'answer'")  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer([Problem("Calculate 6 + 2.", "#### 8")])


def loop_with(tokenizer, texts) -> GSM8KLoop:
    engine = FixedReplyEngine(tokenizer, texts)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), task_name="sums")
    return GSM8KLoop(ctx)


def test_the_gsm8k_loop_scores_generator_rows_and_keeps_the_raw_score(tokenizer):
    _, row = generator_rows(sums(answer_format="gsm8k"), "data", evaluation=False)[0]
    truth = row["answer"]
    loop = loop_with(tokenizer, [f"#### {truth}", f"#### 1{truth}", "no answer"])
    (group,) = loop.generate_groups([row], 3, ["g0"])
    assert errors(check_group(group)) == []
    assert [s.status for s in group] == [Status.COMPLETED] * 3
    partial = len(truth) / (len(truth) + 1)
    assert [s.reward["score"] for s in group] == pytest.approx([1.0, partial, 0.0])
    assert [s.reward["correct"] for s in group] == [True, False, False]
    assert [s.reward["extra"] for s in group] == [
        {"raw_score": 1.0, "extracted": truth},
        {"raw_score": pytest.approx(partial), "extracted": f"1{truth}"},
        {"raw_score": 0.0, "extracted": None},
    ]
    assert group[0].extra["ground_truth"] == truth


def test_a_raising_scorer_fails_the_sample_with_its_reason_counted(tokenizer):
    _, row = generator_rows(sums(), "data", evaluation=False)[0]
    del row["reasoning_gym"]["entry"]["answer"]
    loop = loop_with(tokenizer, "<answer>8</answer>")
    (group,) = loop.generate_groups([row], 2, ["g0"])
    assert [s.status for s in group] == [Status.FAILED] * 2
    assert group[0].error.startswith("reward: KeyError: reasoning-gym basic_arithmetic ")
    assert loop.pop_metrics()["reward/errors"] == 2.0


def test_evaluation_accuracy_counts_exact_answers_only(tokenizer):
    rows = [r for _, r in generator_rows(sums(), "data", evaluation=True)]
    texts = [f"<answer>{rows[0]['answer']}</answer>", f"<answer>1{rows[1]['answer']}</answer>",
             "<answer>x</answer>"]  # fmt: skip
    metrics = loop_with(tokenizer, texts).evaluate(rows, SamplingConfig(temperature=0.0))
    assert metrics["eval/accuracy"] == pytest.approx(1 / 3)
    assert metrics["eval/n"] == 3.0


def test_the_warm_start_rows_answer_with_their_working_from_far_off_seeds():
    from pathlib import Path

    from rltool.app.rg_warm_start import SFT_ROWS, SFT_SEED, TEST_ROWS, sums_problems
    from rltool.config.loader import load_recipe
    from rltool.data.reasoning_gym import split_seeds

    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "reasoning_gym_sums.yaml")
    train, held_out = split_seeds(recipe.data.reasoning_gym, "data")
    warm = range(SFT_SEED, SFT_SEED + SFT_ROWS + TEST_ROWS)
    assert train.stop <= warm.start and held_out.stop <= warm.start
    assert recipe.data.reasoning_gym.config == {**SUMS}
    sft_train, sft_test = sums_problems()
    assert (len(sft_train), len(sft_test)) == (SFT_ROWS, TEST_ROWS)
    entry = rg.create_dataset("basic_arithmetic", seed=SFT_SEED, size=1, **SUMS)[0]
    expression, answer = entry["metadata"]["expression"], entry["answer"]
    assert sft_train[0] == Problem(entry["question"], f"{expression} = {answer}\n#### {answer}")
