"""The shipped gsm8k_tiny files split by operation, for the multi-task demo recipe.

``python -m rltool.demo.tasks_split`` rewrites them byte for byte.
Design: docs/demo.md#the-multi-task-split
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from rltool.demo.data import GSM8K_TINY_DIR, Problem, read_jsonl, write_jsonl

OPERATIONS = {"+": "add", "-": "sub", "*": "mul"}  # operator -> task name
SPLITS = ("train", "test")
_OP_RE = re.compile(r"^\d+ ([+*-]) \d+ = ")


def operation_of(problem: Problem) -> str:
    """The task name of a problem's operation: ``"7 + 5 = 12..."`` -> ``"add"``."""
    m = _OP_RE.match(problem.answer)
    if m is None:
        raise ValueError(
            f"answer {problem.answer!r} does not start with '<a> <op> <b> = ' (op one of + - *)"
        )
    return OPERATIONS[m.group(1)]


def split_by_operation(problems: Sequence[Problem]) -> dict[str, list[Problem]]:
    """Task name -> its problems, original order kept; every task present (maybe empty)."""
    out: dict[str, list[Problem]] = {name: [] for name in OPERATIONS.values()}
    for p in problems:
        out[operation_of(p)].append(p)
    return out


def write_task_files(src_dir: Path = GSM8K_TINY_DIR, out_dir: Path | None = None) -> list[Path]:
    """Write ``<op>_<split>.jsonl`` for every operation and split; returns the paths."""
    out_dir = src_dir if out_dir is None else out_dir
    paths = []
    for split in SPLITS:
        for name, problems in split_by_operation(read_jsonl(src_dir / f"{split}.jsonl")).items():
            path = out_dir / f"{name}_{split}.jsonl"
            write_jsonl(problems, path)
            paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Split the shipped gsm8k_tiny files into one file per operation."
    )
    parser.add_argument("--src", type=Path, default=GSM8K_TINY_DIR, help="train/test.jsonl dir")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: --src)")
    args = parser.parse_args(argv)
    for path in write_task_files(args.src, args.out):
        print(path)


if __name__ == "__main__":
    main()
