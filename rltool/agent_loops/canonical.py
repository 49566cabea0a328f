"""Generation-time canonicalization (data-contract section 3): the per-sample token fields.

The prompt+response build fills ``input_ids``/``labels``/``logprobs`` of a sample
from its prompt and response; agentic loops build the full sequence turn by turn
and only check it. Either way a sample that cannot be built is marked FAILED with
the reason: canonicalization never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rltool.rollout.contract import check_samples, errors
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.rollout.violation import Violation


def _flat_logprobs(values: Any) -> np.ndarray:
    """A flat float64 array from a list, tuple, numpy array or torch tensor (on any device).

    One C-level conversion: no Python loop over tokens on the generation path.
    """
    if hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # a tensor
        values = values.tolist()
    return np.asarray(values, dtype=np.float64).reshape(-1)


def build_prompt_response_fields(
    state: RolloutState,
    response_logprobs: Sequence[float] | None,
    tokenize: Callable[[str], list[int]] | None = None,
) -> None:
    """Fill input_ids/labels/logprobs of a prompt+response sample, in place.

    input_ids = prompt_ids + response_ids, labels = [-100]*P + response_ids,
    logprobs = [0.0]*P + response_logprobs. Raises ValueError on bad input;
    ``canonicalize_train_fields`` turns that into a FAILED sample.
    """
    prompt = state.prompt_ids  # [P], an array since validation
    if state.response_ids is None:
        if state.response_text is None:
            raise ValueError("response_ids and response_text are both missing")
        if tokenize is None:
            raise ValueError("response_ids missing and no tokenizer to build them from text")
        state.response_ids = list(tokenize(state.response_text))
    response = state.response_ids  # [R]
    state.input_ids = np.concatenate([prompt, response])  # [P + R]
    state.labels = np.concatenate([np.full(prompt.size, IGNORE_INDEX), response])  # [P + R]
    if response_logprobs is None:
        state.logprobs = None
        return
    lp = _flat_logprobs(response_logprobs)  # [R]
    if lp.size != response.size:
        raise ValueError(  # counts in parentheses: the short reason stays one per kind
            f"logprob count != token count ({lp.size} response logprobs for {response.size} "
            "response tokens)"
        )
    state.logprobs = np.concatenate([np.zeros(prompt.size), lp])  # [P + R]


def build_or_fail(
    state: RolloutState,
    response_logprobs: Sequence[float] | None,
    tokenize: Callable[[str], list[int]] | None,
) -> RolloutState:
    """The prompt+response build, without the check; FAILED when the fields cannot be
    built. Never raises."""
    if state.status == Status.FAILED:
        return state
    try:
        build_prompt_response_fields(state, response_logprobs, tokenize)
    except (ValueError, TypeError) as exc:
        return state.fail(f"canonicalize: {exc}")  # a prefix short enough for failures.py
    return state


def canonicalize_prompt_response(
    state: RolloutState,
    response_logprobs: Sequence[float] | None,
    tokenize: Callable[[str], list[int]] | None,
    vocab_size: int | None = None,
) -> RolloutState:
    """Prompt+response build, then the contract check. Never raises."""
    return check_train_fields(build_or_fail(state, response_logprobs, tokenize), vocab_size)


def violation_error(bad: Sequence[Violation]) -> str:
    """A FAILED sample's error for its violations: the first one's rule, which is its short
    reason (``contract: logprobs finite``: no sample or position, so failures group),
    then every violation in full."""
    return f"{bad[0].reason} ({'; '.join(str(v) for v in bad)})"


def check_many(states: Sequence[RolloutState], vocab_size: int | None = None) -> None:
    """The contract check of every sample not FAILED yet, in one vectorised call (a loop
    canonicalizes a whole batch: one check per sample costs ~0.4 ms of overhead each);
    a sample that breaks an invariant becomes FAILED with the violations. ``vocab_size``:
    the policy's embedding rows, the bound of token ids (invariant 10), when known."""
    todo = [s for s in states if s.status != Status.FAILED]
    if not todo:
        return
    checked = check_samples(todo, require_reward=False, vocab_size=vocab_size)
    for s, violations in zip(todo, checked.violations, strict=True):
        bad = errors(violations)
        if bad:
            s.fail(violation_error(bad))


def check_train_fields(state: RolloutState, vocab_size: int | None = None) -> RolloutState:
    """Check fields built elsewhere (agentic loops); FAILED on a violation."""
    check_many([state], vocab_size)
    return state
