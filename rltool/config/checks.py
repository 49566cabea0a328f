"""Value ranges of every numeric recipe key, checked once when a recipe loads.

``check_values`` returns one line per bad key (``algorithm.clip_low = 5: must be in
[0, 1)``); ``load_recipe`` raises them all together. Ranges are written once, in
``RANGES``, keyed by the full recipe key (``*`` stands for any task index or mapping key);
the names a key may take, in ``CHOICES``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from rltool.config.schema import POLICY_LOSS_NAMES, RecipeConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """A closed or open interval of allowed values; ``null`` allows None."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: bool = False

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.null
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            bounds = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            assert self.high is not None
            bounds = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return f"{bounds} or null" if self.null else bounds


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and math.isfinite(value):
        return _num(value)
    return repr(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def at_least(low: float, null: bool = False) -> Range:
    return Range(low=low, null=null)


def above(low: float, null: bool = False) -> Range:
    return Range(low=low, low_open=True, null=null)


_SAMPLING = {
    "temperature": at_least(0),
    "top_p": Range(low=0, high=1, low_open=True),
    "top_k": at_least(0),
    "max_new_tokens": at_least(1),
}

RANGES: dict[str, Range] = {
    "model.lora.rank": at_least(1),
    "model.lora.alpha": above(0),
    "model.lora.dropout": Range(low=0, high=1, high_open=True),
    "rollout.batch_size": at_least(1),
    "rollout.num_workers": at_least(1),
    "rollout.worker_threads": at_least(1),
    "rollout.chunk_tokens": at_least(1, null=True),
    "rollout.server.timeout_s": above(0),
    "rollout.server.retries": at_least(0),
    "rollout.server.concurrency": at_least(1),
    "rollout.vllm.gpu_memory_utilization": Range(low=0, high=1, low_open=True),
    "rollout.vllm.tensor_parallel_size": at_least(1),
    "rollout.vllm.max_model_len": at_least(1, null=True),
    "rollout.vllm.seed": at_least(0),
    **{f"rollout.sampling.{k}": r for k, r in _SAMPLING.items()},
    **{f"rollout.eval_sampling.{k}": r for k, r in _SAMPLING.items()},
    "data.prompts_per_step": at_least(1),
    "data.group_size": at_least(1),
    "data.eval_limit": at_least(0),
    "tasks[*].weight": at_least(0),
    "produce.oversample": at_least(0),
    "produce.max_inflight_steps": at_least(1),
    "distill.top_k": at_least(1),
    "distill.coef": at_least(0),
    "algorithm.task_adv_weight.*": at_least(0),
    "algorithm.clip_low": Range(low=0, high=1, high_open=True),
    "algorithm.clip_high": at_least(0),
    "algorithm.dual_clip": above(1, null=True),
    "algorithm.kl_coef": at_least(0),
    "algorithm.entropy_coef": at_least(0),
    "algorithm.tis_cap": above(0, null=True),
    "algorithm.sapo.tau_pos": above(0),
    "algorithm.sapo.tau_neg": above(0),
    "algorithm.dppo.ratio_cap": above(0),
    "algorithm.clip_cov.ratio": Range(low=0, high=1, low_open=True),
    "algorithm.clip_cov.low": at_least(0),
    "algorithm.clip_cov.high": above(0),
    "algorithm.kl_cov.ratio": Range(low=0, high=1, low_open=True),
    "algorithm.kl_cov.coef": at_least(0),
    "algorithm.ppo_epochs": at_least(1),
    "algorithm.mini_batches": at_least(1),
    "algorithm.max_staleness": at_least(0, null=True),
    "algorithm.max_token_staleness": at_least(0, null=True),
    "algorithm.sync_interval": at_least(1),
    "optimizer.lr": above(0),
    "optimizer.weight_decay": at_least(0),
    "optimizer.betas[*]": Range(low=0, high=1, high_open=True),
    "optimizer.eps": above(0),
    "optimizer.warmup_steps": at_least(0),
    "optimizer.min_lr_ratio": Range(low=0, high=1),
    "optimizer.grad_clip": at_least(0),
    "trainer.steps": at_least(0),
    "trainer.seed": Range(low=0, high=2**32, high_open=True),  # numpy's seed range
    "trainer.pack_max_length": at_least(2),  # the shift needs two tokens
    "trainer.eval_every": at_least(0),
    "trainer.save_every": at_least(0),
    "trainer.time_budget_s": above(0, null=True),
    "trainer.max_failed_steps": at_least(1),
    "distributed.nproc_per_node": at_least(1),
    "distributed.nnodes": at_least(1),
}


# the names a key may take, where config/ knows them (registries below config name theirs
# when the run is built)
CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm.policy_loss": POLICY_LOSS_NAMES,
}


def check_values(cfg: RecipeConfig) -> list[str]:
    """One line per numeric key whose value is out of its range, in schema order, then
    one per named key whose name is unknown."""
    problems = []
    for key, pattern, value in _leaves(cfg, "", ""):
        rule = RANGES.get(pattern)
        if rule is not None and not rule.allows(value):
            finite = isinstance(value, float) and not math.isfinite(value)
            must = f"must be a finite number {rule.text()}" if finite else f"must be {rule.text()}"
            problems.append(f"{key} = {_show(value)}: {must}")
    for key, known in CHOICES.items():
        value = _get(cfg, key)
        if value not in known:
            problems.append(f"{key} = {value!r}: unknown; known: {', '.join(known)}")
    return problems


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def unchecked_numeric_keys() -> list[str]:
    """Numeric keys of the default recipe without a range (a test keeps this empty)."""
    return [
        pattern
        for _, pattern, value in _leaves(RecipeConfig(), "", "")
        if value is not None and pattern not in RANGES
    ]


def _leaves(value: Any, key: str, pattern: str) -> Iterator[tuple[str, str, Any]]:
    """(key, pattern, value) of every number or None leaf; list items and map keys are
    ``[*]`` and ``.*`` in the pattern (``tasks[1].weight`` -> ``tasks[*].weight``)."""
    if dataclasses.is_dataclass(value):
        dot = "." if key else ""
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), key + dot + f.name, pattern + dot + f.name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{key}[{i}]", f"{pattern}[*]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _leaves(item, f"{key}.{k}", f"{pattern}.*")
    elif value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        yield key, pattern, value
