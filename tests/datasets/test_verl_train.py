"""`rltool train` on a parquet file in verl's layout with ``data.preset=verl``; preflight
reads the mapped fields."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from short_runs import short_gsm8k_args
from verl_layout import write_verl_parquet


def test_train_from_verl_parquet_with_the_preset(tiny_checkpoint, tmp_path: Path) -> None:
    train = write_verl_parquet(tmp_path / "train.parquet", "train", 8)
    test = write_verl_parquet(tmp_path / "test.parquet", "test", 4)
    args = short_gsm8k_args(
        tiny_checkpoint,
        tmp_path / "runs",
        2,
        f"data.train_files=[{train}]",
        f"data.eval_files=[{test}]",
        "data.preset=verl",
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "runs/t/metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == [0, 2]  # before training and at the end
    assert all(x["eval/n"] == 4.0 and x["eval/failed"] == 0.0 for x in evals), evals


def test_preflight_names_the_missing_mapped_field(tiny_checkpoint, tmp_path: Path) -> None:
    train = write_verl_parquet(tmp_path / "train.parquet", "train", 2)
    args = short_gsm8k_args(
        tmp_path / "no-such-model",  # the check comes before the model would load
        tmp_path / "runs",
        1,
        f"data.train_files=[{train}]",
        f"data.eval_files=[{train}]",
        "data.preset=verl",
        "data.answer_key=reward_model.answer",
    )
    result = run_cli(args)
    assert result.exit_code == 2, result.output
    assert "preflight" in result.output
    assert f"{train} row 0: missing field 'reward_model.answer'" in result.output
