"""Data mapping: presets and dotted paths to one canonical row, from JSONL, Parquet (verl's
layout) and saved ``datasets`` directories; errors name the file, the record and the field."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
from verl_layout import demo_records, write_verl_parquet

from rltool.data import PRESETS, FieldMap, field_map, load_examples


def test_presets_and_keys() -> None:
    assert field_map() == FieldMap("question", "answer", "")
    assert field_map("verl") == FieldMap("prompt", "reward_model.ground_truth", "data_source")
    assert PRESETS["gsm8k"] == FieldMap()
    # a key overrides its preset's path, the others stay
    assert field_map("verl", answer_key="extra_info.answer") == FieldMap(
        "prompt", "extra_info.answer", "data_source"
    )
    with pytest.raises(ValueError, match=r"tasks\[1\].answer_key 'a..b' must be a dotted path"):
        field_map(answer_key="a..b", where="tasks[1]")


def test_verl_parquet_maps_to_messages_answer_and_task(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet", "train", 2)
    rows = load_examples([path], field_map("verl"))
    first = demo_records("train", 1)[0]
    assert first["answer"].endswith("#### 25")
    assert rows[0]["messages"] == [{"role": "user", "content": first["question"]}]
    assert rows[0]["answer"] == "25"  # reward_model.ground_truth
    assert rows[0]["task"] == "openai/gsm8k"  # data_source
    assert "question" not in rows[0]
    assert rows[0]["extra_info"]["index"] == 0  # the record's own fields stay on the row
    assert len(rows) == 2


def test_dotted_keys_on_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"q": {"text": "What is 2 + 2?"}, "sol": 4}) + "\n")
    rows = load_examples([path], field_map(prompt_key="q.text", answer_key="sol"))
    assert rows == [{"q": {"text": "What is 2 + 2?"}, "sol": 4, "question": "What is 2 + 2?",
                     "answer": 4}]  # fmt: skip


def test_missing_mapped_field_names_file_record_and_path(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "v.parquet", "train", 2)
    with pytest.raises(ValueError) as info:
        load_examples([path])  # the default gsm8k mapping on verl's layout
    assert str(info.value) == (
        f"{path} row 0: missing field 'question' (fields present: ability, data_source, "
        "extra_info, prompt, reward_model); if the prompt is named otherwise, set the "
        "recipe's data.prompt_key or data.preset"
    )
    with pytest.raises(ValueError, match=rf"{path} row 0: missing field 'reward_model.score'"):
        load_examples([path], field_map("verl", answer_key="reward_model.score"))


def test_bad_messages_and_answer_are_named(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "hi"}], "a": "1"}) + "\n"
        + json.dumps({"prompt": [{"role": "user"}], "a": "1"}) + "\n"
    )  # fmt: skip
    fields = field_map(prompt_key="prompt", answer_key="a")
    with pytest.raises(ValueError, match=rf"{path}:2: prompt field 'prompt' message 0 must have"):
        load_examples([path], fields)
    path.write_text(json.dumps({"prompt": "hi", "a": [1]}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:1: answer field 'a' must be a string or a"):
        load_examples([path], fields)


def test_saved_datasets_directory(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # the dev extra has it
    records = demo_records("test", 3)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    assert load_examples([tmp_path / "ds"]) == records
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records)}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds several splits; name one split's directory"):
        load_examples([tmp_path / "dd"])
    assert load_examples([tmp_path / "dd" / "train"]) == records
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"data directory {tmp_path / 'empty'}: not a directory"):
        load_examples([tmp_path / "empty"])


def test_datasets_missing_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    (tmp_path / "ds").mkdir()
    with pytest.raises(ValueError, match=r"pip install 'rltool\[datasets\]'"):
        load_examples([tmp_path / "ds"])
