"""Load task records (``{"question": ..., "answer": ..., ...}``) from local files.

``.jsonl`` or ``.parquet``; a bad record is a ValueError naming the file and line or row.
Design: docs/foundations.md#task-records
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REQUIRED_FIELDS = ("question", "answer")
BUILTIN_PREFIX = "builtin:"


def load_examples(files: Iterable[str | Path]) -> list[dict[str, Any]]:
    """All records of ``files``, in file order then line/row order."""
    out: list[dict[str, Any]] = []
    for f in files:
        path = _resolve(f)
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            out.extend(_read_jsonl(path))
        elif suffix == ".parquet":
            out.extend(_read_parquet(path))
        else:
            raise ValueError(
                f"data file {path}: unsupported format {suffix!r}; use .jsonl or .parquet"
            )
    return out


def _resolve(f: str | Path) -> Path:
    if isinstance(f, str) and f.startswith(BUILTIN_PREFIX):
        from rltool.models import resolve_builtin_data  # lazy: pulls in the model stack

        return Path(resolve_builtin_data(f))
    return Path(f)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            records.append(_check_record(record, where))
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: cannot read as Parquet ({exc})") from exc
    return [_check_record(r, f"{path} row {i}") for i, r in enumerate(table.to_pylist())]


def _check_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED_FIELDS if record.get(k) is None]
    if missing:
        have = ", ".join(sorted(record)) or "none"
        raise ValueError(f"{where}: missing field {missing[0]!r} (fields present: {have})")
    if not isinstance(record["question"], str) or not record["question"].strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    if not isinstance(record["answer"], str | int | float) or isinstance(record["answer"], bool):
        kind = type(record["answer"]).__name__
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {kind}")
    return record
