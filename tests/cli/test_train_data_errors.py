"""`rltool train` on data the model cannot take: prompts too long for its context
(``data.too_long``) and task files that are not UTF-8, decided before its first step."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from short_runs import short_gsm8k_args

LONG = "1 + " * 100  # 308 prompt tokens with the demo chat template


def write(path: Path, questions: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"question": q, "answer": "#### 2"}) + "\n" for q in questions)
    )
    return path


def questions_41() -> list[str]:
    questions = [f"What is {i % 10} + 1?" for i in range(41)]
    questions[17] = LONG  # line 18
    return questions


def test_one_prompt_in_41_too_long_is_skipped_and_the_run_finishes(tiny_checkpoint, tmp_path):
    train = write(tmp_path / "train.jsonl", questions_41())
    args = short_gsm8k_args(
        tiny_checkpoint,
        tmp_path / "runs",
        1,
        f"data.train_files=[{train}]",
        f"data.eval_files=[{train}]",
        "data.shuffle=false",
        "data.prompts_per_step=41",  # every prompt is drawn in the one step
    )  # pack_max_length 256, 4 new tokens: 308 + 4 cannot train
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert "data.too_long=skip" in result.output
    assert f"{train}:18 (308 tokens)" in result.output
    lines = [
        json.loads(x) for x in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    (step,) = [x for x in lines if x["kind"] == "train"]
    assert step["data/too_long_skipped"] == 1.0
    assert step["data/too_long_skipped_eval"] == 0.0  # 308 + 4 fits the context of 512
    assert step["data/training_samples"] + 2 * step["data/skipped_groups"] == 2 * 41


def test_too_long_error_exits_2_naming_file_and_row(tiny_checkpoint, tmp_path):
    train = write(tmp_path / "train.jsonl", questions_41())
    args = short_gsm8k_args(
        tiny_checkpoint,
        tmp_path / "runs",
        1,
        f"data.train_files=[{train}]",
        f"data.eval_files=[{train}]",
        "data.too_long=error",
    )
    result = run_cli(args)
    assert result.exit_code == 2, result.output
    assert "data.too_long=error" in result.output
    assert f"{train}:18 (308 tokens)" in result.output
    assert "longer than 253 tokens (trainer.pack_max_length 256 + 1 - " in result.output
    assert "Traceback" not in result.output
    runs = tmp_path / "runs"  # refused before the run began: no run directory left
    assert not runs.exists() or list(runs.iterdir()) == []


def test_a_data_file_that_is_not_utf8_exits_2_naming_file_line_and_byte(tiny_checkpoint, tmp_path):
    train = tmp_path / "latin.jsonl"
    train.write_bytes(b'{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "caf\xe9"}\n')
    args = short_gsm8k_args(
        tiny_checkpoint,
        tmp_path / "runs",
        1,
        f"data.train_files=[{train}]",
        f"data.eval_files=[{train}]",
    )
    result = run_cli(args)
    assert result.exit_code == 2, result.output
    assert f"{train}:2: not valid UTF-8 (byte 0xe9 at byte 18 of the line)" in result.output
    assert "codec" not in result.output and "Traceback" not in result.output
