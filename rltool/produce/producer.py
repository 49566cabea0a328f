"""The producer: prompts in, one train batch per step out, through a rollout backend.

One strategy, two settings of how far generation runs ahead of training:

- ``sync`` (lookahead 0): draw this step's prompts, generate every group,
  then build the batch: generate, train, repeat. On-policy: staleness 0.
- ``async`` (lookahead ``produce.max_inflight_steps``): after a batch is
  served, enough prompts for the next steps are submitted at once, so they
  generate while this step trains; the trainer's weights reach the rollout
  workers every ``algorithm.sync_interval`` steps, and a generation running
  at a sync continues with the new weights at its next chunk boundary.

Every generated group goes through the replay buffer (which bakes staleness
and expires groups too old to train), then the group filter; the batch is the
first ``data.prompts_per_step`` survivors. Over-sampling
(``produce.oversample``) draws extra groups per step; survivors beyond the
batch stay buffered for the next step, and new prompts are drawn only to top
the groups buffered or in flight up to what the next steps need. Every sample is followed by an
``Accounting`` from the moment its group comes back to its fate: a group whose
generation failed is retried once, then counted FAILED; an expired group is
regenerated under the same ids (``expired: retry``) or dropped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.produce.backend import GroupOutcome, GroupRequest, RolloutBackend
from rltool.produce.buffer import BufferConfig, ReplayBuffer
from rltool.produce.filters import fill_batch, get_group_filter, oversample
from rltool.produce.result import (
    Accounting,
    Fate,
    ProduceBatchResult,
    produced_totals,
    raw_reward_totals,
    time_stats,
)
from rltool.produce.tasks import TaskSampler, per_task_metrics
from rltool.produce.worker import FINISHED_AT
from rltool.rollout.staleness import token_staleness
from rltool.rollout.state import RolloutState, Status

Group = list[RolloutState]
MODES = ("sync", "async")
MAX_REFILLS = 4  # extra draws in one step when the filter leaves the batch short
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class GroupError:
    """A group whose generation came back with an error, and what the producer did."""

    group_id: str
    attempt: int
    worker: str  # "" when the backend does not name workers
    error: str  # GroupOutcome.error
    retried: bool  # False: its second failure, the group is counted FAILED

    def __str__(self) -> str:
        then = "retrying it" if self.retried else "counted failed"
        return f"group {self.group_id} (attempt {self.attempt}): {self.error}; {then}"


@dataclass(slots=True)
class _Tally:
    """What happened between two batches: groups that came back and where they went."""

    generated: list[Group] = field(default_factory=list)
    gen_times: list[float] = field(default_factory=list)
    loop_metrics: dict[str, float] = field(default_factory=dict)  # summed over outcomes
    expired_groups: int = 0
    expired_samples: int = 0
    failed_groups: int = 0
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


def staleness_metrics(batch: Sequence[Group], train_step: int) -> dict[str, float]:
    """Histogram of the staleness of every response token of the batch at ``train_step``."""
    steps = [s.response_model_steps for g in batch for s in g if s.response_model_steps is not None]
    st = token_staleness(train_step, np.concatenate(steps) if steps else [])  # [N]
    return {
        "staleness/tokens_s0": float((st <= 0).sum()),
        "staleness/tokens_s1": float((st == 1).sum()),
        "staleness/tokens_s2plus": float((st >= 2).sum()),
        "staleness/mean": float(st.mean()) if st.size else 0.0,
        "staleness/max": float(st.max()) if st.size else 0.0,
    }


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward and status figures over every sample generated, before filtering."""
    samples = [s for g in groups for s in g]
    scores = [s.score for s in samples if s.score is not None]
    return {
        "rollout/reward_mean": float(np.mean(scores)) if scores else math.nan,
        "rollout/samples": float(len(samples)),
        "rollout/failed": float(sum(s.status == Status.FAILED for s in samples)),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples)
        / max(len(samples), 1),
        "rollout/response_tokens_mean": float(
            np.mean([0 if s.response_ids is None else len(s.response_ids) for s in samples])
            if samples
            else 0.0
        ),
    }


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
        get_group_filter(p.group_filter)  # an unknown name fails now, not at step 1
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
            self.backend.update_weights(model.state_dict(), train_step)

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
            served = self.buffer.take(short, train_step)
            self._regenerate_waiting(tally)  # groups that expired on the way out
            filled = fill_batch(served, short, self.filter)
            self._settle(filled.filtered, Fate.FILTERED)
            tally.filtered_groups += len(filled.filtered)
            batch += filled.batch
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
            tally.failed_groups += 1
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
        group = failed_group(o.request, ids, f"generation failed twice, last: {o.error}")
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
        raw_sum, raw_n = raw_reward_totals(tally.generated)
        samples, tokens = produced_totals(tally.generated)
        mean, p50, p99 = time_stats(tally.gen_times)
        extra = {
            **tally.loop_metrics,
            **rollout_metrics(tally.generated),
            **per_task_metrics(tally.generated),
            **staleness_metrics(batch, train_step),
            "staleness/expired_samples": float(tally.expired_samples),
            "staleness/stale_tokens_masked": float(stale),
            "produce/errors": float(len(tally.errors)),
            "produce/refills": float(tally.refills),
            "produce/in_flight": float(self.backend.in_flight),
            **self.buffer.metrics(),
            **self.accounting.metrics(),
            **self.backend.health_metrics(),
        }
        return ProduceBatchResult(
            groups=batch,
            leftover_init=self.backend.in_flight,
            leftover_completed=self.buffer.sizes()["completed"],
            leftover_aborted=self.buffer.sizes()["aborted"],
            leftover_expired=tally.expired_groups,
            leftover_failed=tally.failed_groups,
            leftover_filtered=tally.filtered_groups,
            raw_rewards_sum=raw_sum,
            raw_rewards_count=raw_n,
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
