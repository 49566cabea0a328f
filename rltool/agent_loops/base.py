"""AgentLoop base class: the registry and generation-time canonicalization.

An agent loop turns a task (a prompt, an environment) into RolloutStates and
owns their per-sample token fields (data-contract sections 1 and 3). The base
``canonicalize_train_fields`` is the prompt+response build; agentic loops,
which build the full sequence turn by turn, override it with
``check_train_fields`` that only checks. Either way a sample that cannot be
built is marked FAILED with the reason: canonicalization never raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from rltool.rollout.cached_list import CachedList
from rltool.rollout.contract import check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status

_REGISTRY: dict[str, type[AgentLoop]] = {}


def register_agent_loop(name: str) -> Callable[[type[AgentLoop]], type[AgentLoop]]:
    """Class decorator: make a loop buildable by ``agent_loop.name`` in a recipe."""

    def wrap(cls: type[AgentLoop]) -> type[AgentLoop]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"agent loop {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def known_agent_loops() -> list[str]:
    _import_builtin_loops()
    return sorted(_REGISTRY)


def get_agent_loop(name: str) -> type[AgentLoop]:
    _import_builtin_loops()
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(f"unknown agent loop {name!r}; known agent loops: {known}")
    return _REGISTRY[name]


def _import_builtin_loops() -> None:
    # Importing the modules runs their @register_agent_loop decorators.
    import importlib
    import pkgutil

    import rltool.agent_loops as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"rltool.agent_loops.{mod.name}")


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


class AgentLoop(ABC):
    """Produces the samples of one group and canonicalizes them."""

    name: ClassVar[str] = ""

    @classmethod
    def from_recipe(cls, recipe: Any, *, engine: Any, tokenizer: Any) -> AgentLoop:
        """Build the loop a recipe names; ``agent_loop.options`` become keyword arguments."""
        options = dict(recipe.agent_loop.options)
        try:
            return cls(
                engine=engine, tokenizer=tokenizer, sampling=recipe.rollout.sampling, **options
            )
        except TypeError as exc:
            raise ValueError(f"agent_loop.options for {cls.name!r}: {exc}") from exc

    @abstractmethod
    def generate_groups(
        self, tasks: Sequence[Any], n: int, group_ids: Sequence[str], sampling: Any = None
    ) -> list[list[RolloutState]]:
        """``n`` canonical RolloutStates per task (one prompt group each), batched."""

    def generate_group(self, task: Any, n: int, group_id: str, **kwargs: Any) -> list[RolloutState]:
        return self.generate_groups([task], n, [group_id], **kwargs)[0]

    @staticmethod
    def check_group_args(tasks: Sequence[Any], n: int, group_ids: Sequence[str]) -> None:
        if len(tasks) != len(group_ids):
            raise ValueError(f"{len(tasks)} tasks but {len(group_ids)} group ids")
        if n < 1:
            raise ValueError(f"group size must be >= 1, got {n}")

    def pop_metrics(self) -> dict[str, float]:
        """Counters the loop kept since the last call (e.g. reward/errors), then reset."""
        return {}

    def tokenize_text(self, text: str) -> list[int]:
        raise ValueError(f"agent loop {self.name!r} has no tokenizer for response_text")

    def canonicalize_train_fields(
        self, state: RolloutState, response_logprobs: Sequence[float] | None = None
    ) -> RolloutState:
        """Prompt+response build, then the contract check. Never raises."""
        if state.status == Status.FAILED:
            return state
        try:
            build_prompt_response_fields(state, response_logprobs, self.tokenize_text)
        except (ValueError, TypeError) as exc:
            return state.fail(f"canonicalize_train_fields: {exc}")
        return self.check_train_fields(state)

    def check_train_fields(self, state: RolloutState) -> RolloutState:
        """Check fields built elsewhere (agentic loops); FAILED on a violation."""
        if state.status == Status.FAILED:
            return state
        bad = errors(check_sample(state, require_reward=False))
        if bad:
            return state.fail("contract violation: " + "; ".join(str(v) for v in bad))
        return state
