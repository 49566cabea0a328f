"""metrics.jsonl: the writer counts its lines; a resume cuts the file back to a count."""

from __future__ import annotations

import json

from rltool.app.metrics_log import MetricsWriter, trim_metrics


def test_trim_keeps_the_lines_written_before_the_save(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(0, {"eval/accuracy": 0.5}, kind="eval")
    writer.write(1, {"actor/pg_loss": 0.1}, kind="train")
    saved = writer.lines  # what a checkpoint of step 1 records
    writer.write(2, {"actor/pg_loss": 0.2}, kind="train")
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "kind": "ev')  # killed in the middle of a line
    assert saved == 2

    kept = trim_metrics(tmp_path, saved)
    assert kept == [
        {"step": 0, "kind": "eval", "eval/accuracy": 0.5},
        {"step": 1, "kind": "train", "actor/pg_loss": 0.1},
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == kept
    resumed = MetricsWriter(tmp_path)
    assert resumed.lines == 2  # counts on from the file it appends to
    resumed.write(2, {"actor/pg_loss": 0.3}, kind="train")
    resumed.close()
    assert resumed.lines == 3


def test_trim_of_a_run_without_metrics_is_empty(tmp_path):
    assert trim_metrics(tmp_path, 5) == []
    assert not (tmp_path / "metrics.jsonl").exists()
