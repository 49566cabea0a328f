"""Token-exact recording of one agent session, turn by turn.

Each turn appends only what the new render adds to the recorded tokens; the engine is fed
the recorded ids, never a re-render. A render that does not extend the recording starts a
new segment. Design: docs/agent-loops.md#token-exact-session-recording
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rltool.engines.base import Generation
from rltool.rollout.state import IGNORE_INDEX

Decode = Callable[[Sequence[int]], str]  # token ids -> text, special tokens kept
ENV_STEP = -1  # model step recorded at environment tokens (filled in at export)


@dataclass(slots=True)
class Segment:
    """One trainable segment: a contiguous token sequence the model saw."""

    prompt_len: int  # P: tokens of the segment's first render
    ids: list[int]  # [T] everything the model saw and produced
    labels: list[int]  # [T] the id at generated tokens, -100 elsewhere
    logprobs: list[float]  # [T] engine logprob at generated tokens, 0.0 elsewhere
    steps: list[int]  # [T] model step at generated tokens, ENV_STEP elsewhere
    num_turns: int = 0  # generations recorded
    tool_turns: int = 0  # generations that called at least one tool
    messages: list[dict[str, Any]] = field(default_factory=list)  # last request + its reply
    reply_text: str | None = None  # text of the last generation
    finish_reason: str | None = None  # of the last generation
    # per generation that recorded MoE routing, its [C + n, L, k] (context + generated tokens)
    routings: list[np.ndarray] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> Segment:
        n = len(prompt_ids)
        return cls(n, list(prompt_ids), [IGNORE_INDEX] * n, [0.0] * n, [ENV_STEP] * n)

    def append_env(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.ids += ids
        self.labels += [IGNORE_INDEX] * n
        self.logprobs += [0.0] * n
        self.steps += [ENV_STEP] * n

    def append_generation(self, gen: Generation) -> None:
        n = len(gen.token_ids)
        if len(gen.logprobs) != n or len(gen.model_steps) != n:
            raise ValueError(
                f"engine returned {n} tokens, {len(gen.logprobs)} logprobs and "
                f"{len(gen.model_steps)} model steps; the engine must return one of each per token"
            )
        if gen.routed_experts is not None:
            if len(gen.routed_experts) != len(self.ids) + n:
                raise ValueError(
                    f"engine returned routing for {len(gen.routed_experts)} positions; the turn "
                    f"has {len(self.ids)} context and {n} generated tokens"
                )
            self.routings.append(gen.routed_experts)
        self.ids += gen.token_ids
        self.labels += gen.token_ids
        self.logprobs += gen.logprobs
        self.steps += gen.model_steps


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))  # [n] compared
    return int(diff[0]) if diff.size else n


def aligned_suffix(
    recorded: Sequence[int], prompt: Sequence[int], decode: Decode
) -> list[int] | None:
    """The tokens of ``prompt`` that extend ``recorded``; None when it does not extend it.

    Token prefix first; otherwise the diverging tail of ``recorded`` must decode
    to the text of a whole-token prefix of the diverging part of ``prompt``.
    """
    k = common_prefix_len(recorded, prompt)
    if k == len(recorded):
        return list(prompt[k:])
    tail = decode(recorded[k:])
    if not tail or not decode(prompt[k:]).startswith(tail):
        return None
    lo, hi = k + 1, len(prompt)  # smallest j whose decoded prompt[k:j] covers the tail
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(prompt[k:mid])) >= len(tail):
            hi = mid
        else:
            lo = mid + 1
    return list(prompt[lo:]) if decode(prompt[k:lo]) == tail else None


@dataclass(frozen=True, slots=True)
class Turn:
    """A planned turn, committed to the session only once the engine returned."""

    segment: int  # index into Session.segments; == len(segments) for a new segment
    env_ids: list[int]  # tokens appended before the generation (the whole prompt if new)
    context: list[int]  # the ids the engine generates from


class Session:
    """The segments recorded for one session id. One turn at a time (``lock``)."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.segments: list[Segment] = []
        self.error: str | None = None  # set when a turn failed in the engine
        self.lock = threading.Lock()

    @property
    def num_turns(self) -> int:
        return sum(s.num_turns for s in self.segments)

    def plan(self, prompt_ids: Sequence[int], decode: Decode) -> Turn:
        """Extend the current segment with the render, or start a new one (rewrite)."""
        if self.segments:
            current = self.segments[-1]
            suffix = aligned_suffix(current.ids, prompt_ids, decode)
            if suffix is not None:
                return Turn(len(self.segments) - 1, suffix, current.ids + suffix)
        return Turn(len(self.segments), list(prompt_ids), list(prompt_ids))

    def commit(
        self, turn: Turn, gen: Generation, messages: list[dict[str, Any]], tool_call: bool
    ) -> Segment:
        """Record the planned environment tokens and the generation."""
        if turn.segment == len(self.segments):
            self.segments.append(Segment.start(turn.env_ids))
        else:
            assert turn.segment == len(self.segments) - 1, "a turn must extend the last segment"
            self.segments[turn.segment].append_env(turn.env_ids)
        seg = self.segments[turn.segment]
        assert seg.ids == turn.context, "the segment changed between plan and commit"
        seg.append_generation(gen)
        seg.num_turns += 1
        seg.tool_turns += int(tool_call)
        seg.messages = messages
        seg.reply_text = gen.text
        seg.finish_reason = gen.finish_reason
        return seg
