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

from rltool.rollout.cached_list import CachedList
from rltool.rollout.contract import check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status


def _flat(values: Any, dtype: type) -> CachedList:
    """A flat list of Python numbers from a list, tuple, numpy array or torch tensor.

    One C-level conversion: no Python loop over tokens on the generation path.
    The list keeps its array, so the step's conversion need not read it back.
    """
    if hasattr(values, "tolist"):  # a tensor (on any device) or an array
        values = values.tolist()
    return CachedList.of(np.asarray(values, dtype=dtype))


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
    prompt = _flat(state.prompt_ids, np.int64)
    if state.response_ids is None:
        if state.response_text is None:
            raise ValueError("response_ids and response_text are both missing")
        if tokenize is None:
            raise ValueError("response_ids missing and no tokenizer to build them from text")
        state.response_ids = list(tokenize(state.response_text))
    response = _flat(state.response_ids, np.int64)
    state.prompt_ids, state.response_ids = prompt, response
    state.input_ids = CachedList.join(prompt, response)
    state.labels = CachedList.join(CachedList.of(np.full(len(prompt), IGNORE_INDEX)), response)
    if response_logprobs is None:
        state.logprobs = None
        return
    lp = _flat(response_logprobs, np.float64)
    if len(lp) != len(response):
        raise ValueError(f"{len(lp)} response logprobs for {len(response)} response tokens")
    state.logprobs = CachedList.join(CachedList.of(np.zeros(len(prompt))), lp)


def canonicalize_prompt_response(
    state: RolloutState,
    response_logprobs: Sequence[float] | None,
    tokenize: Callable[[str], list[int]] | None,
) -> RolloutState:
    """Prompt+response build, then the contract check. Never raises."""
    if state.status == Status.FAILED:
        return state
    try:
        build_prompt_response_fields(state, response_logprobs, tokenize)
    except (ValueError, TypeError) as exc:
        return state.fail(f"canonicalize_train_fields: {exc}")
    return check_train_fields(state)


def check_train_fields(state: RolloutState) -> RolloutState:
    """Check fields built elsewhere (agentic loops); FAILED on a violation."""
    if state.status == Status.FAILED:
        return state
    bad = errors(check_sample(state, require_reward=False))
    if bad:
        return state.fail("contract violation: " + "; ".join(str(v) for v in bad))
    return state
