"""RolloutState's token fields: numpy arrays in the program, lists in JSON."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from rltool.rollout.state import RolloutState, TeacherTargets

DATA = Path(__file__).parents[1] / "data"
WORKED = json.loads((DATA / "validate_clean.jsonl").read_text().splitlines()[0])


def sample(**overrides: object) -> RolloutState:
    return RolloutState.model_validate({**WORKED, **overrides})


def test_token_fields_are_arrays_of_one_dtype() -> None:
    s = sample(routed_experts=[[[1, 2], [0, 3]]] * 6)  # [T, L, k]
    for name in ("prompt_ids", "response_ids", "input_ids", "labels", "response_model_steps"):
        a = getattr(s, name)
        assert isinstance(a, np.ndarray) and a.dtype == np.int64 and a.ndim == 1, name
    assert s.logprobs.dtype == np.float64 and s.logprobs.tolist() == WORKED["logprobs"]
    assert s.routed_experts.dtype == np.int64 and s.routed_experts.shape == (6, 2, 2)


@pytest.mark.parametrize(
    "given",
    [
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3], dtype=np.int32),
        torch.tensor([1, 2, 3]),
        [1.0, 2, 3],
    ],
)
def test_ids_from_lists_arrays_and_tensors(given: object) -> None:
    s = sample(prompt_ids=given)
    assert s.prompt_ids.dtype == np.int64 and s.prompt_ids.tolist() == [1, 2, 3]


def test_a_given_array_is_copied_so_each_sample_owns_its_fields() -> None:
    shared = np.array([10, 11, 12])
    a, b = sample(prompt_ids=shared), sample(prompt_ids=shared)
    a.prompt_ids[0] = 99
    assert shared[0] == 10 and b.prompt_ids[0] == 10


@pytest.mark.parametrize(
    ("field", "value", "where", "says"),
    [
        ("prompt_ids", [1, 2.5], ("prompt_ids", 1), "fractional part"),
        ("prompt_ids", [1, "a"], ("prompt_ids", 1), "valid integer"),
        ("labels", [[1], [2]], ("labels", 0), "valid integer"),
        ("logprobs", [0.0, "x"], ("logprobs", 1), "valid number"),
        ("routed_experts", [[[1]], [[2, 3]]], ("routed_experts",), "rows differ in width"),
        ("routed_experts", [[1, 2]], ("routed_experts", 0, 0), "valid list"),
        ("prompt_ids", [2**70], ("prompt_ids",), "does not fit a 64-bit integer"),
    ],
)
def test_bad_values_are_named_with_their_position(
    field: str, value: object, where: tuple, says: str
) -> None:
    with pytest.raises(ValidationError) as info:
        sample(**{field: value})
    err = info.value.errors()[0]
    assert err["loc"] == where and says in err["msg"]


def test_empty_fields_keep_their_dimensions() -> None:
    s = sample(response_model_steps=[], routed_experts=[])
    assert s.response_model_steps.dtype == np.int64 and s.response_model_steps.shape == (0,)
    assert s.routed_experts.shape == (0, 0, 0)


def test_json_is_lists_and_round_trips_nan_and_infinity() -> None:
    s = sample(logprobs=[0.0, 0.0, 0.0, float("nan"), 0.0, -float("inf")])
    line = s.to_json()
    assert '"logprobs":[0.0,0.0,0.0,NaN,0.0,-Infinity]' in line
    assert '"input_ids":[10,11,12,20,21,22]' in line
    back = RolloutState.from_json(line)
    assert back == s  # NaN equals NaN in a record compared by value
    assert back.to_json() == line


def test_json_line_of_the_worked_example() -> None:
    """The JSONL format as it was when token fields were lists, byte for byte."""
    assert sample().to_json() == (
        '{"rollout_id":"r1","group_id":"g1","task_name":"math","prompt_ids":[10,11,12],'
        '"response_ids":[20,21,22],"reward":{"score":1.0},"status":"COMPLETED",'
        '"input_ids":[10,11,12,20,21,22],"labels":[-100,-100,-100,20,-100,22],'
        '"logprobs":[0.0,0.0,0.0,-0.1,0.0,-0.3],"response_model_steps":[0,0,0]}'
    )


def test_assignment_validates_so_fields_stay_arrays() -> None:
    s = sample()
    s.labels = [-100] * 6
    assert isinstance(s.labels, np.ndarray) and s.labels.dtype == np.int64
    with pytest.raises(ValidationError):
        s.labels = ["x"] * 6


def test_equality_compares_values() -> None:
    assert sample() == sample()
    assert sample() != sample(labels=[-100, -100, -100, 20, -100, -100])
    assert sample() != sample(logprobs=None)
    assert sample(input_ids=[10, 11, 12, 20, 21]) != sample()  # shapes differ
    tt = {"kind": "topk", "token_ids": [[1, 2]], "logprobs": [[-0.5, -1.0]]}
    assert TeacherTargets(**tt) == TeacherTargets(**tt)
    assert TeacherTargets(**tt) != TeacherTargets(**{**tt, "logprobs": [[-0.5, -2.0]]})


def test_deepcopy_is_independent() -> None:
    s = sample()
    c = copy.deepcopy(s)
    c.labels[3] = -100
    assert s.labels[3] == 20 and c != s


def test_unpickled_read_only_buffers_become_writable() -> None:
    """Ray hands back arrays backed by its read-only object store; the staleness bake
    writes labels in place, so a record copies such arrays when it is unpickled."""
    s = sample(teacher_targets={"kind": "sampled", "token_ids": [[1]] * 6, "logprobs": [[0.0]] * 6})
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(s, protocol=5, buffer_callback=buffers.append)
    assert buffers  # the arrays travel out of band, as with Ray
    back = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])  # read-only memory
    assert back == s
    back.labels[3] = -100  # writable
    assert back.labels.flags.writeable and back.teacher_targets.logprobs.flags.writeable
