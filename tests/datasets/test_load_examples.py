"""load_examples: JSONL and Parquet records, errors that name the file and line or row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltool.data import load_examples

RECORDS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5", "id": 0},
    {"question": "What is 7 * 7?", "answer": 49, "id": 1},
]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_and_parquet_in_file_order(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "a.jsonl", [json.dumps(RECORDS[0]), "", json.dumps(RECORDS[1])])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "What is 1 + 1?", "answer": "2"}]), parquet)
    out = load_examples([jsonl, str(parquet)])
    assert out == [*RECORDS, {"question": "What is 1 + 1?", "answer": "2"}]


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(RECORDS[0]), '{"question": "x",'])
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        load_examples([path])


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [json.dumps({"question": "What is 1 + 1?"})])
    with pytest.raises(
        ValueError, match=rf"{path}:1: missing field 'answer' \(fields present: question\)"
    ):
        load_examples([path])
    path = write_jsonl(tmp_path / "l.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=rf"{path}:1: a record must be a JSON object, got list"):
        load_examples([path])


def test_parquet_row_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    rows = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "", "answer": "3"}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=rf"{path} row 1: 'question' must be a non-empty string"):
        load_examples([path])


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_examples([tmp_path / "nope.jsonl"])
    csv = tmp_path / "x.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported format '\.csv'"):
        load_examples([csv])
    not_parquet = tmp_path / "y.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="cannot read as Parquet"):
        load_examples([not_parquet])


def test_invalid_utf8_names_file_line_and_byte(tmp_path: Path) -> None:
    # line 3 holds byte 0xff as the 15th byte of the line: {"question": "\xff
    path = tmp_path / "latin.jsonl"
    good = json.dumps(RECORDS[0]).encode()
    path.write_bytes(good + b"\n\n" + b'{"question": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError) as info:
        load_examples([path])
    message = str(info.value)
    assert message.startswith(f"{path}:3: not valid UTF-8 (byte 0xff at byte 15 of the line)")
    assert "codec" not in message
