"""inspect-batch and the replay buffer mark the same tokens stale: same samples, same train
step, same limits -> the same labels, the same stale positions, the same expired groups and
the same counts. The two call one function (``rollout.staleness.bake_group``); this test
fails if either grows its own copy of the rule.

Samples (P = 2): g-old has tokens made at steps 0..3, g-mixed at 1, 4, 4 with a tool
token (label -100) in the middle, g-new at step 4, g-none no model steps (never stale).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from cli_runner import run_cli

from rltool.cli.inspect_batch import bake_groups
from rltool.produce.buffer import BufferConfig, ReplayBuffer
from rltool.rollout.io import write_rollouts
from rltool.rollout.staleness import StalenessLimits
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status

TRAIN_STEP = 5


def _sample(rid: str, gid: str, response: list[int], labels_R: list[int], steps, score: float):
    prompt = [10, 11]
    return RolloutState(
        rollout_id=rid,
        group_id=gid,
        task_name="t",
        prompt_ids=prompt,
        response_ids=response,
        finish_reason="stop",
        reward={"score": score},
        status=Status.COMPLETED,
        input_ids=prompt + response,
        labels=[IGNORE_INDEX] * 2 + labels_R,
        logprobs=[0.0] * 2 + [-0.5 if x != IGNORE_INDEX else 0.0 for x in labels_R],
        response_model_steps=steps,
    )


def _groups() -> list[list[RolloutState]]:
    old = [20, 21, 22, 2]
    mixed = [30, 31, 32, 2]
    return [
        [_sample(f"old-{i}", "g-old", old, old, [0, 1, 2, 3], float(i)) for i in range(2)],
        [
            _sample("mixed-0", "g-mixed", mixed, [30, IGNORE_INDEX, 32, 2], [1, 1, 4, 4], 1.0),
            _sample("mixed-1", "g-mixed", mixed, mixed, [4, 4, 4, 4], 0.0),
        ],
        [_sample(f"new-{i}", "g-new", [40, 2], [40, 2], [4, 4], float(i)) for i in range(2)],
        [_sample(f"none-{i}", "g-none", [50, 2], [50, 2], None, float(i)) for i in range(2)],
    ]


def _by_buffer(limits: StalenessLimits) -> tuple[dict[str, list[int]], set[str], int]:
    """Labels of the served samples, the groups it expired, the stale tokens it counted."""
    groups = _groups()
    buffer = ReplayBuffer(BufferConfig(expired="drop", staleness=limits))
    for g in groups:
        buffer.put(g, train_step=1)  # early enough that nothing expires on arrival
    served = buffer.take(len(groups), TRAIN_STEP)
    labels = {s.rollout_id: s.labels.tolist() for g in served for s in g}
    expired = {g[0].group_id for g in groups} - {g[0].group_id for g in served}
    return labels, expired, buffer.counters.stale_tokens


LIMITS = [
    StalenessLimits(max_token_staleness=0),
    StalenessLimits(max_token_staleness=1),
    StalenessLimits(max_staleness=3),
    StalenessLimits(max_staleness=1, max_token_staleness=0, sync_interval=2),
    StalenessLimits(max_token_staleness=0, sync_interval=3),
]


@pytest.mark.parametrize("limits", LIMITS, ids=repr)
def test_inspect_batch_marks_what_the_buffer_marks(tmp_path, limits: StalenessLimits) -> None:
    labels, expired, stale_tokens = _by_buffer(limits)
    assert expired or stale_tokens, "a case where nothing is stale tests nothing"

    rollouts = tmp_path / "rollouts.jsonl"
    write_rollouts(rollouts, [s for g in _groups() for s in g])
    options = ["--train-step", str(TRAIN_STEP), "--sync-interval", str(limits.sync_interval)]
    for name in ("max_staleness", "max_token_staleness"):
        if getattr(limits, name) is not None:
            options += [f"--{name.replace('_', '-')}", str(getattr(limits, name))]
    args = ["inspect-batch", str(rollouts), *options, "--format", "json"]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)

    # the targets the loss sees are the buffer's labels, shifted
    targets = {s["rollout_id"]: s["targets"] for s in shown["samples"]}
    assert targets == {rid: x[1:] for rid, x in labels.items()}
    assert {g["group_id"] for g in shown["skipped_groups"] if g["reason"] == "expired"} == expired
    assert shown["data_info"]["staleness/stale_tokens"] == stale_tokens

    # the positions the view draws as stale are those the buffer cleared
    before = {s.rollout_id: s.labels.copy() for g in _groups() for s in g}
    baked = bake_groups(copy.deepcopy(_groups()), TRAIN_STEP, limits)
    for rid, after in labels.items():
        cleared_T = before[rid] != np.asarray(after)  # [T]
        assert baked.stale.get(rid, np.zeros_like(cleared_T)).tolist() == cleared_T.tolist()
