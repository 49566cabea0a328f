"""Load task records from local files and map each to the canonical row
(``rltool.data.mapping``).

``.jsonl``, ``.parquet`` or a saved Hugging Face ``datasets`` directory (the
``rltool[datasets]`` extra); a bad record is a ValueError naming the file and line or row.
Design: docs/foundations.md#task-records
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rltool.builtin import resolve_builtin_data
from rltool.data.mapping import FieldMap, map_record

REQUIRED_FIELDS = ("question", "answer")


def load_examples(
    files: Iterable[str | Path], fields: FieldMap | None = None
) -> list[dict[str, Any]]:
    """All records of ``files`` mapped by ``fields`` (default: ``question``/``answer``),
    in file order then line/row order."""
    return [record for _, record in load_located(files, fields)]


def load_located(
    files: Iterable[str | Path], fields: FieldMap | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """``load_examples``'s records, each after where it is (``path:line``, ``path row i``)."""
    fields = fields or FieldMap()
    out: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        path = _resolve(f)
        if path.is_dir():
            rows = _read_datasets_dir(path)
        elif not path.is_file():
            raise ValueError(f"data file {path} does not exist")
        elif path.suffix.lower() == ".jsonl":
            rows = _read_jsonl(path)
        elif path.suffix.lower() == ".parquet":
            rows = _read_parquet(path)
        else:
            raise ValueError(
                f"data file {path}: unsupported format {path.suffix.lower()!r}; use .jsonl, "
                ".parquet or a directory saved by datasets' save_to_disk"
            )
        out.extend((where, map_record(record, fields, where)) for where, record in rows)
    return out


def _resolve(f: str | Path) -> Path:
    return resolve_builtin_data(f) if isinstance(f, str) else Path(f)


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    records = []
    with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is named, not the codec's
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            line = decode_line(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            records.append((where, record))
    return records


def decode_line(raw: bytes, where: str) -> str:
    """One line of a UTF-8 text file; a ValueError naming ``where`` and the bad byte's
    1-based position in the line when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} "
            "of the line); save the file as UTF-8"
        ) from exc


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: cannot read as Parquet ({exc})") from exc
    return [(f"{path} row {i}", r) for i, r in enumerate(table.to_pylist())]


def _read_datasets_dir(path: Path) -> list[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(
            f"data directory {path}: reading a Hugging Face datasets directory needs the "
            "'datasets' package; install the extra: pip install 'rltool[datasets]'"
        ) from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(
            f"data directory {path}: not a directory saved by datasets' save_to_disk ({exc})"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(f"{path / s}" for s in loaded)
        raise ValueError(
            f"data directory {path} holds several splits; name one split's directory: {splits}"
        )
    return [(f"{path} row {i}", r) for i, r in enumerate(loaded.to_list())]
