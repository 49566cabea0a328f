"""routed_experts in the contract: [T, L, k] with T = len(input_ids), each row all -1 (never
routed) or distinct expert ids in [0, num_experts); checked by validate-rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

from rltool.rollout.contract import check_sample, check_samples
from rltool.rollout.state import RolloutState

DATA = Path(__file__).parents[1] / "data"
WORKED = json.loads((DATA / "validate_clean.jsonl").read_text().splitlines()[0])  # T = 6
GOOD = [[[0, 1], [2, 3]]] * 5 + [[[-1, -1], [-1, -1]]]  # [6, 2 layers, 2]


def routing(rows: list) -> RolloutState:
    return RolloutState.model_validate({**WORKED, "routed_experts": rows})


def found(s: RolloutState, num_experts: int | None = None) -> list[tuple[str, int, int, str]]:
    (vs,) = check_samples([s], num_experts=num_experts).violations
    return [(v.field, v.position, v.invariant, v.message) for v in vs]


def test_a_recording_with_an_unrouted_last_position_is_clean() -> None:
    assert check_sample(routing(GOOD)) == []
    assert found(routing(GOOD), num_experts=4) == []


@pytest.mark.parametrize(
    ("rows", "num_experts", "position", "says"),
    [
        (GOOD[:5], None, None, "length 5 != len(input_ids) 6"),
        ([*GOOD[:2], [[0, 1], [2, 4]], *GOOD[3:]], 4, 2, "not all [0, 4)"),
        ([*GOOD[:2], [[0, 1], [2, 4]], *GOOD[3:]], None, None, None),  # 4 fine: bound unknown
        ([*GOOD[:1], [[0, -1], [2, 3]], *GOOD[2:]], None, 1, "not all >= 0"),
        ([*GOOD[:3], [[0, 1], [3, 3]], *GOOD[4:]], None, 3, "chosen twice in one layer"),
    ],
)
def test_shape_and_ranges_are_named(rows, num_experts, position, says) -> None:
    got = found(routing(rows), num_experts)
    if says is None:
        assert got == []
        return
    [(field, at, _, message)] = got
    assert field == "routed_experts" and at == position and says in message


def test_validate_rollouts_checks_routing_against_num_experts(tmp_path: Path) -> None:
    bad = [*GOOD[:2], [[0, 1], [2, 7]], *GOOD[3:]]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({**WORKED, "routed_experts": bad}) + "\n")
    args = ["validate-rollouts", "--format", "json", str(path)]
    assert run_cli(args).exit_code == 0  # no bound given: 7 may be an expert
    result = run_cli([*args[:1], "--num-experts", "4", *args[1:]])
    assert result.exit_code == 1, result.output
    (v,) = json.loads(result.stdout)["violations"]
    assert (v["field"], v["position"], v["invariant"]) == ("routed_experts", 2, 9)
