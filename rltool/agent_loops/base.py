"""AgentLoop base class and the registry of loops (``agent_loop.name`` in a recipe).

An agent loop turns a task (a prompt, an environment) into RolloutStates and
owns their per-sample token fields (data-contract sections 1 and 3); the builds
and checks themselves are ``rltool.agent_loops.canonical``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rltool.agent_loops.canonical import canonicalize_prompt_response, check_train_fields
from rltool.rollout.state import RolloutState

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
        return canonicalize_prompt_response(state, response_logprobs, self.tokenize_text)

    def check_train_fields(self, state: RolloutState) -> RolloutState:
        """Check fields built elsewhere (agentic loops); FAILED on a violation."""
        return check_train_fields(state)
