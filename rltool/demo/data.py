"""Tiny grade-school arithmetic word problems in GSM8K format.

``python -m rltool.demo.data`` rewrites the shipped files byte for byte.
Design (why the table is this small): docs/demo.md#the-demo-data
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rltool.builtin import DATA_DIR

GSM8K_TINY_DIR = DATA_DIR / "gsm8k_tiny"
# Six small Python coding tasks for the ``sandbox`` loop (``builtin:coding_tasks/tasks.jsonl``,
# written by hand). Each record: ``question`` (the prompt), ``answer`` (a reference solution,
# never shown to the agent), ``solution_file``, seed ``files``, and a hidden check (``check``
# argv, ``check_files`` bound read-only at /check) that imports the solution from /work and
# tests it with plain asserts: exit 0 means solved. The tiny demo model will not solve them;
# they exercise the data path.
CODING_TASKS_FILE = DATA_DIR / "coding_tasks" / "tasks.jsonl"
N_TRAIN = 3000
N_TEST = 300

NAMES = (
    "Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe",
    "Jack", "Nora", "Omar", "Ella", "Ravi", "Lucy", "Ivan", "Sara", "Hugo", "Jade",
)  # fmt: skip
OBJECTS = (
    "apples", "pencils", "marbles", "cookies", "stickers", "books", "cards", "eggs",
    "shells", "coins", "balloons", "stamps", "toys", "flowers", "candies", "cups",
)  # fmt: skip

# (operator, phrasing); {n} and {m} are names, {o} an object, {a} {b} the operands.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("+", "{n} has {a} {o} and buys {b} more. How many {o} does {n} have?"),
    ("+", "{n} picked {a} {o} and {m} picked {b} {o}. How many {o} did they pick in total?"),
    ("+", "There are {a} {o} in a box. {n} puts {b} more in. How many {o} are in the box now?"),
    ("-", "{n} has {a} {o} and gives {b} to {m}. How many {o} does {n} have left?"),
    ("-", "There were {a} {o} on the table. {n} took {b} of them. How many {o} are left?"),
    ("*", "{n} has {a} bags with {b} {o} in each bag. How many {o} does {n} have?"),
    ("*", "{n} buys {a} packs of {o}. Each pack holds {b} {o}. How many {o} does {n} buy?"),
)

_ANSWER_RE = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    answer: str  # "<reasoning>\n#### <number>"

    def to_json(self) -> str:
        return json.dumps({"question": self.question, "answer": self.answer})


def _operands(op: str, rng: random.Random) -> tuple[int, int]:
    if op == "-":  # keep the difference at least 1: "how many are left" never asks for 0
        a = rng.randint(2, 6)
        return a, rng.randint(1, a - 1)
    if op == "*":
        return rng.randint(2, 5), rng.randint(2, 5)
    return rng.randint(1, 5), rng.randint(1, 5)


def _solve(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def sample_problem(rng: random.Random) -> Problem:
    """One random problem; all randomness comes from ``rng``."""
    op, template = TEMPLATES[rng.randrange(len(TEMPLATES))]
    a, b = _operands(op, rng)
    name, other = rng.sample(NAMES, 2)
    obj = OBJECTS[rng.randrange(len(OBJECTS))]
    question = template.format(n=name, m=other, o=obj, a=a, b=b)
    result = _solve(op, a, b)
    return Problem(question, f"{a} {op} {b} = {result}\n#### {result}")


def generate_split(
    seed: int = 0, n_train: int = N_TRAIN, n_test: int = N_TEST
) -> tuple[list[Problem], list[Problem]]:
    """``n_train`` + ``n_test`` problems, all questions distinct, deterministic in ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[Problem] = []
    while len(problems) < n_train + n_test:
        p = sample_problem(rng)
        if p.question not in seen:  # dedupe by question: no problem can land in both splits
            seen.add(p.question)
            problems.append(p)
    return problems[:n_train], problems[n_train:]


def prompt_messages(question: str) -> list[dict[str, str]]:
    """The chat the demo model was warm-started on: the bare question as one user turn."""
    return [{"role": "user", "content": question}]


def extract_answer(text: str) -> str | None:
    """The number after the last ``####`` (commas removed), or None if there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def write_jsonl(problems: Sequence[Problem], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(p.to_json() + "\n" for p in problems)


def read_jsonl(path: Path) -> list[Problem]:
    problems = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            row = json.loads(line)
            if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
                raise ValueError(
                    f"{path}:{lineno}: expected an object with 'question' and 'answer'"
                )
            problems.append(Problem(row["question"], row["answer"]))
    return problems


def write_gsm8k_tiny(out_dir: Path = GSM8K_TINY_DIR, seed: int = 0) -> tuple[Path, Path]:
    """Write train.jsonl and test.jsonl into ``out_dir``; returns their paths."""
    train, test = generate_split(seed)
    paths = out_dir / "train.jsonl", out_dir / "test.jsonl"
    write_jsonl(train, paths[0])
    write_jsonl(test, paths[1])
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the shipped gsm8k_tiny data files.")
    parser.add_argument("--out", type=Path, default=GSM8K_TINY_DIR, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_gsm8k_tiny(args.out, args.seed):
        print(path)


if __name__ == "__main__":
    main()
