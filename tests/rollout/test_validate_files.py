"""validate_files: every section-4 invariant located by file, line, field and position."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import rltool.rollout.validate as validate_module
from rltool.rollout.foreign import check_response_mask
from rltool.rollout.io import write_rollouts
from rltool.rollout.state import RolloutState
from rltool.rollout.validate import FileViolation, InputError, validate_files
from rltool.rollout.violation import Severity

DATA = Path(__file__).parents[1] / "data"
CLEAN = DATA / "validate_clean.jsonl"
BROKEN = DATA / "validate_broken.jsonl"
WORKED = json.loads(CLEAN.read_text().splitlines()[0])  # rollout r1, group g1, task math
CASES = json.loads((DATA / "validate_cases.json").read_text())["cases"]


def write_lines(path: Path, records: list[dict[str, object]]) -> Path:
    # json.dumps, not RolloutState.to_json: it keeps NaN/Infinity as JSON literals
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def located(found: list[FileViolation]) -> list[tuple[object, ...]]:
    return [(v.line, v.rollout_id, v.field, v.position, v.invariant, v.severity) for v in found]


def test_clean_file() -> None:
    report = validate_files([CLEAN])
    assert (report.files, report.samples, report.groups) == (1, 4, 2)
    assert report.violations == []
    assert report.ok


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_invariant_located_in_the_file(tmp_path: Path, name: str) -> None:
    overrides, (field, position, invariant, severity) = CASES[name]
    second = {**WORKED, "rollout_id": "r2", **overrides}
    path = write_lines(tmp_path / "r.jsonl", [WORKED, second])
    report = validate_files([path])
    assert located(report.violations) == [(2, "r2", field, position, invariant, Severity(severity))]
    assert report.violations[0].file == str(path)
    assert report.ok == (severity == "warning")


@pytest.mark.parametrize("batch_tokens", [1, validate_module.BATCH_TOKENS])
def test_golden_broken_file(batch_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same findings in line order, whether samples are checked one at a time or the
    whole file at once (around the unparsable line)."""
    monkeypatch.setattr(validate_module, "BATCH_TOKENS", batch_tokens)
    report = validate_files([BROKEN])
    E, W = Severity.ERROR, Severity.WARNING
    assert located(report.violations) == [
        (2, "b-len", "labels", None, 1, E),
        (3, None, None, None, None, E),  # truncated line: unparsable, no invariant
        (4, "b-tool", "logprobs", 4, 4, E),
        (5, "r1", "rollout_id", None, 7, E),
        (5, "r1", "task_name", None, 7, E),
        (6, "b-warn", "labels", None, 8, W),
    ]
    assert (report.samples, report.groups, report.errors, report.warnings) == (5, 2, 5, 1)
    assert report.violations[3].message == f"duplicate rollout_id, first at {BROKEN}:1"
    assert report.violations[4].message == (
        f"'code' differs from 'math' of group 'g1' (first member at {BROKEN}:1)"
    )


def test_group_members_need_not_be_consecutive(tmp_path: Path) -> None:
    records = [
        WORKED,
        {**WORKED, "rollout_id": "x1", "group_id": "g2", "task_name": "other"},
        {**WORKED, "rollout_id": "r3", "task_name": "code"},  # g1 again, other task
    ]
    report = validate_files([write_lines(tmp_path / "r.jsonl", records)])
    assert located(report.violations) == [
        (3, "r3", "task_name", None, 7, Severity.ERROR),
        (3, "r3", "group_id", None, 7, Severity.WARNING),  # iter_groups would refuse it
    ]
    assert report.groups == 2


def test_failed_sample_without_train_fields_is_a_warning(tmp_path: Path) -> None:
    failed = {"rollout_id": "f1", "group_id": "g1", "task_name": "math", "prompt_ids": [10, 13]}
    failed |= {"status": "FAILED", "error": "engine timeout"}
    broken = {**WORKED, "rollout_id": "f2", "status": "FAILED", "response_ids": [20, 21, 23]}
    report = validate_files([write_lines(tmp_path / "r.jsonl", [WORKED, failed, broken])])
    assert located(report.violations) == [
        (2, "f1", "input_ids", None, 1, Severity.WARNING),
        (3, "f2", "response_ids", 2, 2, Severity.ERROR),  # built fields are still checked
    ]
    assert report.violations[0].message == "no train fields on a FAILED sample (engine timeout)"


