"""Reading a run directory back for ``rltool report``: lines by kind in step order,
non-finite figures as gaps, a cut last line, the errors, and the summary figures."""

from __future__ import annotations

import pytest
from metrics_files import eval_line, train_line, write_run

from rltool.app.run_reader import (
    match_key,
    matching_keys,
    read_run,
    read_runs,
    series,
    summarize,
    unique_names,
)

LINES = [
    eval_line(0, {"eval/accuracy": 0.25, "time/eval": 2.0}),
    train_line(1, {"rollout/reward_mean": 0.1, "time/step": 3.0, "actor/kl": None}),
    train_line(2, {"rollout/reward_mean": 0.3, "time/step": 4.0, "actor/kl": 0.01}),
    eval_line(2, {"eval/accuracy": 0.5, "time/eval": 2.5}),
    train_line(3, {"rollout/reward_mean": 0.2, "time/step": 5.0, "task/a/reward_mean": 0.2}),
    eval_line(3, {"eval/accuracy": 0.4, "time/eval": 1.5}),
]


def test_lines_by_kind_config_and_name(tmp_path):
    run = read_run(write_run(tmp_path / "demo", LINES, config="trainer:\n  steps: 3\n"))
    assert run.name == "demo"
    assert [x["step"] for x in run.lines["train"]] == [1, 2, 3]
    assert [x["step"] for x in run.lines["eval"]] == [0, 2, 3]
    assert run.config_text == "trainer:\n  steps: 3\n"
    assert run.resumes == 0 and run.notes == []


def test_series_keeps_only_lines_with_the_key_and_null_as_a_gap(tmp_path):
    run = read_run(write_run(tmp_path / "demo", LINES))
    kl = series(run, "train", "actor/kl")
    assert (kl.steps, kl.values) == ((1, 2), (None, 0.01))
    acc = series(run, "eval", "eval/accuracy")
    assert (acc.steps, acc.values) == ((0, 2, 3), (0.25, 0.5, 0.4))
    assert series(run, "eval", "actor/kl").steps == ()


def test_summary_by_hand(tmp_path):
    s = summarize(read_run(write_run(tmp_path / "demo", LINES)))
    assert s.steps == 3
    assert (s.final_accuracy, s.final_accuracy_step) == (0.4, 3)
    assert (s.best_accuracy, s.best_accuracy_step) == (0.5, 2)
    assert s.time_s == pytest.approx(3 + 4 + 5 + 2 + 2.5 + 1.5)


def test_summary_best_tie_is_the_earliest_and_no_eval_is_none(tmp_path):
    tied = [eval_line(s, {"eval/accuracy": a}) for s, a in [(0, 0.5), (4, 0.5), (8, None)]]
    s = summarize(read_run(write_run(tmp_path / "tied", tied)))
    assert (s.best_accuracy_step, s.final_accuracy_step, s.steps) == (0, 4, 0)
    bare = summarize(read_run(write_run(tmp_path / "bare", [train_line(1, {})])))
    assert (bare.final_accuracy, bare.best_accuracy, bare.time_s) == (None, None, 0.0)


def test_a_step_written_twice_keeps_its_last_line(tmp_path):
    lines = [train_line(1, {"x": 1.0}), train_line(2, {"x": 2.0}), train_line(1, {"x": 9.0})]
    run = read_run(write_run(tmp_path / "demo", lines))
    assert series(run, "train", "x").values == (9.0, 2.0)


def test_a_cut_last_line_is_left_out_with_a_note(tmp_path):
    path = write_run(tmp_path / "demo", LINES[:2])
    with (path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "kind": "tr')
    run = read_run(path)
    assert [x["step"] for x in run.lines["train"]] == [1]
    assert run.notes == [f"{path / 'metrics.jsonl'}: line 3 is cut short (left out)"]


def test_a_bad_line_inside_the_file_names_file_and_line(tmp_path):
    path = write_run(tmp_path / "demo", LINES[:2])
    text = (path / "metrics.jsonl").read_text()
    (path / "metrics.jsonl").write_text("not json\n" + text)
    with pytest.raises(ValueError, match=r"demo/metrics.jsonl: line 1 is not JSON"):
        read_run(path)
    (path / "metrics.jsonl").write_text('{"kind": "train"}\n')
    with pytest.raises(ValueError, match=r"line 1 is not a metrics line \(no integer 'step'\)"):
        read_run(path)


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no metrics.jsonl in it"):
        read_run(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"missing: not a directory"):
        read_run(tmp_path / "missing")


def test_no_config_and_resumes_counted(tmp_path):
    path = write_run(tmp_path / "demo", LINES, config=None)
    (path / "resumes.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    run = read_run(path)
    assert (run.config_text, run.resumes) == (None, 2)


def test_runs_with_one_name_are_told_apart_by_their_parents(tmp_path):
    a = write_run(tmp_path / "a" / "demo", LINES)
    b = write_run(tmp_path / "b" / "demo", LINES)
    c = write_run(tmp_path / "b" / "other", LINES)
    assert [r.name for r in read_runs([a, b, c])] == ["a/demo", "b/demo", "b/other"]
    assert unique_names([a, c]) == ["demo", "other"]


def test_key_patterns():
    assert match_key("task/*/accuracy", "task/gsm8k/accuracy") == "gsm8k"
    assert match_key("task/*/accuracy", "task/accuracy") is None
    assert match_key("eval/accuracy", "eval/accuracy") == ""
    assert match_key("eval/accuracy", "eval/accuracy_x") is None


def test_matching_keys_sorted_without_step_and_kind(tmp_path):
    lines = [train_line(1, {"task/b/reward_mean": 1.0, "task/a/reward_mean": 0.0})]
    run = read_run(write_run(tmp_path / "demo", lines))
    assert matching_keys(run, "train", "task/*/reward_mean") == [
        "task/a/reward_mean",
        "task/b/reward_mean",
    ]
    assert matching_keys(run, "train", "*") == ["task/a/reward_mean", "task/b/reward_mean"]
    assert matching_keys(run, "eval", "task/*/reward_mean") == []
