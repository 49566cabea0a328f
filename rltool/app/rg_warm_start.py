"""The warm start of the reasoning-gym demo, ``builtin:tiny-rg-sums``: the demo model's
recipe (tokenizer, Qwen2 shape, SFT stopped by a greedy-accuracy probe) trained on
reasoning-gym's ``basic_arithmetic`` sums instead of the GSM8K-style word problems.

Its rows come from seeds far from the recipe's (``recipes/reasoning_gym_sums.yaml`` trains
on seeds [0, 5000) and holds out [5000, 5200)); the sums themselves repeat (121 facts), as
the demo's train and test share facts but not questions.
Design: docs/demo.md#the-reasoning-gym-warm-start
"""

from __future__ import annotations

from rltool.config.schema import ReasoningGymConfig
from rltool.data.reasoning_gym import generator_rows, import_reasoning_gym
from rltool.demo.data import Problem

# the generator config recipes/reasoning_gym_sums.yaml trains on: a + b with a, b in 0..10
SUMS_CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}
SFT_SEED = 1_000_000  # rows [SFT_SEED, SFT_SEED + 3300): train, then the build's test
SFT_ROWS, TEST_ROWS = 3000, 300


def sums_problems() -> tuple[list[Problem], list[Problem]]:
    """(train, test) problems of the warm start, each answered in the demo's form,
    ``"6 + 2 = 8\n#### 8"``: the working first teaches the tiny model to copy the operands
    (answering ``#### 8`` alone it stays near 0.05 greedy accuracy for 60 steps)."""
    cfg = ReasoningGymConfig(
        dataset="basic_arithmetic",
        size=SFT_ROWS,
        seed=SFT_SEED,
        eval_size=TEST_ROWS,
        config=dict(SUMS_CONFIG),
        answer_format="gsm8k",
    )
    where = "builtin:tiny-rg-sums"
    import_reasoning_gym(f"model.path {where} (its warm start is built from reasoning-gym rows)")
    train, test = (generator_rows(cfg, where, evaluation=e) for e in (False, True))
    return [_problem(r) for _, r in train], [_problem(r) for _, r in test]


def _problem(row: dict) -> Problem:
    expression = row["reasoning_gym"]["entry"]["metadata"]["expression"]
    return Problem(row["question"], f"{expression} = {row['answer']}\n#### {row['answer']}")