def test_rollout_ids_unique_across_files(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [WORKED])
    b = write_lines(tmp_path / "b.jsonl", [{**WORKED, "group_id": "g2"}])
    report = validate_files([a, b])
    (v,) = report.violations
    assert (v.file, v.line, v.field, v.invariant) == (str(b), 1, "rollout_id", 7)
    assert v.message == f"duplicate rollout_id, first at {a}:1"
    assert (report.files, report.samples, report.groups) == (2, 2, 2)


@pytest.mark.parametrize("batch_tokens", [1, validate_module.BATCH_TOKENS])
def test_a_group_may_continue_in_the_next_file(
    tmp_path: Path, batch_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "BATCH_TOKENS", batch_tokens)
    a = write_lines(tmp_path / "a.jsonl", [WORKED])
    b = write_lines(tmp_path / "b.jsonl", [{**WORKED, "rollout_id": "r2", "task_name": "x"}])
    report = validate_files([a, b])
    assert located(report.violations) == [(1, "r2", "task_name", None, 7, Severity.ERROR)]


def test_nan_written_by_write_rollouts_is_still_caught(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_rollouts(path, [RolloutState.model_validate({**WORKED, **CASES["nan_logprob"][0]})])
    (v,) = validate_files([path]).violations
    assert (v.line, v.field, v.position, v.severity) == (1, "logprobs", 3, Severity.ERROR)


def test_to_dict_is_the_json_schema() -> None:
    d = validate_files([BROKEN]).to_dict()
    assert list(d) == ["files", "samples", "groups", "errors", "warnings", "violations"]
    assert d["violations"][0] == {
        "file": str(BROKEN),
        "line": 2,
        "rollout_id": "b-len",
        "field": "labels",
        "position": None,
        "invariant": 1,
        "severity": "error",
        "message": "length 5 != len(input_ids) 6",
    }


def test_unusable_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"missing\.jsonl: no such file"):
        validate_files([CLEAN, tmp_path / "missing.jsonl"])
    with pytest.raises(InputError, match="not a regular file"):
        validate_files([tmp_path])
    with pytest.raises(InputError, match="no rollout file given"):
        validate_files([])


def test_progress_sees_every_byte() -> None:
    seen: list[int] = []
    validate_files([CLEAN, BROKEN], progress=seen.append)
    assert sum(seen) == CLEAN.stat().st_size + BROKEN.stat().st_size


def test_a_file_without_samples_is_an_error(tmp_path: Path) -> None:
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    report = validate_files([CLEAN, empty, blank])
    assert not report.ok and report.errors == 2
    assert [(v.file, v.line, v.message) for v in report.violations] == [
        (str(empty), 0, "no samples"),
        (str(blank), 0, "no samples"),
    ]


def test_a_fifo_is_named_as_one(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match=r"pipe\.jsonl: is a FIFO, not a regular file"):
        validate_files([CLEAN, fifo])
    with pytest.raises(InputError, match="is a directory, not a regular file"):
        validate_files([tmp_path])


def _masked(mask: object) -> RolloutState:
    """The worked sample (response 20 supervised, 21 a tool token, 22 supervised) with a
    foreign response_mask kept in extra, as the reader keeps it."""
    return RolloutState.model_validate({**WORKED, "extra": {"response_mask": mask}})


@pytest.mark.parametrize(
    ("mask", "position", "message"),
    [
        ([1, 0, 1], None, None),
        ([True, False, True], None, None),
        ([0, 0, 1], 0, "has mask 0 but its label says supervised"),
        ([1, 1, 1], 1, "has mask 1 but its label says not supervised"),
        ([1, 0], None, "response_mask has 2 entries but the response has 3 tokens"),
        ([1, 2, 1], 1, "response_mask holds 2: only 0 and 1"),
        ("101", None, "response_mask must be a list of 0/1 per response token"),
    ],
)
def test_response_mask_against_the_labels(mask, position, message) -> None:
    found = check_response_mask(_masked(mask))
    if message is None:
        assert found == []
        return
    (v,) = found
    assert (v.field, v.position, v.invariant) == ("extra.response_mask", position, 3)
    assert message in v.message
