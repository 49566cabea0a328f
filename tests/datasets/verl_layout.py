"""verl's GSM8K parquet layout, built from the builtin demo data (no binary fixture shipped)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rltool.builtin import resolve_builtin_data
from rltool.rewards.gsm8k import extract_answer


def demo_records(split: str, limit: int) -> list[dict]:
    path = Path(resolve_builtin_data(f"builtin:gsm8k_tiny/{split}.jsonl"))
    return [json.loads(x) for x in path.read_text().splitlines()[:limit]]


def verl_row(record: dict, index: int, split: str) -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": record["question"]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(record["answer"])},
        "extra_info": {"split": split, "index": index, "answer": record["answer"]},
    }


def write_verl_parquet(path: Path, split: str, limit: int) -> Path:
    rows = [verl_row(r, i, split) for i, r in enumerate(demo_records(split, limit))]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
