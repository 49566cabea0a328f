"""The AgentLoop interface, what every loop is built with, and the registry of loops.

A recipe names a loop by ``agent_loop.name`` (``AGENT_LOOPS``); ``from_config`` builds it
from ``agent_loop.options`` and a ``LoopContext``. The builds and checks of token fields
are ``rltool.agent_loops.canonical``'s. Design: docs/agent-loops.md#the-agentloop-interface
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from rltool.agent_loops.canonical import canonicalize_prompt_response, check_train_fields
from rltool.config.schema import SamplingConfig
from rltool.engines.base import RolloutEngine
from rltool.registry import Registry
from rltool.rollout.state import RolloutState

L = TypeVar("L", bound="type[AgentLoop]")

AGENT_LOOPS: Registry[type[AgentLoop]] = Registry(
    "agent loop",
    "agent_loop.name",
    builtin_modules=[
        "rltool.agent_loops.gsm8k",
        "rltool.agent_loops.localhost",
        "rltool.agent_loops.openenv",
        "rltool.agent_loops.sandbox",
        "rltool.agent_loops.verl",
        "rltool.agent_loops.verifiers_env",
    ],
)


def register(name: str) -> Callable[[L], L]:
    """Class decorator: the loop that ``agent_loop.name: <name>`` builds."""

    def wrap(cls: L) -> L:
        cls.name = name
        return AGENT_LOOPS.register(name)(cls)

    return wrap


@dataclass(frozen=True, slots=True)
class LoopContext:
    """What every agent loop is built with, whatever its options."""

    engine: RolloutEngine
    tokenizer: Any  # a Hugging Face tokenizer
    sampling: SamplingConfig  # the training sampling (``rollout.sampling``)
    task_name: str  # the RolloutState.task_name of every sample the loop produces


class AgentLoop(ABC):
    """Produces the samples of groups of prompts, canonical, and evaluates on tasks.

    A loop's ``__init__(self, ctx, *, <options>)`` takes its recipe options
    (``agent_loop.options``) as keyword arguments and calls ``super().__init__(ctx)``;
    it validates them with ValueErrors that name ``agent_loop.options.<key>``.
    """

    name: ClassVar[str] = ""  # set by @register

    def __init__(self, ctx: LoopContext) -> None:
        self.engine = ctx.engine
        self.tokenizer = ctx.tokenizer
        self.sampling = ctx.sampling
        self.task_name = ctx.task_name

    @classmethod
    def from_config(cls, options: Mapping[str, Any], ctx: LoopContext) -> Self:
        """The loop with ``options`` as keyword arguments, checked by ``check_options``."""
        cls.check_options(options)
        return cls(ctx, **options)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """An option the loop does not take, or a required one left out, is a ValueError
        naming its recipe key."""
        params = inspect.signature(cls.__init__).parameters
        named = {  # the loop's options: its named parameters after self and ctx
            k: p
            for k, p in list(params.items())[2:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        unknown = sorted(set(options) - set(named))
        if unknown:
            raise ValueError(
                f"agent_loop.options.{unknown[0]}: agent loop {cls.name!r} has no such option; "
                f"its options: {', '.join(named) or 'none'}"
            )
        missing = [k for k, p in named.items() if p.default is p.empty and k not in options]
        if missing:
            raise ValueError(
                f"agent_loop.options.{missing[0]} is required by agent loop {cls.name!r}"
            )

    @classmethod
    def preflight(cls, options: Mapping[str, Any]) -> list[str]:
        """What the loop needs from the machine (programs, packages, importable code) that
        ``options`` do not have, as fix-it sentences; checked before any model loads."""
        return []

    @classmethod
    def record_problem(cls, record: Mapping[str, Any], where: str) -> str | None:
        """Why the loop cannot read a task record (the field and what it must be, after
        ``where``), or None; the fields every record has are ``rltool.data``'s check."""
        return None

    @classmethod
    def prompt_lengths(
        cls, records: Sequence[dict[str, Any]], options: Mapping[str, Any], tokenizer: Any
    ) -> list[int] | None:
        """Each record's prompt tokens exactly as the loop renders them for generation
        (its chat template, ``tokenizer``), or None where the agent renders its own prompt
        at run time (then the records are not checked against the context)."""
        return None

    @abstractmethod
    def generate_groups(
        self,
        tasks: Sequence[dict[str, Any]],
        n: int,
        group_ids: Sequence[str],
        sampling: SamplingConfig | None = None,
    ) -> list[list[RolloutState]]:
        """``n`` canonical RolloutStates per task (one prompt group each), batched;
        ``sampling`` None means the loop's own (``ctx.sampling``)."""

    @abstractmethod
    def evaluate(
        self, tasks: Sequence[dict[str, Any]], sampling: SamplingConfig
    ) -> dict[str, float]:
        """``eval/*`` figures over one sample per task (``eval/accuracy``, ``eval/n``, ...);
        the counters of ``pop_metrics`` are left as they were."""

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
        return canonicalize_prompt_response(
            state, response_logprobs, self.tokenize_text, self.engine.vocab_size
        )

    def check_train_fields(self, state: RolloutState) -> RolloutState:
        """Check fields built elsewhere (agentic loops); FAILED on a violation."""
        return check_train_fields(state, self.engine.vocab_size)
