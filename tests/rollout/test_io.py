"""Rollout JSONL files: streaming reads, bad lines with line numbers, groups, appends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rltool.rollout.io import (
    ForeignFieldWarning,
    LineError,
    iter_groups,
    iter_rollouts,
    iter_samples,
    read_groups,
    write_rollouts,
)
from rltool.rollout.state import RolloutState, Status

DATA = Path(__file__).parents[1] / "data"
CLEAN = DATA / "validate_clean.jsonl"  # g1 = r1, r2 (lines 1-2); blank line 3; g2 = r3, r4
WORKED = json.loads(CLEAN.read_text().splitlines()[0])


def sample(**overrides: object) -> RolloutState:
    return RolloutState.model_validate({**WORKED, **overrides})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_iter_rollouts_skips_blank_lines_and_keeps_physical_line_numbers() -> None:
    items = list(iter_rollouts(CLEAN))
    assert [(n, s.rollout_id) for n, s in items] == [(1, "r1"), (2, "r2"), (4, "r3"), (5, "r4")]
    assert items[3][1].status == Status.ABORTED


def test_iter_rollouts_reports_bytes_read() -> None:
    seen: list[int] = []
    list(iter_rollouts(CLEAN, on_bytes=seen.append))
    assert len(seen) == 5  # every physical line, blank included
    assert sum(seen) == CLEAN.stat().st_size


def test_bad_lines_yield_line_errors_and_reading_goes_on(tmp_path: Path) -> None:
    good = json.dumps(WORKED)
    path = write_lines(
        tmp_path / "bad.jsonl",
        [
            good,
            '{"rollout_id": "x", ',  # truncated write
            "[1, 2]",
            '{"rollout_id": "r7", "group_id": "g", "prompt_ids": [1, "a"]}',
            '{"group_id": "g", "prompt_ids": [1]}',
            json.dumps({**WORKED, "rollout_id": "r8", "extra": [1], "uid": "u"}),
            good.replace('"r1"', '"r9"'),
        ],
    )
    items = list(iter_rollouts(path))
    assert [n for n, _ in items] == [1, 2, 3, 4, 5, 6, 7]
    assert isinstance(items[0][1], RolloutState)
    assert isinstance(items[6][1], RolloutState)
    errs = [e for _, e in items[1:6]]
    assert all(isinstance(e, LineError) for e in errs)
    truncated, array, bad_id, no_id, extra = errs
    assert (truncated.line_no, truncated.field) == (2, None)
    assert truncated.message.startswith("not valid JSON: EOF while parsing")
    assert "line 1" not in truncated.message  # pydantic's own line number would mislead
    assert array.message == "not a RolloutState: Input should be an object"
    assert (bad_id.field, bad_id.position, bad_id.rollout_id) == ("prompt_ids", 1, "r7")
    assert "prompt_ids.1: Input should be a valid integer" in bad_id.message
    assert (no_id.field, no_id.rollout_id) == ("rollout_id", None)
    assert no_id.message == "not a RolloutState: rollout_id: Field required"
    # a foreign field has nowhere to go when extra is no object
    assert (extra.field, extra.rollout_id) == ("extra", "r8")
    assert str(extra) == (
        f"{path}:6: not a RolloutState: fields ['uid'] are not rltool's and would be kept in "
        "extra, but extra is not an object"
    )


def test_many_pydantic_errors_are_summarised(tmp_path: Path) -> None:
    line = '{"rollout_id": 1.5, "extra": {}, "a": 1, "b": 2, "status": "NOPE", "reward": 3}'
    path = write_lines(tmp_path / "bad.jsonl", [line])
    ((_, err),) = list(iter_rollouts(path, on_foreign=lambda *a: None))
    assert isinstance(err, LineError)
    # 5 errors: rollout_id neither a string nor an integer; group_id, prompt_ids missing;
    # status not a Status; reward not an object (a and b are foreign: kept in extra).
    # pydantic's order of errors is its own business: check the set, not the order.
    causes = {
        "status": "status: Input should be 'INIT', 'COMPLETED', 'ABORTED', 'EXPIRED', "
        "'FAILED' or 'FILTERED'",
        "reward": "reward: Input should be a valid dictionary",
        "rollout_id": "rollout_id: must be a string or an integer, got a number",
        "group_id": "group_id: Field required",
        "prompt_ids": "prompt_ids: Field required",
    }
    assert err.field in causes
    head, _, more = err.message.removeprefix("not a RolloutState: ").rpartition("; ")
    shown = head.split("; ")
    assert shown[0] == causes[err.field]
    assert len(shown) == 3 and set(shown) <= set(causes.values())
    assert more == "... 2 more"


def test_iter_groups_splits_consecutive_runs() -> None:
    groups = list(iter_groups(CLEAN))
    assert [[s.rollout_id for s in g] for g in groups] == [["r1", "r2"], ["r3", "r4"]]
    assert read_groups(CLEAN) == groups


def test_iter_groups_refuses_a_group_that_reappears(tmp_path: Path) -> None:
    lines = [
        json.dumps({**WORKED, "rollout_id": rid, "group_id": gid})
        for rid, gid in [("a", "g1"), ("b", "g2"), ("c", "g1")]
    ]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    with pytest.raises(ValueError, match=r"mixed.jsonl:3: group_id 'g1' reappears .* line 1"):
        read_groups(path)


def test_read_groups_names_file_and_line_of_a_bad_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(WORKED), "", "not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON") as info:
        read_groups(path)
    assert "rltool validate-rollouts" in str(info.value)


def test_iter_samples_is_lazy(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(WORKED), "not json"])
    it = iter_samples(path)
    assert next(it)[1].rollout_id == "r1"  # the bad line is not read yet
    with pytest.raises(ValueError, match=":2: "):
        next(it)


def test_write_rollouts_appends_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "run" / "rollouts" / "step_000001.jsonl"  # parents created
    first = [sample(), sample(rollout_id="r2")]
    second = [sample(rollout_id="r3", group_id="g2", session_id="s1", status=Status.FAILED)]
    assert write_rollouts(path, first) == 2
    assert write_rollouts(path, iter(second)) == 1
    assert path.read_text().count("\n") == 3
    assert read_groups(path) == [first, second]
    assert '"session_id"' not in path.read_text().splitlines()[0]  # absent fields left out


def test_write_rollouts_of_nothing_creates_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    assert write_rollouts(path, []) == 0
    assert path.read_text() == ""
    assert read_groups(path) == []


def test_integer_ids_are_read_and_written_as_strings(tmp_path: Path) -> None:
    """xtuner and many exporters write integer ids: held and written back as strings."""
    record = {**WORKED, "rollout_id": 17, "group_id": 3, "session_id": 0}
    path = write_lines(tmp_path / "ints.jsonl", [json.dumps(record)])
    [(_, s)] = list(iter_samples(path))
    assert (s.rollout_id, s.group_id, s.session_id) == ("17", "3", "0")
    out = tmp_path / "out.jsonl"
    write_rollouts(out, [s])
    written = json.loads(out.read_text())
    assert (written["rollout_id"], written["group_id"], written["session_id"]) == ("17", "3", "0")


@pytest.mark.parametrize(
    ("value", "kind"), [(1.5, "a number"), (True, "a boolean"), (None, "null"), ([1], "a list")]
)
def test_an_id_that_is_no_string_or_integer_is_named(
    tmp_path: Path, value: object, kind: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({**WORKED, "group_id": value})])
    [(_, err)] = list(iter_rollouts(path))
    assert isinstance(err, LineError)
    assert err.field == "group_id"
    assert f"group_id: must be a string or an integer, got {kind}" in err.message
    assert err.rollout_id == WORKED["rollout_id"]


def test_integer_rollout_id_is_named_on_a_bad_line(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "bad.jsonl", [json.dumps({**WORKED, "rollout_id": 9, "labels": 1})]
    )
    [(_, err)] = list(iter_rollouts(path))
    assert isinstance(err, LineError) and err.rollout_id == "9"


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    with pytest.raises(OSError, match="is a FIFO, not a regular file"):
        list(iter_rollouts(fifo))


def foreign_line(rollout_id: str, **fields: object) -> str:
    """The worked sample as xtuner or verl would write it: their own fields beside ours."""
    return json.dumps({**WORKED, "rollout_id": rollout_id, **fields})


def test_foreign_fields_are_kept_in_extra_and_reported_once_per_name(tmp_path: Path) -> None:
    mask = [1, 0, 1]  # WORKED's response: 20 supervised, 21 a tool token, 22 supervised
    path = write_lines(
        tmp_path / "xtuner.jsonl",
        [
            foreign_line("r1", response_mask=mask, agent_loop_type="single_turn"),
            foreign_line("r2", response_mask=mask, agent_loop_type="single_turn", uid="u7"),
            foreign_line("r3", response_mask=mask, uid="u7"),
        ],
    )
    seen: list[tuple[int, str, str]] = []
    items = list(
        iter_rollouts(path, on_foreign=lambda n, name, s: seen.append((n, name, s.rollout_id)))
    )
    samples = [s for _, s in items]
    assert all(isinstance(s, RolloutState) for s in samples)
    assert seen == [(1, "response_mask", "r1"), (1, "agent_loop_type", "r1"), (2, "uid", "r2")]
    assert samples[1].extra == {
        "response_mask": mask,
        "agent_loop_type": "single_turn",
        "uid": "u7",
    }
    # the contract's own fields are read as ever, and written back with extra
    assert samples[2].labels.tolist() == WORKED["labels"]
    again = RolloutState.from_json(samples[2].to_json())
    assert again.extra == {"response_mask": mask, "uid": "u7"}


def test_foreign_fields_merge_into_an_existing_extra(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [foreign_line("r1", extra={"k": 1}, uid="u")])
    ((_, s),) = list(iter_rollouts(path, on_foreign=lambda *a: None))
    assert s.extra == {"k": 1, "uid": "u"}


def test_a_foreign_field_that_extra_already_holds_is_a_line_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [foreign_line("r1", extra={"uid": 1}, uid="u")])
    ((_, err),) = list(iter_rollouts(path, on_foreign=lambda *a: None))
    assert isinstance(err, LineError)
    assert err.message == (
        "not a RolloutState: field 'uid' is not rltool's and extra already holds 'uid'; "
        "rename one of them"
    )


def test_readers_warn_once_per_field_name_by_default(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "verl.jsonl", [foreign_line("r1", uid="a"), foreign_line("r2", uid="a")]
    )
    with pytest.warns(ForeignFieldWarning) as record:
        (group,) = read_groups(path)
    assert [str(w.message) for w in record] == [
        f"{path}:1: field 'uid' is not part of rltool's data contract (verl's prompt id): kept "
        "aside in extra['uid'] (warned once per field name)"
    ]
    assert [s.extra for s in group] == [{"uid": "a"}, {"uid": "a"}]


def test_a_misspelt_field_is_kept_with_a_hint(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", [foreign_line("r1", lables=[1])])
    with pytest.warns(ForeignFieldWarning, match="did you mean 'labels'"):
        ((_, s),) = list(iter_samples(path))
    assert s.extra == {"lables": [1]}


def test_a_field_rltool_defines_nested_in_a_record_is_still_refused(tmp_path: Path) -> None:
    targets = {"kind": "sampled", "token_ids": [[1]], "logprobs": [[0.0]], "topk": 1}
    path = write_lines(tmp_path / "a.jsonl", [foreign_line("r1", teacher_targets=targets)])
    ((_, err),) = list(iter_rollouts(path))
    assert isinstance(err, LineError)
    assert "teacher_targets.topk: Extra inputs are not permitted" in err.message


def test_a_line_that_is_not_utf8_is_named_by_its_byte(tmp_path: Path) -> None:
    # "\xff" inside a string (pydantic: "invalid unicode code point") and first on a line
    # (pydantic: "expected value"): both are named as bytes that are not UTF-8
    good = json.dumps(WORKED).encode()
    inside = good.replace(b'"r1"', b'"r\xff"')
    at = inside.index(b"\xff") + 1
    path = tmp_path / "latin.jsonl"
    path.write_bytes(good + b"\n" + inside + b"\n" + b"\xff{}\n")
    items = list(iter_rollouts(path))
    assert [n for n, _ in items] == [1, 2, 3]
    assert [str(e) for _, e in items[1:]] == [
        f"{path}:2: not valid UTF-8: byte 0xff at byte {at} of the line",
        f"{path}:3: not valid UTF-8: byte 0xff at byte 1 of the line",
    ]
