"""Replay buffer: generated groups waiting between the producer and the trainer.

The buffer holds GROUPS (one ``list[RolloutState]`` per prompt), never loose
samples, in three queues named by what they hold:

- ``completed``: every member COMPLETED; served by ``take`` to build a batch;
- ``aborted``: a member was interrupted (e.g. by a weight sync); the producer
  takes them back with ``take_aborted`` to resume them (partial rollouts);
- ``expired``: groups that grew too stale, reset to their prompts (status
  INIT) with ``expired: retry``; the producer takes them back with
  ``take_expired`` and regenerates them under the same ids.

Staleness (data-contract section 6) is baked into a completed group's labels
when it is ``put`` and again when it is taken, with the train step of that
moment. Clearing is monotone, so the labels a group trains with equal one bake
at the take step. A group expires when any member does; then the WHOLE group
is retried or dropped (``expired: retry | drop``). Resetting the whole group,
not just the expired member, is simplest and safe: a group-relative advantage
needs its members drawn from comparable policies, and a group trains whole or
not at all (contract 5.1). Aborted groups are not baked: a partial group is
baked when it comes back completed.

Groups with a FAILED or FILTERED member are counted and dropped at ``put``:
they would only be skipped by the controller. ``state_dict`` holds every
queued group as JSON lines, so a resumed run loses no generated group.
An optional ``Accounting`` records every move the buffer makes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rltool.config.schema import RecipeConfig
from rltool.produce.result import Accounting, Fate
from rltool.rollout.staleness import StalenessLimits, bake_staleness
from rltool.rollout.state import RolloutState, Status, group_status

Group = list[RolloutState]
ORDERS = ("fifo", "stalest")
EXPIRED_POLICIES = ("retry", "drop")
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

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"replay buffer order must be one of {ORDERS}, got {self.order!r}")
        if self.expired not in EXPIRED_POLICIES:
            raise ValueError(
                f"replay buffer expired policy must be one of {EXPIRED_POLICIES}, "
                f"got {self.expired!r}"
            )

    @classmethod
    def from_recipe(
        cls, recipe: RecipeConfig, order: str = "fifo", expired: str = "retry"
    ) -> BufferConfig:
        """Staleness limits from ``recipe.algorithm``; order and policy given by the producer."""
        return cls(order, expired, StalenessLimits.from_algorithm(recipe.algorithm))


@dataclass(slots=True)
class BufferCounters:
    """Cumulative group counts (stale_tokens: labels cleared), for metrics and checkpoints."""

    put: int = 0
    taken: int = 0
    put_back: int = 0
    retried: int = 0  # expired and reset for regeneration
    dropped: int = 0  # expired and dropped
    failed: int = 0
    filtered: int = 0
    stale_tokens: int = 0


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


def _bakeable(s: RolloutState) -> bool:
    """Lengths that let bake_staleness line steps up with labels; the controller skips
    a sample that breaks them as invalid, so the buffer leaves it untouched."""
    steps, labels = s.response_model_steps, s.labels
    return (
        steps is not None and labels is not None and len(labels) - len(s.prompt_ids) == len(steps)
    )


def _min_model_step(group: Sequence[RolloutState]) -> float:
    """Oldest policy version of any token of the group; +inf without model steps (never stale)."""
    steps = [s.response_model_steps for s in group if s.response_model_steps is not None]
    oldest = [int(x.min()) for x in steps if x.size]
    return min(oldest, default=math.inf)


class ReplayBuffer:
    """Generated groups by queue (completed, aborted, expired); see the module docstring."""

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

        COMPLETED: baked at ``train_step``, then queued (BUFFERED) or expired
        (RETRY or DROPPED); ABORTED: queued to resume; EXPIRED: the expiry rule;
        FAILED / FILTERED: counted and dropped.
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
            if self._bake(group, train_step):
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

    def put_back(self, groups: Sequence[Group]) -> None:
        """Return served, unused COMPLETED groups (a filter's surplus) to the front, in order."""
        for group in groups:
            if not group or group_status(s.status for s in group) != Status.COMPLETED:
                gid = group[0].group_id if group else "(empty)"
                raise ValueError(f"put_back of group {gid}: only served COMPLETED groups go back")
        for group in reversed(groups):
            self._completed.appendleft(group)
            self._note(group, Fate.BUFFERED)
        self.counters.put_back += len(groups)

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

    def expire(self, train_step: int) -> int:
        """Bake every completed group at ``train_step`` and apply the expiry rule; returns how
        many expired. ``take`` does this for what it serves; call it to keep the queue honest."""
        kept: deque[Group] = deque()
        n_expired = 0
        for group in self._completed:
            if self._bake(group, train_step):
                self._expire(group)
                n_expired += 1
            else:
                kept.append(group)
        self._completed = kept
        return n_expired

    # ------------------------------------------------------------ state

    def sizes(self) -> dict[str, int]:
        """Groups queued now, by queue."""
        return {
            "completed": len(self._completed),
            "aborted": len(self._aborted),
            "expired": len(self._expired),
        }

    def rollout_ids(self) -> dict[str, set[str]]:
        """Rollout ids queued now, by queue (for checks against an ``Accounting``)."""
        queues = {"completed": self._completed, "aborted": self._aborted, "expired": self._expired}
        return {name: {s.rollout_id for g in q for s in g} for name, q in queues.items()}

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
        """Bake every member (so the counts are whole); True if any expired.

        Expired members are marked EXPIRED with the reason in ``error``."""
        if not self.cfg.staleness.bakes:
            return False
        expired = False
        for s in group:
            if not _bakeable(s):
                continue
            r = bake_staleness(s, train_step, self.cfg.staleness)
            self.counters.stale_tokens += r.cleared
            if r.expired:
                s.status = Status.EXPIRED
                s.error = (
                    f"expired at train step {train_step}: {r.reason} "
                    f"(oldest token staleness {r.max_staleness})"
                )
                expired = True
        return expired

    def _expire(self, group: Group) -> Fate:
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
