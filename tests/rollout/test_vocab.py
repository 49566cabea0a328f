"""Invariant 10 (token ids in [0, vocab_size)) in the contract check, and the short reason a
violation gives a failed sample (the same for every sample that breaks one rule)."""

from __future__ import annotations

import json
from pathlib import Path

from rltool.rollout.contract import check_samples, errors
from rltool.rollout.failures import failure_reason
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.rollout.validate import validate_files
from rltool.rollout.vocab import VOCAB_INVARIANT, first_bad_id

X = IGNORE_INDEX


def sample(rid: str, response: list[int], logprobs: list[float] | None = None) -> RolloutState:
    prompt = [1, 2]
    return RolloutState(
        rollout_id=rid,
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=[X, X, *response],
        logprobs=[0.0, 0.0, *(logprobs or [-0.5] * len(response))],
        reward={"score": 1.0},
        status=Status.COMPLETED,
    )


def test_an_id_at_the_vocab_size_is_named_with_sample_field_and_position() -> None:
    samples = [sample("ok", [3, 9]), sample("high", [3, 10, 11]), sample("edge", [9, 9])]
    found = check_samples(samples, vocab_size=10).violations
    assert found[0] == [] and found[2] == []  # 9 = vocab_size - 1 is the last token
    (v,) = found[1]
    assert (v.rollout_id, v.field, v.position, v.invariant) == ("high", "input_ids", 3, 10)
    assert v.message == "token id 10 outside the vocabulary [0, 10)"
    assert str(v) == "high: input_ids[3]: token id 10 outside the vocabulary [0, 10) (invariant 10)"


def test_without_the_vocab_size_only_a_negative_id_is_out_of_range() -> None:
    samples = [sample("big", [3, 10**9]), sample("neg", [3, -7])]
    found = check_samples(samples).violations
    assert found[0] == []
    (v,) = found[1]
    assert (v.position, v.invariant, v.message) == (3, VOCAB_INVARIANT, "token id -7 is negative")


def test_a_negative_prompt_id_is_named_too() -> None:
    s = sample("neg-prompt", [3])
    s.prompt_ids, s.input_ids = [-1, 2], [-1, 2, 3]
    (v,) = errors(check_samples([s], vocab_size=10).violations[0])
    assert (v.field, v.position, v.message) == (
        "input_ids", 0, "token id -1 outside the vocabulary [0, 10)"
    )  # fmt: skip


def test_a_file_with_negative_and_huge_ids_reports_each_not_an_overflow(tmp_path: Path) -> None:
    neg, huge = sample("neg", [3, -3]), sample("huge", [3, 2**40])
    path = tmp_path / "r.jsonl"
    path.write_text(neg.to_json() + "\n" + huge.to_json() + "\n")
    report = validate_files([path], vocab_size=491)
    got = [(v.line, v.rollout_id, v.field, v.position, v.message) for v in report.violations]
    assert got == [
        (1, "neg", "input_ids", 3, "token id -3 outside the vocabulary [0, 491)"),
        (2, "huge", "input_ids", 3, f"token id {2**40} outside the vocabulary [0, 491)"),
    ]
    assert json.loads(path.read_text().splitlines()[1])["input_ids"][3] == 2**40


def test_first_bad_id_of_a_servers_answer() -> None:
    assert first_bad_id([0, 5, 9], 10) is None
    assert first_bad_id([0, 10, -1], 10) == 1
    assert first_bad_id([4, -1], None) == 1
    assert first_bad_id([4, 2**70], 10) == 1  # beyond 64 bits: no OverflowError
    assert first_bad_id([], 10) is None


def test_one_rule_gives_one_reason_whatever_the_sample_or_position() -> None:
    nan = float("nan")
    samples = [
        sample("g0/0", [3, 4], [-0.1, nan]),
        sample("g7/3", [3, 4, 5], [nan, -0.2, -0.3]),
        sample("x", [3, 12]),
    ]
    found = check_samples(samples, vocab_size=10).violations
    reasons = [errors(f)[0].reason for f in found]
    assert reasons == [
        "contract: logprobs finite",
        "contract: logprobs finite",
        "contract: token ids in the vocabulary",
    ]
    for r in reasons:  # a reason survives failure_reason as it is
        assert failure_reason(f"{r} (the whole message: x: y[1]: z (invariant 4))") == r
