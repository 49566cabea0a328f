"""`rltool validate-rollouts`: exit codes 0/1/2, the JSON format and the rich report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_runner import run_cli

import rltool.cli.validate as validate_cli

DATA = Path(__file__).parents[1] / "data"
CLEAN = DATA / "validate_clean.jsonl"
BROKEN = DATA / "validate_broken.jsonl"
WORKED = json.loads(CLEAN.read_text().splitlines()[0])
CASES = json.loads((DATA / "validate_cases.json").read_text())["cases"]


def run(*args: str | Path):
    return run_cli(["validate-rollouts", *args])


def write_lines(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_clean_file_exits_0_with_a_summary() -> None:
    result = run(CLEAN)
    assert result.exit_code == 0, result.output
    assert (
        result.stdout.strip() == "✓ checked 4 samples in 2 groups from 1 file: 0 errors, 0 warnings"
    )
    assert result.stderr == ""  # no progress bar for a small file, nothing on a pipe


def test_clean_file_json() -> None:
    result = run("--format", "json", CLEAN)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "files": 1,
        "samples": 4,
        "groups": 2,
        "errors": 0,
        "warnings": 0,
        "violations": [],
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_invariant_via_the_cli(tmp_path: Path, name: str) -> None:
    overrides, (field, position, invariant, severity) = CASES[name]
    path = write_lines(tmp_path / "r.jsonl", [WORKED, {**WORKED, "rollout_id": "r2", **overrides}])
    result = run("--format", "json", path)
    assert result.exit_code == (0 if severity == "warning" else 1)
    (v,) = json.loads(result.stdout)["violations"]
    assert (v["file"], v["line"], v["rollout_id"]) == (str(path), 2, "r2")
    assert (v["field"], v["position"], v["invariant"], v["severity"]) == (
        field,
        position,
        invariant,
        severity,
    )


def test_broken_file_json_lists_every_violation() -> None:
    result = run("--format", "json", BROKEN)
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert {k: report[k] for k in ("files", "samples", "groups", "errors", "warnings")} == {
        "files": 1,
        "samples": 5,
        "groups": 2,
        "errors": 5,
        "warnings": 1,
    }
    rows = [
        (v["line"], v["rollout_id"], v["field"], v["position"], v["invariant"], v["severity"])
        for v in report["violations"]
    ]
    assert rows == [
        (2, "b-len", "labels", None, 1, "error"),
        (3, None, None, None, None, "error"),
        (4, "b-tool", "logprobs", 4, 4, "error"),
        (5, "r1", "rollout_id", None, 7, "error"),
        (5, "r1", "task_name", None, 7, "error"),
        (6, "b-warn", "labels", None, 8, "warning"),
    ]
    assert report["violations"][1]["message"].startswith("not valid JSON: EOF while parsing")


def test_broken_file_rich_report() -> None:
    result = run(BROKEN)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert str(BROKEN) in lines[0]  # one table per file, titled with its path
    row = next(line for line in lines if "b-tool" in line)
    assert "✗ error" in row and "logprobs[4]" in row and "at an unsupervised position" in row
    row = next(line for line in lines if "b-warn" in line)
    assert "! warning" in row and "no supervised token" in row
    row = next(line for line in lines if "not valid JSON" in line)
    assert row.split("│")[1].strip() == "3"  # the line number column
    assert lines[-1] == "✗ checked 5 samples in 2 groups from 1 file: 5 errors, 1 warning"


def test_warnings_only_exit_0(tmp_path: Path) -> None:
    no_supervision = CASES["completed_without_supervised_token"][0]
    path = write_lines(tmp_path / "r.jsonl", [{**WORKED, **no_supervision}])
    result = run(path)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == (
        "✓ checked 1 sample in 1 group from 1 file: 0 errors, 1 warning"
    )


def test_failed_sample_without_train_fields_exits_0(tmp_path: Path) -> None:
    failed = {"rollout_id": "f1", "group_id": "g1", "task_name": "math", "prompt_ids": [10]}
    failed["status"] = "FAILED"
    result = run("--format", "json", write_lines(tmp_path / "r.jsonl", [WORKED, failed]))
    assert result.exit_code == 0
    assert json.loads(result.stdout)["warnings"] == 1


def test_unparsable_line_alone_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(WORKED) + "\n\nnot json\n")
    result = run("--format", "json", path)
    assert result.exit_code == 1
    (v,) = json.loads(result.stdout)["violations"]
    assert (v["line"], v["invariant"], v["severity"]) == (3, None, "error")


def test_duplicate_ids_across_files(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [WORKED])
    b = write_lines(tmp_path / "b.jsonl", [{**WORKED, "group_id": "g2"}])
    result = run("--format", "json", a, b)
    assert result.exit_code == 1
    (v,) = json.loads(result.stdout)["violations"]
    assert (v["file"], v["field"], v["message"]) == (
        str(b),
        "rollout_id",
        f"duplicate rollout_id, first at {a}:1",
    )


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_unusable_input_exits_2(tmp_path: Path, what: str) -> None:
    bad = tmp_path / "missing.jsonl" if what == "missing" else tmp_path
    result = run("--format", "json", CLEAN, bad)
    assert result.exit_code == 2
    assert result.stdout == ""  # nothing half-checked is reported
    assert str(bad) in result.stderr and "error:" in result.stderr


def test_long_reports_are_capped_in_the_rich_view(tmp_path: Path) -> None:
    no_supervision = CASES["completed_without_supervised_token"][0]
    warn = [{**WORKED, **no_supervision, "rollout_id": f"w{i}"} for i in range(205)]
    bad = {**WORKED, "rollout_id": "e0", "labels": [-100, -100, -100, 20, -100, 99]}
    path = write_lines(tmp_path / "r.jsonl", [*warn, bad])
    result = run(path)
    assert result.exit_code == 1
    out = result.stdout
    assert "e0" in out  # errors are kept first when rows are capped
    assert out.count("! warning") == 199
    assert "… 6 more (use --format json to see all)" in out
    assert out.splitlines()[-1].endswith("1 error, 205 warnings")
    assert len(json.loads(run("--format", "json", path).stdout)["violations"]) == 206


def test_progress_bar_keeps_json_on_stdout_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate_cli, "PROGRESS_MIN_BYTES", 0)  # force the bar
    result = run("--format", "json", BROKEN)
    assert result.exit_code == 1
    assert json.loads(result.stdout)["samples"] == 5


def test_empty_file_exits_1_with_no_samples(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = run("--format", "json", empty)
    assert result.exit_code == 1
    assert f"error: {empty}: no samples" in result.stderr
    assert json.loads(result.stdout)["violations"][0]["message"] == "no samples"


def test_a_fifo_is_refused_by_name_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    result = run(fifo)
    assert result.exit_code == 2
    assert f"error: {fifo}: is a FIFO, not a regular file" in result.stderr
    assert "directory" not in result.stderr


def test_integer_ids_validate_clean(tmp_path: Path) -> None:
    records = [{**json.loads(line), "group_id": 1} for line in CLEAN.read_text().splitlines()[:2]]
    records = [{**r, "rollout_id": i} for i, r in enumerate(records)]
    result = run(write_lines(tmp_path / "ints.jsonl", records))
    assert result.exit_code == 0, result.output


def test_fields_of_other_frameworks_are_two_warnings_and_exit_0(tmp_path: Path) -> None:
    """verl's ``uid`` and an xtuner/verl ``response_mask`` that agrees with the labels: read,
    kept in extra, one warning per field name however many lines carry them."""
    mask = [1, 0, 1]  # WORKED: response 20 supervised, 21 a tool token, 22 supervised
    lines = [{**WORKED, "rollout_id": f"r{i}", "response_mask": mask, "uid": "u"} for i in (1, 2)]
    path = write_lines(tmp_path / "verl.jsonl", lines)
    result = run("--format", "json", path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["samples"], report["errors"], report["warnings"]) == (2, 0, 2)
    found = [(v["line"], v["field"], v["severity"], v["invariant"]) for v in report["violations"]]
    assert found == [(1, "response_mask", "warning", None), (1, "uid", "warning", None)]
    assert "kept aside in extra['response_mask']" in report["violations"][0]["message"]
    rich = run(path)
    assert rich.exit_code == 0
    assert rich.stdout.strip().splitlines()[-1].endswith("0 errors, 2 warnings")


def test_a_response_mask_that_contradicts_the_labels_is_an_error(tmp_path: Path) -> None:
    bad = {**WORKED, "rollout_id": "r2", "response_mask": [1, 1, 1]}  # 21 is not supervised
    path = write_lines(tmp_path / "xtuner.jsonl", [WORKED, bad])
    result = run("--format", "json", path)
    assert result.exit_code == 1
    warning, error = json.loads(result.stdout)["violations"]
    assert (warning["field"], warning["severity"]) == ("response_mask", "warning")
    assert (error["line"], error["rollout_id"], error["field"], error["position"]) == (
        2,
        "r2",
        "extra.response_mask",
        1,
    )
    assert (error["invariant"], error["severity"]) == (3, "error")
    assert error["message"].startswith(
        "response_mask contradicts labels at 1 response token(s): the first, response "
        "position 1 (input position 4), has mask 1 but its label says not supervised"
    )


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(json.dumps(WORKED).encode() + b"\n\xff\n")
    result = run("--format", "json", path)
    assert result.exit_code == 1  # an unparsable line, as documented
    (v,) = json.loads(result.stdout)["violations"]
    assert (v["file"], v["line"]) == (str(path), 2)
    assert v["message"] == "not valid UTF-8: byte 0xff at byte 1 of the line"
