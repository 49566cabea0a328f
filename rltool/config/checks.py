"""Value checks of every recipe key, run once when a recipe loads, before any model.

``check_values`` returns one line per bad key (``algorithm.clip_low = 5: must be in
[0, 1)``, ``optimizer.schedule = 'cosinee': must be one of: constant, cosine, linear;
did you mean 'cosine'?``); ``load_recipe`` raises them all together. Each rule is written
once, keyed by the full recipe key (``*`` stands for any task index or mapping key), and
the code that uses a value trusts it: no constructor checks it again (asserts only for
the code's own invariants).

Adding a key to ``schema.py`` (or ``algorithm.py``)? Give it one home here (a test fails
for a key without):
- a number: its range in ``RANGES``;
- a name from a fixed set: ``NAMES["section.key"] = one_of("a", "b")``; code that needs
  the list reads it from there;
- a name a higher layer registers (engine, agent loop, estimator, loss, group filter,
  tracker, data preset): ``REGISTRY_KEYS`` here and its registry in
  ``rltool/app/recipe_names.py`` (``RECIPE_REGISTRIES``); ``rltool train`` (with or
  without ``--print-config``) checks them right after loading, with the same message;
- any other string (a path, URL, model or run name): ``FREE_TEXT``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from collections.abc import Iterable, Iterator
from typing import Any

from rltool.config import correction
from rltool.config.algorithm import POLICY_LOSS_NAMES
from rltool.config.schema import ALARM_NAMES, RecipeConfig


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

_FRACTION = Range(low=0, high=1, low_open=True, high_open=True, null=True)  # (0, 1) or null

RANGES: dict[str, Range] = {
    "model.lora.rank": at_least(1),
    "model.lora.alpha": above(0),
    "model.lora.dropout": Range(low=0, high=1, high_open=True),
    "rollout.batch_size": at_least(1),
    "rollout.num_workers": at_least(1),
    "rollout.worker_threads": at_least(1),
    "rollout.chunk_tokens": at_least(1, null=True),
    "rollout.hf_slots": at_least(1),
    "rollout.hf_cache_memory": Range(low=0, high=1, low_open=True),
    "rollout.server.timeout_s": above(0),
    "rollout.server.retries": at_least(0),
    "rollout.server.concurrency": at_least(1),
    "rollout.server.deadline_s": above(0, null=True),
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
    # reasoning-gym rows (data/reasoning_gym.py): row i of a split is drawn with seed + i
    **{
        f"{where}.reasoning_gym.{key}": rule
        for where in ("data", "tasks[*]")
        for key, rule in (
            ("size", at_least(1)),
            ("seed", Range(low=0, high=2**32, high_open=True)),
            ("eval_size", at_least(0)),
            ("eval_seed", Range(low=0, high=2**32, high_open=True, null=True)),
        )
    },
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
    "algorithm.rollout_correction.weight_upper": above(0, null=True),
    "algorithm.rollout_correction.weight_lower": above(0, null=True),
    "algorithm.rollout_correction.reject[*].lower": above(0, null=True),
    "algorithm.rollout_correction.reject[*].upper": above(0, null=True),
    "algorithm.rollout_correction.opsm_delta": at_least(0, null=True),
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
    "trainer.threads": at_least(1, null=True),
    "trainer.max_failed_steps": at_least(1),
    "trainer.alarms.baseline_steps": at_least(1),
    "trainer.alarms.length_ratio": above(1, null=True),
    "trainer.alarms.truncated_frac": Range(low=0, high=1, high_open=True, null=True),
    "trainer.alarms.entropy_ratio": _FRACTION,
    "trainer.alarms.accuracy_drop": at_least(0, null=True),
    "trainer.alarms.reward_rise": at_least(0, null=True),
    "trainer.alarms.component_share": _FRACTION,
    "trainer.alarms.mismatch_kl": above(0, null=True),
    "trainer.alarms.grad_norm_ratio": above(1, null=True),
    "distributed.nproc_per_node": at_least(1),
    "distributed.nnodes": at_least(1),
    # the sandbox loop's limits (options are a free map: these match by their whole key);
    # 16 descriptors start an interpreter, 2**20 is Linux's default nr_open
    **{
        f"{where}agent_loop.options.{limits}.max_open_files": Range(low=16, high=2**20)
        for where in ("", "tasks[*].")
        for limits in ("limits", "check_limits")
    },
}


@dataclasses.dataclass(frozen=True, slots=True)
class Names:
    """The names a string key takes; ``pattern`` (a regular expression, read as ``shown``)
    allows a family of names besides (``cuda:N``)."""

    names: tuple[str, ...]
    pattern: str | None = None
    shown: str = ""

    def allows(self, value: Any) -> bool:
        if not isinstance(value, str):
            return False
        return value in self.names or (
            self.pattern is not None and re.fullmatch(self.pattern, value) is not None
        )

    def known(self) -> list[str]:
        return [*self.names, *([self.shown] if self.shown else [])]


def one_of(*names: str, pattern: str | None = None, shown: str = "") -> Names:
    return Names(names, pattern, shown)


NAMES: dict[str, Names] = {
    "model.dtype": one_of("float32", "bfloat16", "float16"),
    "model.lora.sync": one_of("adapters", "merged"),
    "model.device": one_of("auto", "cpu", "cuda", pattern=r"cuda:\d+", shown="cuda:N"),
    # the attentions packed rows train with (training/attention.py picks their kernels)
    "model.attn_implementation": one_of(
        "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ),
    "rollout.backend": one_of("inprocess", "ray"),
    "rollout.vllm.dtype": one_of("", "float32", "bfloat16", "float16"),  # "" = model.dtype
    "rollout.hf_decode": one_of("lean", "reference"),
    "produce.mode": one_of("sync", "async"),
    "produce.buffer_order": one_of("fifo", "stalest"),
    "produce.expired": one_of("retry", "drop"),
    "data.too_long": one_of("skip", "error"),  # produce/prompt_fit.py
    # where a reasoning-gym answer is found (rewards/reasoning_gym.py)
    "data.reasoning_gym.answer_format": one_of("answer_tag", "gsm8k"),
    "tasks[*].reasoning_gym.answer_format": one_of("answer_tag", "gsm8k"),
    "distill.mode": one_of("topk", "sampled"),
    "optimizer.schedule": one_of("constant", "cosine", "linear"),
    "distributed.strategy": one_of("full_shard", "shard_grad_op"),
    "distributed.mixed_precision": one_of("none", "bf16"),
    "algorithm.policy_loss": one_of(*POLICY_LOSS_NAMES),  # training/policy_losses.py
    "algorithm.rollout_correction.preset": one_of("", *correction.PRESETS),  # "" = none
    "algorithm.rollout_correction.weights": one_of(*correction.WEIGHTS),
    "algorithm.rollout_correction.reject[*].criterion": one_of(*correction.CRITERIA),
    "trainer.alarms.stop_on[*]": one_of(*ALARM_NAMES),  # app/alarms.py
    "trainer.compile": one_of("off", "layers"),  # training/compiled.py's COMPILE_MODES
}

# names of a registry that a higher layer fills: checked by rltool/app/recipe_names.py
REGISTRY_KEYS = (
    "rollout.engine",
    "agent_loop.name",
    "tasks[*].agent_loop.name",
    "data.preset",
    "tasks[*].preset",
    "produce.group_filter",
    "algorithm.estimator",
    "algorithm.loss_agg",
    "algorithm.kl_estimator",
    "logging.trackers[*]",
)

# strings that are not names from a list: paths, URLs, model, task and run names, ...
FREE_TEXT = (
    "model.path",
    "model.lora.target_modules[*]",
    "rollout.servers[*]",
    "rollout.server.model",
    "rollout.server.api_key_env",
    "rollout.server.weights_dir",
    "rollout.server.update_method",
    "rollout.server.logprobs_method",
    "rollout.ray_address",
    "rollout.sampling.stop[*]",
    "rollout.eval_sampling.stop[*]",
    *(f"{section}.{key}" for section in ("data", "tasks[*]") for key in (
        "train_files[*]", "eval_files[*]", "prompt_key", "answer_key", "task_key"
    )),
    "tasks[*].name",
    "data.reasoning_gym.dataset",  # checked against reasoning-gym's own list in preflight
    "tasks[*].reasoning_gym.dataset",
    "distill.teacher_path",
    "logging.run_dir",
    "logging.name",
    "logging.project",
)  # fmt: skip


def name_problem(key: str, value: Any, known: Iterable[str], kind: str = "") -> str:
    """The line for a name that is not one of ``known`` (``kind``: "advantage estimator")."""
    known = list(known)
    shown = ", ".join(repr(k) if k == "" else k for k in known) or "none"
    what = f"a known {kind}" if kind else "one of"
    line = f"{key} = {_show(value)}: must be {what}: {shown}"
    near = difflib.get_close_matches(str(value), [k for k in known if k], n=1)
    return f"{line}; did you mean {near[0]!r}?" if near else line


def check_values(cfg: RecipeConfig) -> list[str]:
    """One line per key whose value is out of its range or not one of its names, in
    schema order."""
    problems = (check_value(key, value, pattern) for key, pattern, value in leaves(cfg))
    return [p for p in problems if p is not None]


def combination_problems(cfg: RecipeConfig) -> list[str]:
    """One line per pair of keys whose values cannot go together."""
    problems = []
    if cfg.trainer.compile != "off" and cfg.distributed.activation_checkpointing:
        problems.append(
            f"trainer.compile = {cfg.trainer.compile!r} with distributed.activation_checkpointing"
            " = true: a checkpointed layer recomputes its forward eagerly in the backward, "
            "which does not match the compiled forward; set trainer.compile: off or "
            "distributed.activation_checkpointing: false"
        )
    return problems


def check_value(key: str, value: Any, pattern: str | None = None) -> str | None:
    """The problem line of one value of ``key`` (``pattern``: its RANGES/NAMES key, default
    ``key``), or None when it is good or the key has no rule here."""
    pattern = key if pattern is None else pattern
    names, rule = NAMES.get(pattern), RANGES.get(pattern)
    if rule is None:  # a key inside a free map (agent_loop.options.*) is matched whole
        rule = RANGES.get(re.sub(r"\[\d+\]", "[*]", key))
    if names is not None and not names.allows(value):
        return name_problem(key, value, names.known())
    if rule is not None and not rule.allows(value):
        finite = isinstance(value, float) and not math.isfinite(value)
        must = f"must be a finite number {rule.text()}" if finite else f"must be {rule.text()}"
        return f"{key} = {_show(value)}: {must}"
    return None


def unchecked_numeric_keys() -> list[str]:
    """Numeric keys of the default recipe without a range (a test keeps this empty)."""
    return [
        pattern
        for _, pattern, value in _leaves(RecipeConfig(), "", "")
        if value is not None and not isinstance(value, str) and pattern not in RANGES
    ]


def unchecked_string_keys(registry_keys: Iterable[str] = REGISTRY_KEYS) -> list[str]:
    """String keys of the schema in none of NAMES, ``registry_keys`` and FREE_TEXT (a test
    keeps this empty, with the app's registry table)."""
    homes = {*NAMES, *registry_keys, *FREE_TEXT}
    return [key for key in string_keys() if key not in homes]


@functools.cache
def string_keys(schema: type = RecipeConfig, prefix: str = "") -> tuple[str, ...]:
    """Every string-valued key pattern of the schema, read from its types (so that list
    items, ``tasks[*].preset``, count although the default recipe has none)."""
    out: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        typ, key = hints[f.name], prefix + f.name
        args = typing.get_args(typ)
        if dataclasses.is_dataclass(typ):
            out.extend(string_keys(typ, key + "."))
        elif typing.get_origin(typ) is list and dataclasses.is_dataclass(args[0]):
            out.extend(string_keys(args[0], key + "[*]."))
        elif typing.get_origin(typ) is list and args[0] is str:
            out.append(key + "[*]")
        elif typ is str or (typing.get_origin(typ) is not dict and str in args):  # str | None
            out.append(key)
    return tuple(out)


def _leaves(value: Any, key: str, pattern: str) -> Iterator[tuple[str, str, Any]]:
    """(key, pattern, value) of every number, string or None leaf; list items and map keys are
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
    elif value is None or (isinstance(value, int | float | str) and not isinstance(value, bool)):
        yield key, pattern, value


def leaves(cfg: RecipeConfig) -> Iterator[tuple[str, str, Any]]:
    """(key, pattern, value) of every number, string or None leaf of ``cfg``
    (``tasks[1].preset``, ``tasks[*].preset``, ``'verl'``)."""
    return _leaves(cfg, "", "")
