"""The multi-task demo's data: GSM8K-tiny split by arithmetic operation."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltool.demo.data import GSM8K_TINY_DIR, read_jsonl
from rltool.demo.tasks_split import main as split_main
from rltool.demo.tasks_split import operation_of, split_by_operation


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
