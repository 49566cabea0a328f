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


class RecordingTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))

    def close(self) -> None:
        self.closed = True


def test_each_line_fans_out_to_the_trackers_without_non_finite_values(tmp_path):
    a, b = RecordingTracker(), RecordingTracker()
    writer = MetricsWriter(tmp_path, [a, b])
    writer.write(0, {"eval/accuracy": 0.25}, kind="eval")
    writer.write(1, {"actor/pg_loss": 0.5, "actor/kl": float("nan")}, kind="train")
    writer.close()
    expected = [(0, {"eval/accuracy": 0.25}), (1, {"actor/pg_loss": 0.5})]
    assert a.logged == expected and b.logged == expected
    assert a.closed and b.closed
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 1, "kind": "train", "actor/pg_loss": 0.5, "actor/kl": None}
