"""Recording rules on a toy vocabulary whose decode is hand-checkable."""

from __future__ import annotations

import pytest

from rltool.engines.base import Generation
from rltool.sessions.session import ENV_STEP, Session, aligned_suffix, common_prefix_len

VOCAB = {1: "a", 2: "b", 3: "ab", 4: "c", 5: "<e>", 6: "d"}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


def gen(ids: list[int], lp: list[float], step: int) -> Generation:
    return Generation(ids, lp, [step] * len(ids), "stop", decode(ids))


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 4], [1, 2, 6, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 4]) == 2
    assert common_prefix_len([], [1]) == 0


@pytest.mark.parametrize(
    ("recorded", "prompt", "expected"),
    [
        ([1, 2], [1, 2, 4], [4]),  # token prefix: append the suffix
        ([1, 2], [1, 2], []),  # nothing new
        ([1, 2], [3, 4], [4]),  # recorded "a"+"b", re-encoded "ab": same text, keep ours
        ([3], [1, 2, 4, 5], [4, 5]),  # recorded "ab", re-encoded "a"+"b"
        ([6, 3], [6, 1, 2, 4], [4]),  # divergence after a common prefix
        ([1, 2, 4], [3, 5], None),  # "abc" vs "ab<e>": a rewrite
        ([1, 2], [1], None),  # the prompt dropped recorded text
        ([1, 2], [6, 2, 4], None),  # edited history
    ],
)
def test_aligned_suffix(recorded, prompt, expected):
    assert aligned_suffix(recorded, prompt, decode) == expected


def test_turns_extend_then_rewrite_leaves_old_segment_untouched():
    s = Session("ep")
    t0 = s.plan([6, 1], decode)
    assert (t0.segment, t0.env_ids, t0.context) == (0, [6, 1], [6, 1])
    s.commit(t0, gen([2, 5], [-0.5, -0.25], 7), [{"role": "user"}], tool_call=True)
    t1 = s.plan([6, 3, 5, 4, 4], decode)  # "a"+"b" re-encoded as "ab": same text
    assert (t1.segment, t1.env_ids, t1.context) == (0, [4, 4], [6, 1, 2, 5, 4, 4])
    s.commit(t1, gen([6, 5], [-1.0, -2.0], 8), [], tool_call=False)
    seg = s.segments[0]
    assert seg.ids == [6, 1, 2, 5, 4, 4, 6, 5]
    assert seg.labels == [-100, -100, 2, 5, -100, -100, 6, 5]
    assert seg.logprobs == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
    assert seg.steps == [ENV_STEP, ENV_STEP, 7, 7, ENV_STEP, ENV_STEP, 8, 8]
    assert (seg.prompt_len, seg.num_turns, seg.tool_turns) == (2, 2, 1)

    snapshot = (list(seg.ids), list(seg.labels), list(seg.logprobs), list(seg.steps))
    t2 = s.plan([6, 4], decode)  # history rewritten: not an extension
    assert (t2.segment, t2.env_ids, t2.context) == (1, [6, 4], [6, 4])
    s.commit(t2, gen([1], [-0.125], 9), [], tool_call=False)
    assert (seg.ids, seg.labels, seg.logprobs, seg.steps) == snapshot
    assert s.segments[1].ids == [6, 4, 1]
    assert s.segments[1].prompt_len == 2
    assert s.num_turns == 3


def test_failed_generation_leaves_no_trace():
    s = Session("ep")
    s.commit(s.plan([6], decode), gen([1], [-0.1], 0), [], tool_call=False)
    s.plan([6, 1, 4], decode)  # planned, but the engine failed: never committed
    assert s.segments[0].ids == [6, 1]


def test_engine_with_mismatched_lengths_is_refused():
    s = Session("ep")
    bad = Generation([1, 2], [-0.1], [0, 0], "stop", "ab")
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        s.commit(s.plan([6], decode), bad, [], tool_call=False)
