"""`rltool validate-rollouts --vocab-size N` / `--model PATH`: token ids outside the model's
vocabulary (contract invariant 10), each named with its sample, field and position."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli
from transformers import AutoConfig

DATA = Path(__file__).parents[1] / "data"
WORKED = json.loads((DATA / "validate_clean.jsonl").read_text().splitlines()[0])


def write(path: Path, *responses: list[int]) -> Path:
    """One sample of the worked example per response, its ids put in every token field."""
    records = []
    for i, response in enumerate(responses):
        ids = [*WORKED["prompt_ids"], *response]
        records.append({
            **WORKED, "rollout_id": f"r{i}", "response_ids": response, "input_ids": ids,
            "labels": [-100, -100, -100, response[0], -100, response[2]],
        })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def violations(*args: str | Path) -> tuple[int, list[tuple]]:
    result = run_cli(["validate-rollouts", "--format", "json", *args])
    found = json.loads(result.stdout)["violations"]
    return result.exit_code, [
        (v["line"], v["rollout_id"], v["field"], v["position"], v["invariant"], v["message"])
        for v in found
    ]


def test_vocab_size_names_every_id_at_or_past_it(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", [20, 21, 22], [20, 30, 22], [31, 21, 22])
    assert violations(path, "--vocab-size", "31") == (1, [
        (3, "r2", "input_ids", 3, 10, "token id 31 outside the vocabulary [0, 31)"),
    ])  # fmt: skip
    assert violations(path, "--vocab-size", "23") == (1, [
        (2, "r1", "input_ids", 4, 10, "token id 30 outside the vocabulary [0, 23)"),
        (3, "r2", "input_ids", 3, 10, "token id 31 outside the vocabulary [0, 23)"),
    ])  # fmt: skip
    assert violations(path)[0] == 0  # no vocabulary known: every id >= 0 is fine


def test_a_negative_id_is_a_named_violation_without_a_vocab_size(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", [20, -5, 22])
    assert violations(path) == (1, [(1, "r0", "input_ids", 4, 10, "token id -5 is negative")])


def test_model_reads_the_embedding_rows_from_the_config(tmp_path: Path, tiny_checkpoint) -> None:
    rows = AutoConfig.from_pretrained(tiny_checkpoint).vocab_size  # 491, the demo tokenizer's
    path = write(tmp_path / "r.jsonl", [20, rows - 1, 22], [20, rows, 22])
    message = f"token id {rows} outside the vocabulary [0, {rows})"
    assert violations(path, "--model", str(tiny_checkpoint)) == (
        1, [(2, "r1", "input_ids", 4, 10, message)]
    )  # fmt: skip


def test_model_and_vocab_size_together_or_a_bad_model_exit_2(tmp_path: Path) -> None:
    path = write(tmp_path / "r.jsonl", [20, 21, 22])
    both = run_cli(["validate-rollouts", path, "--vocab-size", "9", "--model", str(tmp_path)])
    assert both.exit_code == 2 and "--vocab-size or --model, not both" in both.stderr
    missing = run_cli(["validate-rollouts", path, "--model", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "--model" in missing.stderr
