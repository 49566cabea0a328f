"""The producer: prompts in, one train batch per step out, through a rollout backend.

``sync`` (generate, train, repeat) or ``async`` (generation runs ahead of training by
``produce.max_inflight_steps``); every sample is accounted for.
Design: docs/production.md#the-producer
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.lora import rollout_state_dict
from rltool.metric_names import EXPIRED_SAMPLES, STALE_TOKENS
from rltool.produce.backend import GroupOutcome, GroupRequest, RolloutBackend
from rltool.produce.buffer import BufferConfig, ReplayBuffer
from rltool.produce.filters import GROUP_FILTERS, apply_group_filter, oversample
from rltool.produce.result import (
    Accounting,
    Fate,
    GroupError,
    ProduceBatchResult,
    failure_metrics,
    produced_totals,
    rollout_metrics,
    staleness_metrics,
    time_stats,
)
from rltool.produce.task_metrics import per_task_metrics
from rltool.produce.task_sampler import TaskSampler
from rltool.produce.worker import FINISHED_AT
from rltool.rollout.state import RolloutState

Group = list[RolloutState]
MODES = ("sync", "async")
MAX_REFILLS = 4  # extra draws in one step when the filter leaves the batch short
STATE_VERSION = 1


@dataclass(slots=True)
class _Tally:
    """What happened between two batches: groups that came back and where they went."""

    generated: list[Group] = field(default_factory=list)
    gen_times: list[float] = field(default_factory=list)
    loop_metrics: dict[str, float] = field(default_factory=dict)  # summed over outcomes
    expired_groups: int = 0  # too stale on arrival or when served: retried or dropped
    expired_samples: int = 0  # their samples
    failed: list[Group] = field(default_factory=list)  # groups filed FAILED (samples: why)
    filtered_groups: int = 0
    errors: list[GroupError] = field(default_factory=list)  # every error outcome
    refills: int = 0


def _request_state(r: GroupRequest) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    out["sampling"] = None if r.sampling is None else dataclasses.asdict(r.sampling)
    return out


def _request_from_state(d: Mapping[str, Any]) -> GroupRequest:
    sampling = None if d["sampling"] is None else SamplingConfig(**d["sampling"])
    return GroupRequest(**{**d, "sampling": sampling})


def failed_group(request: GroupRequest, rollout_ids: Sequence[str], error: str) -> Group:
    """The record of a group that never came back: FAILED samples under its ids."""
    return [
        RolloutState(
            rollout_id=rid, group_id=request.group_id, task_name=request.task_name, prompt_ids=[]
        ).fail(error)
        for rid in rollout_ids
    ]


class Producer:
    """Builds each step's batch from a backend, a replay buffer and a task sampler."""

    def __init__(
        self,
        recipe: RecipeConfig,
        backend: RolloutBackend,
        sampler: TaskSampler,
        scorer: Any = None,
    ):
        p = recipe.produce
        if p.mode not in MODES:
            raise ValueError(f"produce.mode must be one of {MODES}, got {p.mode!r}")
        if p.max_inflight_steps < 1:
            raise ValueError(f"produce.max_inflight_steps must be >= 1, got {p.max_inflight_steps}")
        GROUP_FILTERS.get(p.group_filter)  # an unknown name fails now, not at step 1
        self.backend, self.sampler, self.scorer = backend, sampler, scorer
        self.concurrent = p.mode == "async"
        self.lookahead = p.max_inflight_steps if self.concurrent else 0
        self.sync_interval = recipe.algorithm.sync_interval
        self.target = recipe.data.prompts_per_step
        self.group_size = recipe.data.group_size
        self.fraction = p.oversample
        self.filter = p.group_filter
        self.accounting = Accounting()
        buffer_cfg = BufferConfig.from_recipe(recipe, order=p.buffer_order, expired=p.expired)
        self.buffer = ReplayBuffer(buffer_cfg, accounting=self.accounting)
        self._open: dict[str, GroupRequest] = {}  # every group not yet trained/filtered/...
        self._in_flight: dict[str, None] = {}  # submitted, not come back (ordered set)
        self._retry_ids: dict[str, list[str]] = {}  # regenerating group -> its PENDING ids
        self._errored: set[str] = set()  # groups whose generation failed once
        self._drawn_groups = 0  # groups drawn ever: makes group ids unique
        self._served_step = 0  # the step of the last batch served
        self._carry = _Tally()  # outcomes that came back between two produce calls
        self._busy_at_return = False  # generation in flight when the last batch was served
        self.errors: list[GroupError] = []  # error outcomes of the last produce call

    # ------------------------------------------------------------ the strategy

    def produce(self, train_step: int) -> ProduceBatchResult:
        """The batch of ``train_step`` (its groups generated by weights < train_step)."""
        t0 = time.perf_counter()
        tally, self._carry = self._carry, _Tally()
        stale_before = self.buffer.counters.stale_tokens
        self._served_step = train_step
        self._top_up(train_step, steps=1)  # this step's prompts, unless drawn ahead
        batch = self._fill(train_step, tally)
        self._top_up(train_step + 1, steps=self.lookahead)  # async: generate while we train
        self._busy_at_return = self.backend.in_flight > 0
        self.errors = tally.errors
        stale = self.buffer.counters.stale_tokens - stale_before
        return self._result(batch, tally, train_step, stale, time.perf_counter() - t0)

    def update_weights(self, model: torch.nn.Module, train_step: int, force: bool = False) -> None:
        """After a train step: hand the weights over every ``sync_interval`` steps (every
        step in sync mode, where generation must be on-policy)."""
        if force or not self.concurrent or train_step % self.sync_interval == 0:
            # a LoRA policy's adapters merged in, under the base names (rltool/lora.py);
            # a backend sharing the model object reads nothing from the state dict
            shared = self.backend.shares_model
            weights = model.state_dict() if shared else rollout_state_dict(model)
            self.backend.update_weights(weights, train_step)

    def generation_overlap(self, start: float, end: float) -> float:
        """Seconds of [start, end] (``time.time()``, the training of a step) during which
        the backend was generating; picks up the groups that finished meanwhile."""
        if not self._busy_at_return:
            return 0.0
        ends = [
            o.metrics[FINISHED_AT]
            for o in self._receive_ready(self._carry)
            if o.metrics.get(FINISHED_AT)
        ]
        busy_until = end if self.backend.in_flight else max(ends, default=start)
        return max(0.0, min(end, busy_until) - start)

    # ------------------------------------------------------------ drawing prompts

    def _top_up(self, step: int, steps: int) -> None:
        """Draw new prompts (labelled ``step``) until the groups buffered or in flight
        cover ``steps`` over-sampled batches."""
        have = self.backend.in_flight + self.buffer.sizes()["completed"]
        want = oversample(self.target, self.fraction) * steps
        if want > have:
            self._submit_new(want - have, step)

    def _submit_new(self, n_groups: int, step: int) -> None:
        requests = []
        for task_name, index, row in self.sampler.take(n_groups):
            gid = f"s{step}-g{self._drawn_groups}-p{index}"
            self._drawn_groups += 1
            requests.append(GroupRequest(task_name, row, gid, self.group_size))
        self._submit(requests)

    def _submit(self, requests: Sequence[GroupRequest]) -> None:
        for r in requests:
            self._open[r.group_id] = r
            self._in_flight[r.group_id] = None
        self.backend.submit(requests)

    def _retry(self, group_id: str, rollout_ids: Sequence[str] | None = None) -> None:
        """Generate an open group again, same ids, one attempt more."""
        if rollout_ids is not None:
            self._retry_ids[group_id] = list(rollout_ids)
        r = self._open[group_id]
        self._submit([dataclasses.replace(r, attempt=r.attempt + 1)])

    # ------------------------------------------------------------ filling the batch

    def _fill(self, train_step: int, tally: _Tally) -> list[Group]:
        batch: list[Group] = []
        while len(batch) < self.target:
            short = self.target - len(batch)
            self._receive(train_step, tally, want=short)
            counters = self.buffer.counters
            groups_before = counters.retried + counters.dropped
            samples_before = counters.expired_samples
            served = self.buffer.take(short, train_step)
            tally.expired_groups += counters.retried + counters.dropped - groups_before
            tally.expired_samples += counters.expired_samples - samples_before
            self._regenerate_waiting(tally)  # groups that expired on the way out
            kept, filtered = apply_group_filter(served, self.filter)
            self._settle(filtered, Fate.FILTERED)
            tally.filtered_groups += len(filtered)
            batch += kept
            if len(batch) < self.target and not self._more_coming():
                if tally.refills == MAX_REFILLS:
                    break  # the filter keeps rejecting: train on fewer groups than asked
                tally.refills += 1
                self._submit_new(oversample(self.target - len(batch), self.fraction), train_step)
        return batch

    def _more_coming(self) -> bool:
        return self.backend.in_flight > 0 or self.buffer.sizes()["completed"] > 0

    def _receive(self, train_step: int, tally: _Tally, want: int) -> None:
        """Sync: every group in flight. Async: until ``want`` groups are buffered, then
        whatever else is ready, without waiting."""
        while self.backend.in_flight:
            have = self.buffer.sizes()["completed"]
            if self.concurrent:
                need = max(0, min(want - have, self.backend.in_flight))
            else:
                need = self.backend.in_flight
            outcomes = self.backend.collect(min_groups=need, timeout=None if need else 0)
            self._admit(outcomes, train_step, tally)
            if need == 0:
                return

    def _receive_ready(self, tally: _Tally) -> list[GroupOutcome]:
        outcomes = self.backend.collect(min_groups=0, timeout=0)
        self._admit(outcomes, self._served_step + 1, tally)
        return outcomes

    # ------------------------------------------------------------ groups coming back

    def _admit(self, outcomes: Sequence[GroupOutcome], train_step: int, tally: _Tally) -> None:
        good = []
        for o in outcomes:
            self._in_flight.pop(o.request.group_id, None)
            if o.error is not None:
                self._on_error(o, train_step, tally)
            else:
                assert o.group is not None, f"outcome of {o.request.group_id} has no group"
                good.append(o)
        if self.scorer is not None and good:
            self.scorer.annotate([o.group for o in good])
        for o in good:
            self._put(o.group, o.request, train_step, tally)
            tally.generated.append(o.group)
            tally.gen_times.append(o.gen_time_s)
            for k, v in o.metrics.items():
                if k != FINISHED_AT:
                    tally.loop_metrics[k] = tally.loop_metrics.get(k, 0.0) + v
        self._regenerate_waiting(tally)

    def _put(self, group: Group, request: GroupRequest, train_step: int, tally: _Tally) -> None:
        gid = request.group_id
        ids = [s.rollout_id for s in group]
        bad = [s.rollout_id for s in group if s.group_id != gid]
        if bad:
            raise ValueError(f"samples {bad[:3]} came back for group {gid} with another group_id")
        self._account_for(gid, ids)
        fate = self.buffer.put(group, train_step)
        if fate in (Fate.RETRY, Fate.DROPPED):
            tally.expired_groups += 1
            tally.expired_samples += len(group)
        if fate == Fate.FAILED:
            tally.failed.append(group)
        if fate in (Fate.FAILED, Fate.DROPPED):
            self._forget(gid)

    def _account_for(self, gid: str, ids: Sequence[str]) -> None:
        """New ids enter the accounting; a regenerated group's old ids that did not come
        back (an agentic session with fewer segments this time) are dropped."""
        pending = set(self._retry_ids.pop(gid, ()))
        gone = [RolloutState(rollout_id=r, group_id=gid, prompt_ids=[]) for r in pending - set(ids)]
        self.accounting.move(gone, Fate.DROPPED)
        self.accounting.add(r for r in ids if r not in pending)

    def _on_error(self, o: GroupOutcome, train_step: int, tally: _Tally) -> None:
        """First failure: retry (attempt + 1). Second: the group is FAILED, on the record."""
        gid = o.request.group_id
        retry = gid not in self._errored
        tally.errors.append(GroupError(gid, o.request.attempt, o.worker, o.error, retry))
        if retry:
            self._errored.add(gid)
            self._retry(gid)
            return
        ids = self._retry_ids.get(gid) or [f"{gid}/{i}" for i in range(o.request.n)]
        # the cause first: its short reason is what step lines and summaries count
        why = f"{o.error}\n(generation of group {gid} failed twice; this is the second error)"
        group = failed_group(o.request, ids, why)
        self._put(group, o.request, train_step, tally)

    def _regenerate_waiting(self, tally: _Tally) -> None:
        """Expired (reset) and aborted groups go back to the backend under the same ids."""
        for group in self.buffer.take_expired() + self.buffer.take_aborted():
            self._retry(group[0].group_id, [s.rollout_id for s in group])

    def _settle(self, groups: Sequence[Group], fate: Fate) -> None:
        self.accounting.move_groups(groups, fate)
        for g in groups:
            self._forget(g[0].group_id)

    def _forget(self, gid: str) -> None:
        self._open.pop(gid, None)
        self._errored.discard(gid)
        self._retry_ids.pop(gid, None)

    # ------------------------------------------------------------ figures

    def _result(
        self, batch: list[Group], tally: _Tally, train_step: int, stale: int, seconds: float
    ) -> ProduceBatchResult:
        self._settle(batch, Fate.TRAINED)
        samples, tokens = produced_totals(tally.generated)
        mean, p50, p99 = time_stats(tally.gen_times)
        extra = {
            **tally.loop_metrics,
            **rollout_metrics(tally.generated),
            **per_task_metrics(tally.generated),
            **failure_metrics(tally.failed),
            **staleness_metrics(batch, train_step),
            EXPIRED_SAMPLES: float(tally.expired_samples),
            STALE_TOKENS: float(stale),
            "produce/errors": float(len(tally.errors)),
            "produce/refills": float(tally.refills),
            "produce/in_flight": float(self.backend.in_flight),
            **self.buffer.metrics(),
            **self.accounting.metrics(),
            **self.backend.health_metrics(),
        }
        return ProduceBatchResult(
            groups=batch,
            failed_groups=tally.failed,
            leftover_init=self.backend.in_flight,
            leftover_completed=self.buffer.sizes()["completed"],
            leftover_aborted=self.buffer.sizes()["aborted"],
            leftover_expired=tally.expired_groups,
            leftover_failed=len(tally.failed),
            leftover_filtered=tally.filtered_groups,
            produced_samples=samples,
            produced_tokens=tokens,
            produce_time_s=seconds,
            group_time_mean=mean,
            group_time_p50=p50,
            group_time_p99=p99,
            extra_metrics=extra,
        )

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Buffer, accounting, prompt position, and every open request (in flight ones are
        submitted again on resume, so no drawn prompt is lost)."""
        return {
            "version": STATE_VERSION,
            "buffer": self.buffer.state_dict(),
            "accounting": self.accounting.state_dict(),
            "sampler": self.sampler.state_dict(),
            "open": [_request_state(r) for r in self._open.values()],
            "in_flight": list(self._in_flight),  # submission order
            "retry_ids": dict(self._retry_ids),
            "errored": sorted(self._errored),
            "served_step": self._served_step,
            "drawn_groups": self._drawn_groups,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"producer state version {state.get('version')!r}, this rltool reads "
                f"{STATE_VERSION}; the checkpoint was written by another rltool version"
            )
        assert self.backend.in_flight == 0, "load the producer state before producing"
        self.buffer.load_state_dict(state["buffer"])
        self.accounting.load_state_dict(state["accounting"])
        self.sampler.load_state_dict(state["sampler"])
        self._open = {d["group_id"]: _request_from_state(d) for d in state["open"]}
        self._retry_ids = {k: list(v) for k, v in state["retry_ids"].items()}
        self._errored = set(state["errored"])
        self._served_step = int(state["served_step"])
        self._drawn_groups = int(state["drawn_groups"])
        self._in_flight = {}
        self._submit([self._open[gid] for gid in state["in_flight"]])

    def close(self) -> None:
        self.backend.close()
