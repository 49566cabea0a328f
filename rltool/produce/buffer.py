"""Replay buffer: generated groups waiting between the producer and the trainer.

Groups, never loose samples, in three queues: ``completed``, ``aborted``, ``expired``;
staleness is baked once, when ``take`` serves a group for training.
Design: docs/production.md#the-replay-buffer
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rltool.config.schema import RecipeConfig
from rltool.produce.result import Accounting, Fate
from rltool.rollout.staleness import (
    StalenessLimits,
    bake_group,
    can_bake,
    expiry_reason,
    mark_expired,
)
from rltool.rollout.state import RolloutState, Status, group_status

Group = list[RolloutState]
STATE_VERSION = 1

# what a reset keeps: identity, the prompt, and task metadata (e.g. the ground truth)
KEPT_ON_RESET = frozenset(
    {"rollout_id", "group_id", "session_id", "task_name", "agent_loop"}
    | {"messages", "prompt_ids", "extra"}
)


@dataclass(frozen=True, slots=True)
class BufferConfig:
    """How the buffer serves and expires groups."""

    order: str = "fifo"  # fifo: oldest put first | stalest: smallest min model step first
    expired: str = "retry"  # retry: reset to the prompt and regenerate | drop: count and drop
    staleness: StalenessLimits = field(default_factory=StalenessLimits)  # none: never expire

    @classmethod
    def from_recipe(
        cls, recipe: RecipeConfig, order: str = "fifo", expired: str = "retry"
    ) -> BufferConfig:
        """Staleness limits from ``recipe.algorithm``; order and policy given by the producer."""
        return cls(order, expired, StalenessLimits.from_algorithm(recipe.algorithm))


@dataclass(slots=True)
class BufferCounters:
    """Cumulative group counts (stale_tokens: labels cleared; expired_samples: samples of the
    groups that expired, on put or on take), for metrics and checkpoints."""

    put: int = 0
    taken: int = 0
    retried: int = 0  # expired and reset for regeneration
    dropped: int = 0  # expired and dropped
    failed: int = 0
    filtered: int = 0
    stale_tokens: int = 0
    expired_samples: int = 0


def reset_to_prompt(state: RolloutState) -> RolloutState:
    """Clear everything generated, in place: status INIT, only ``KEPT_ON_RESET`` fields stay.

    ``messages`` is kept as recorded; a loop that appended the assistant turn to
    it regenerates from its task (or ``prompt_ids``), not from these messages.
    """
    for name, info in RolloutState.model_fields.items():
        if name not in KEPT_ON_RESET:
            setattr(state, name, info.get_default())
    state.status = Status.INIT
    return state


def _min_model_step(group: Sequence[RolloutState]) -> float:
    """Oldest policy version of any token of the group; +inf without model steps (never stale)."""
    steps = [s.response_model_steps for s in group if s.response_model_steps is not None]
    oldest = [int(x.min()) for x in steps if x.size]
    return min(oldest, default=math.inf)


class ReplayBuffer:
    """Generated groups by queue: completed, aborted, expired (docs/production.md)."""

    def __init__(self, cfg: BufferConfig | None = None, accounting: Accounting | None = None):
        self.cfg = cfg or BufferConfig()
        self.accounting = accounting
        self.counters = BufferCounters()
        self._completed: deque[Group] = deque()
        self._aborted: deque[Group] = deque()
        self._expired: deque[Group] = deque()

    # ------------------------------------------------------------ in

    def put(self, group: Group, train_step: int) -> Fate:
        """File one generated group by its status; returns where it went.

        COMPLETED: queued (BUFFERED), or expired (RETRY or DROPPED) when its staleness
        at ``train_step`` already expires it (read, not baked); ABORTED: queued to resume;
        EXPIRED: the expiry rule; FAILED / FILTERED: counted and dropped.
        """
        if not group:
            raise ValueError("replay buffer: put of an empty group; a group needs its samples")
        status = group_status(s.status for s in group)
        if status == Status.INIT:
            raise ValueError(
                f"group {group[0].group_id} has members never generated (INIT); "
                "put only groups the agent loop returned"
            )
        self.counters.put += 1
        if status == Status.COMPLETED:
            if self._check_expiry(group, train_step):
                return self._expire(group)
            self._completed.append(group)
            return self._note(group, Fate.BUFFERED)
        if status == Status.ABORTED:
            self._aborted.append(group)
            return self._note(group, Fate.BUFFERED)
        if status == Status.EXPIRED:
            return self._expire(group)
        if status == Status.FAILED:
            self.counters.failed += 1
            return self._note(group, Fate.FAILED)
        assert status == Status.FILTERED, status
        self.counters.filtered += 1
        return self._note(group, Fate.FILTERED)

    # ------------------------------------------------------------ out

    def take(self, n: int, train_step: int) -> list[Group]:
        """Up to ``n`` completed groups in the configured order, baked at ``train_step``.

        A group that expires on the way follows the expiry rule and the next
        one is served instead; fewer than ``n`` come back when the buffer runs
        short. The groups left keep their FIFO order.
        """
        if n < 0:
            raise ValueError(f"replay buffer: take of {n} groups; n must be >= 0")
        queue = list(self._completed)
        order = range(len(queue))
        if self.cfg.order == "stalest":
            order = sorted(order, key=lambda i: _min_model_step(queue[i]))  # stable: FIFO ties
        served: list[Group] = []
        gone: set[int] = set()
        for i in order:
            if len(served) == n:
                break
            gone.add(i)
            if self._bake(queue[i], train_step):
                self._expire(queue[i])
            else:
                served.append(queue[i])
        self._completed = deque(g for i, g in enumerate(queue) if i not in gone)
        self.counters.taken += len(served)
        for group in served:
            self._note(group, Fate.TAKEN)
        return served

    def take_aborted(self, n: int | None = None) -> list[Group]:
        """Aborted groups (oldest first) for the producer to resume."""
        return self._pop(self._aborted, n)

    def take_expired(self, n: int | None = None) -> list[Group]:
        """Groups reset to their prompts (oldest first) for the producer to regenerate."""
        return self._pop(self._expired, n)

    # ------------------------------------------------------------ state

    def sizes(self) -> dict[str, int]:
        """Groups queued now, by queue."""
        return {
            "completed": len(self._completed),
            "aborted": len(self._aborted),
            "expired": len(self._expired),
        }

    def queued(self) -> list[Group]:
        """Every group queued now: completed, aborted, expired."""
        return [*self._completed, *self._aborted, *self._expired]

    def metrics(self) -> dict[str, float]:
        out = {f"buffer/{name}": float(n) for name, n in self.sizes().items()}
        out |= {f"buffer/{name}_total": float(n) for name, n in asdict(self.counters).items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: every queued group as a list of RolloutState JSON lines."""

        def dump(q: deque[Group]) -> list[list[str]]:
            return [[s.to_json() for s in g] for g in q]

        return {
            "version": STATE_VERSION,
            "completed": dump(self._completed),
            "aborted": dump(self._aborted),
            "expired": dump(self._expired),
            "counters": asdict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a ``state_dict``; the config stays this buffer's."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"replay buffer state version {state.get('version')!r}, this rltool reads "
                f"{STATE_VERSION}; the checkpoint was written by another rltool version"
            )

        def load(rows: Iterable[list[str]]) -> deque[Group]:
            return deque([RolloutState.from_json(line) for line in g] for g in rows)

        self._completed = load(state["completed"])
        self._aborted = load(state["aborted"])
        self._expired = load(state["expired"])
        known = {f.name for f in fields(BufferCounters)}
        counters = {k: int(v) for k, v in state["counters"].items() if k in known}
        self.counters = BufferCounters(**counters)

    # ------------------------------------------------------------ internals

    def _note(self, group: Group, fate: Fate) -> Fate:
        if self.accounting is not None:
            self.accounting.move(group, fate)
        return fate

    def _bake(self, group: Group, train_step: int) -> bool:
        """Mark stale tokens of every member as not trained (``bake_group``, the one rule
        inspect-batch also applies); True if any member expired (marked EXPIRED)."""
        baked = bake_group(group, train_step, self.cfg.staleness)
        self.counters.stale_tokens += baked.cleared
        return baked.expired

    def _check_expiry(self, group: Group, train_step: int) -> bool:
        """Whether any member is already too stale at ``train_step`` (nothing is baked);
        expired members are marked EXPIRED with the reason."""
        expired = False
        for s in group:
            reason = expiry_reason(s, train_step, self.cfg.staleness) if can_bake(s) else None
            if reason is not None:
                mark_expired(s, train_step, reason)
                expired = True
        return expired

    def _expire(self, group: Group) -> Fate:
        self.counters.expired_samples += len(group)
        if self.cfg.expired == "drop":
            self.counters.dropped += 1
            return self._note(group, Fate.DROPPED)
        for s in group:
            reset_to_prompt(s)
        self._expired.append(group)
        self.counters.retried += 1
        return self._note(group, Fate.RETRY)

    def _pop(self, queue: deque[Group], n: int | None) -> list[Group]:
        if n is not None and n < 0:
            raise ValueError(f"replay buffer: take of {n} groups; n must be >= 0")
        count = len(queue) if n is None else min(n, len(queue))
        out = [queue.popleft() for _ in range(count)]
        for group in out:
            self._note(group, Fate.PENDING)
        return out
