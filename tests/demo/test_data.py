"""The shipped gsm8k_tiny files: regenerable byte for byte, disjoint splits, correct answers."""

from __future__ import annotations

import random
import re

from rltool.demo.data import (
    GSM8K_TINY_DIR,
    N_TEST,
    N_TRAIN,
    Problem,
    extract_answer,
    generate_split,
    main,
    read_jsonl,
    sample_problem,
)

ANSWER_RE = re.compile(r"^(\d) ([+*-]) (\d) = (\d+)\n#### (\d+)$")


def test_shipped_files_equal_a_fresh_generation(tmp_path):
    main(["--out", str(tmp_path)])
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (GSM8K_TINY_DIR / name).read_bytes(), name


def test_splits_have_their_sizes_and_share_no_question():
    train = read_jsonl(GSM8K_TINY_DIR / "train.jsonl")
    test = read_jsonl(GSM8K_TINY_DIR / "test.jsonl")
    assert (len(train), len(test)) == (N_TRAIN, N_TEST)
    train_q = {p.question for p in train}
    test_q = {p.question for p in test}
    assert len(train_q) == N_TRAIN and len(test_q) == N_TEST  # no duplicate inside a split
    assert not train_q & test_q


def test_every_answer_is_one_correct_single_digit_operation():
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    seen_ops = set()
    for p in read_jsonl(GSM8K_TINY_DIR / "train.jsonl") + read_jsonl(GSM8K_TINY_DIR / "test.jsonl"):
        m = ANSWER_RE.match(p.answer)
        assert m, p.answer
        a, op, b, result, final = m.groups()
        assert ops[op](int(a), int(b)) == int(result) == int(final) >= 1
        assert f"{a} " in p.question and f"{b} " in p.question  # both operands are stated
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


def test_generation_is_deterministic_in_the_seed():
    assert generate_split(7, 20, 5) == generate_split(7, 20, 5)
    assert generate_split(7, 20, 5) != generate_split(8, 20, 5)


def test_sample_problem_hand_checked():
    p = sample_problem(random.Random(0))
    assert isinstance(p, Problem)
    a, op, b = p.answer.split("\n")[0].split(" = ")[0].split()
    assert extract_answer(p.answer) == str(eval(f"{a}{op}{b}"))


def test_extract_answer():
    assert extract_answer("7 + 5 = 12\n#### 12") == "12"
    assert extract_answer("#### 1,234") == "1234"
    assert extract_answer("#### -3 then #### 4") == "4"
    assert extract_answer("7 + 5 = 12") is None
