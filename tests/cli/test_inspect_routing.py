"""``inspect-batch --routing ROLLOUT_ID:POSITION``: one token's experts per MoE layer, as
recorded and as its packed row replays them (input position i is packed position i of the
sample, the last token is no model input)."""

from __future__ import annotations

import json
from pathlib import Path

from cli_runner import run_cli

from rltool.rollout.state import RolloutState


def sample(rid: str, response: list[int], score: float) -> RolloutState:
    prompt = [10, 11, 12]
    ids = prompt + response
    # layer 0: experts (t % 4, 4 + t % 4), layer 1: (t % 3, 3 + t % 3); the last: not routed
    experts = [[[t % 4, 4 + t % 4], [t % 3, 3 + t % 3]] for t in ids[:-1]]
    return RolloutState(
        rollout_id=rid,
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=ids,
        labels=[-100] * 3 + response,
        logprobs=[0.0] * 3 + [-0.5] * len(response),
        routed_experts=[*experts, [[-1, -1], [-1, -1]]],
        reward={"score": score},
        status="COMPLETED",
    )


def routing(tmp_path: Path, *args: str) -> dict:
    path = tmp_path / "r.jsonl"
    path.write_text(sample("a", [20, 21], 1.0).to_json() + "\n" + sample("b", [22], 0.0).to_json())
    result = run_cli(["inspect-batch", path, "--format", "json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_prompt_token_in_a_shared_row(tmp_path: Path) -> None:
    # shared rows: prefix 10 11 (inputs without a target), then a: 12 20, then b: 12
    got = routing(tmp_path, "--routing", "b:1")
    assert got == {
        "rollout_id": "b",
        "position": 1,
        "token": 11,
        "recorded": [[3, 7], [2, 5]],
        "pack": 0,
        "packed_position": 1,  # b reads the tree's prefix
        "replayed": [[3, 7], [2, 5]],
    }
    got = routing(tmp_path, "--routing", "b:2")
    assert (got["token"], got["packed_position"], got["replayed"]) == (12, 4, [[0, 4], [0, 3]])


def test_plain_rows_and_the_last_token(tmp_path: Path) -> None:
    got = routing(tmp_path, "--routing", "a:3", "--prefix-sharing", "off")
    assert (got["token"], got["replayed"]) == (20, [[0, 4], [2, 5]])
    last = routing(tmp_path, "--routing", "a:4")
    assert last["recorded"] == [[-1, -1], [-1, -1]] and last["pack"] is None


def test_rich_view_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(sample("a", [20, 21], 1.0).to_json() + "\n")
    result = run_cli(["inspect-batch", path, "--routing", "a:1"])
    assert result.exit_code == 0, result.output
    assert "routing of a position 1" in result.stdout and "│ [3, 7]" in result.stdout
    bad = run_cli(["inspect-batch", path, "--routing", "a:9"])
    assert bad.exit_code == 1 and "position 9 is past sample a's 5 tokens" in bad.output
    bad = run_cli(["inspect-batch", path, "--routing", "a"])
    assert bad.exit_code == 1 and "give ROLLOUT_ID:POSITION" in bad.output
