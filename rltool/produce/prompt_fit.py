"""Prompts too long for the model, decided before its first step (``data.too_long``).

A sample of P prompt and R response tokens needs P + R <= the model's context
(``max_position_embeddings``; ``rollout.vllm.max_model_len`` when vLLM is given a smaller
one) and trains in a row of P + R - 1 tokens (the shift drops one), at most
``trainer.pack_max_length``. So a training prompt fits when P + max_new_tokens <=
min(context, pack_max_length + 1); an eval prompt (never trained) when
P + eval max_new_tokens <= context. P is counted as the task's loop renders the prompt
(``AgentLoop.prompt_lengths``: its chat template, the run's tokenizer); the prompts of a
loop whose agent renders them at run time (localhost, sandbox, verl) are not counted.

``skip`` drops them, counted per file (printed at start, ``data/too_long_skipped*`` on
every step line); ``error`` refuses the run before the model loads, naming file and row.
Design: docs/agent-loops.md#prompts-too-long-for-the-model
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltool import metric_names as mn
from rltool.agent_loops.base import AGENT_LOOPS
from rltool.config.schema import RecipeConfig
from rltool.produce.preflight import PreflightError
from rltool.produce.task_specs import TASK_NAME_OPTION, TaskSpec, load_task_data

ROWS_NAMED = 3  # too-long rows named per file; the rest are counted


@dataclass(frozen=True, slots=True)
class Limit:
    """The most prompt tokens a file's records may have, and why."""

    tokens: int
    why: str  # "trainer.pack_max_length 512 + 1 - rollout.sampling.max_new_tokens 20"


def prompt_limits(recipe: RecipeConfig, context: int | None) -> tuple[Limit, Limit | None]:
    """(training prompts' limit, eval prompts' limit or None when the context is unknown);
    ``context``: the model's ``max_position_embeddings`` (None: unknown)."""
    rollout = recipe.rollout
    vllm_len = rollout.vllm.max_model_len if rollout.engine == "vllm" else None
    if vllm_len and (context is None or vllm_len < context):
        context = vllm_len
    where = "the model's context" if context is None else f"the model's context {context}"
    new = rollout.sampling.max_new_tokens
    pack = recipe.trainer.pack_max_length
    if context is not None and context <= pack + 1:
        train = Limit(context - new, f"{where} - rollout.sampling.max_new_tokens {new}")
    else:
        train = Limit(
            pack + 1 - new,
            f"trainer.pack_max_length {pack} + 1 - rollout.sampling.max_new_tokens {new}",
        )
    if context is None:
        return train, None
    eval_new = rollout.eval_sampling.max_new_tokens
    return train, Limit(
        context - eval_new, f"{where} - rollout.eval_sampling.max_new_tokens {eval_new}"
    )


@dataclass(slots=True)
class FileSkips:
    """The too-long prompts of one data file."""

    path: str
    evaluation: bool  # an eval file (else a training file)
    limit: Limit
    rows: list[tuple[str, int]]  # (where: "path:line" or "path row i", prompt tokens)

    def line(self) -> str:
        kind = "eval" if self.evaluation else "training"
        named = ", ".join(f"{w} ({n} tokens)" for w, n in self.rows[:ROWS_NAMED])
        more = len(self.rows) - ROWS_NAMED
        named += f" and {more} more" if more > 0 else ""
        return (
            f"{self.path} ({kind}): {len(self.rows)} prompt(s) longer than "
            f"{self.limit.tokens} tokens ({self.limit.why}): {named}"
        )


@dataclass(slots=True)
class TooLong:
    """What ``data.too_long: skip`` dropped, per file, in recipe order."""

    files: list[FileSkips] = field(default_factory=list)

    def skipped(self, evaluation: bool = False) -> int:
        return sum(len(f.rows) for f in self.files if f.evaluation == evaluation)

    def metrics(self) -> dict[str, float]:
        return {
            mn.DATA_TOO_LONG_SKIPPED: float(self.skipped()),
            mn.DATA_TOO_LONG_SKIPPED_EVAL: float(self.skipped(evaluation=True)),
        }

    def message(self) -> str:
        """The note printed at start ('' when nothing was skipped)."""
        if not self.files:
            return ""
        return (
            "data.too_long=skip: prompts that cannot fit the model with max_new_tokens after "
            f"them are left out of the run:\n{self.lines()}"
        )

    def lines(self) -> str:
        return "\n".join(f"  - {f.line()}" for f in self.files)


def fit_task_data(
    recipe: RecipeConfig, tokenizer: Any, context: int | None
) -> tuple[dict[str, tuple[list[dict], list[dict]]], TooLong]:
    """``load_task_data`` without the prompts too long for the model (``data.too_long:
    skip``, reported in the ``TooLong``), or a PreflightError naming each file and row
    (``error``)."""
    train_limit, eval_limit = prompt_limits(recipe, context)
    report = TooLong()

    def fit(
        spec: TaskSpec, path: str, located: list[tuple[str, dict]], evaluation: bool
    ) -> list[dict]:
        limit = eval_limit if evaluation else train_limit
        lengths = None if limit is None else _lengths(spec, located, tokenizer)
        if lengths is None:
            return [r for _, r in located]
        rows = [(w, n) for (w, _), n in zip(located, lengths, strict=True) if n > limit.tokens]
        if rows:
            report.files.append(FileSkips(path, evaluation, limit, rows))
        return [r for (_, r), n in zip(located, lengths, strict=True) if n <= limit.tokens]

    try:
        data = load_task_data(recipe, fit)
    except ValueError as exc:
        if not report.files:
            raise
        raise PreflightError(f"{exc} that fit the model:\n{report.lines()}") from exc
    if report.files and recipe.data.too_long == "error":
        raise PreflightError(
            "preflight: prompts too long for the model (data.too_long=error):\n"
            f"{report.lines()}\nshorten or remove them, raise trainer.pack_max_length (within "
            "the model's context) or lower max_new_tokens; data.too_long=skip leaves them out"
        )
    return data, report


def _lengths(spec: TaskSpec, located: list[tuple[str, dict]], tokenizer: Any) -> list[int] | None:
    loop_cls = AGENT_LOOPS.get(spec.loop.name)
    options = {k: v for k, v in spec.loop.options.items() if k != TASK_NAME_OPTION}
    return loop_cls.prompt_lengths([r for _, r in located], options, tokenizer)
