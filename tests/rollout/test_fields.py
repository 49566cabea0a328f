"""concat_fields: many samples' token fields concatenated once, by hand."""

from __future__ import annotations

import numpy as np
import pytest

import rltool.rollout.fields as fields_module
from rltool.rollout.fields import Block, concat_fields, first_per_segment, segments
from rltool.rollout.state import IGNORE_INDEX, RolloutState

X = IGNORE_INDEX


def state(
    rid: str, prompt: list[int], response: list[int], labels: list[int], **kw
) -> RolloutState:
    return RolloutState(
        rollout_id=rid,
        group_id="g",
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=labels,
        **kw,
    )


@pytest.mark.parametrize("block", [1, 4, fields_module.BLOCK_TOKENS])
def test_two_samples_by_hand(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fields_module, "BLOCK_TOKENS", block)
    a = state("a", [1, 2], [3, 4, 5], [X, X, 3, X, 5], logprobs=[0, 0, -0.5, 0, -0.25])
    b = state("b", [], [6, 7], [6, 7], response_model_steps=[2, 3])  # no logprobs, P = 0
    seen: list[tuple[list[int], list[int]]] = []

    def scan(blk: Block) -> None:
        seen.append((list(blk.samples), blk.input_ids.tolist()))

    f = concat_fields([a, b], scan=scan)
    assert (f.T_S.tolist(), f.P_S.tolist(), f.start_S.tolist()) == ([5, 2], [2, 0], [0, 5])
    assert f.input_ids_F.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert f.labels_F.tolist() == [X, X, 3, X, 5, 6, 7]
    assert f.logprobs_F.tolist() == [0, 0, -0.5, 0, -0.25, 0, 0]  # b has none: zeros
    assert f.supervised_F.tolist() == [0, 0, 1, 0, 1, 1, 1, 0]  # one False past the end
    assert (f.prompt_supervised_S.tolist(), f.response_supervised_S.tolist()) == ([0, 0], [2, 2])
    assert (f.steps_start_S.tolist(), f.steps.tolist()) == ([-1, 0], [2, 3])
    # the blocks cover the samples whole and in order, each scanned once
    assert [i for members, _ in seen for i in members] == [0, 1]
    assert [t for _, ids in seen for t in ids] == f.input_ids_F.tolist()
    assert len(seen) == (2 if block < 5 else 1)
    two = f.take(np.array([1]))
    assert (two.T_S.tolist(), two.start_S.tolist()) == ([2], [5])
    assert two.input_ids_F is f.input_ids_F  # shared, not copied


def test_no_samples() -> None:
    f = concat_fields([])
    assert f.T_S.size == f.input_ids_F.size == f.steps.size == 0
    assert f.supervised_F.tolist() == [False]


def test_segments_and_first_per_segment() -> None:
    assert segments(np.array([10, 3]), np.array([2, 3])).tolist() == [10, 11, 3, 4, 5]
    # segments begin at 0, 4, 4 (empty), 6; positions 1, 2, 7 -> segment 0 at 1, segment 3 at 1
    segs, at = first_per_segment(np.array([1, 2, 7]), np.array([0, 4, 4, 6]))
    assert (segs.tolist(), at.tolist()) == ([0, 3], [1, 1])
