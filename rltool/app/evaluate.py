"""``rltool eval``: a checkpoint's pass@1, unbiased pass@k, mean@n and maj@n on a recipe's
eval data, each with a bootstrap interval over prompts.

Every task's eval rows go through its agent loop (``generate_groups`` with group size n,
so each sample is built and rewarded as in training) on the rollout backend that
``build_run`` makes; the checkpoint's weights are loaded into the model and the backend
first. Design: docs/app.md#evaluating-a-checkpoint
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rltool.app.checkpoint import MANIFEST, NoCheckpointError, open_checkpoint, verify_checkpoint
from rltool.app.run import Run, build_run
from rltool.config.loader import RUN_CONFIG, load_recipe, resume_recipe
from rltool.config.schema import RecipeConfig, SamplingConfig
from rltool.lora import load_checkpoint_weights
from rltool.produce.backend import GroupOutcome, GroupRequest
from rltool.rewards.gsm8k import answer_key
from rltool.rollout.bootstrap import Interval, bootstrap_interval
from rltool.rollout.failures import failure_reason
from rltool.rollout.pass_at_k import majority_vote, pass_at_k
from rltool.rollout.state import RolloutState, Status

SOLVED_SCORE = 1.0  # a trajectory whose reward has no "correct" is correct at this score
NO_ANSWERS = (
    "maj@n not shown: the task's reward records no extracted answer "
    '(reward["extracted"], which the gsm8k loop sets), so there is nothing to vote on'
)


class NoEvalDataError(ValueError):
    """A task's eval files hold no records."""


@dataclass(slots=True)
class PromptResult:
    """One prompt's n samples, reduced: what pass@k and the figures need."""

    samples: int  # trajectories that came back, or n when the group did not
    correct: int
    lengths: list[int]  # response tokens of each trajectory that came back
    truncated: int  # trajectories that stopped at max_new_tokens
    failures: list[str]  # the short reason of each failed trajectory
    scores: list[float] = field(default_factory=list)  # reward score of each trajectory
    # that came back (a failed or unscored one: 0.0)
    # the extracted answer of each trajectory that did not fail, with its correctness;
    # None when the loop records no answer (reward has no "extracted")
    votes: list[tuple[str | None, bool]] | None = None


@dataclass(slots=True)
class Figure:
    """One figure over prompts with its 95% percentile-bootstrap interval."""

    value: float
    low: float
    high: float
    per_prompt: list[float] = field(repr=False)  # [P] in row order: what pairing needs


@dataclass(slots=True)
class TaskFigures:
    task: str
    prompts: int
    samples: int
    pass_at: dict[int, float]  # k -> mean unbiased pass@k
    # "pass@k", "mean@n", "maj@n" (maj@n only where answers are extracted) -> figure
    figures: dict[str, Figure]
    maj_missing: str | None  # why maj@n is not shown
    mean_response_len: float
    truncated_frac: float
    failed: int
    failures: dict[str, int]  # reason -> failed samples, most frequent first


@dataclass(slots=True)
class EvalReport:
    source: str  # the recipe or run directory given
    weights: str  # the checkpoint directory, or the recipe's model.path
    step: int | None  # train step of the checkpoint; None for model.path
    n: int
    ks: list[int]
    sampling: dict[str, Any]  # the SamplingConfig the samples were drawn with
    tasks: list[TaskFigures]
    overall: TaskFigures
    skipped: list[str] = field(default_factory=list)  # newer damaged checkpoints
    seed: int = 0  # trainer.seed: the sampling seed of the evaluation
    rows: dict[str, str] = field(default_factory=dict)  # task -> rows_digest of its eval rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for figs in [out["overall"], *out["tasks"]]:
            figs["pass_at"] = {f"pass@{k}": v for k, v in figs["pass_at"].items()}
            for fig in figs["figures"].values():
                del fig["per_prompt"]
        return out


def check_ks(n: int, ks: Sequence[int]) -> list[int]:
    """The k's to report: 1 and each k asked for (default: n), sorted; ValueError for
    n < 1 or a k outside 1..n."""
    if n < 1:
        raise ValueError(f"--n must be >= 1 sample per prompt, got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(
            f"--k {bad[0]}: pass@k needs 1 <= k <= n = {n} samples per prompt; "
            f"give --n {max(bad)} or more, or a smaller --k"
        )
    return sorted({1, *(ks or [n])})


def eval_sampling(recipe: RecipeConfig, n: int) -> SamplingConfig:
    """n = 1: ``rollout.eval_sampling`` (greedy by default), the held-out evaluation of a
    run; n > 1: ``rollout.sampling``, so the n samples of a prompt differ."""
    return recipe.rollout.eval_sampling if n == 1 else recipe.rollout.sampling


def is_correct(state: RolloutState) -> bool:
    """The loop's ``reward["correct"]`` where it sets one, else score >= 1.0."""
    if state.status != Status.COMPLETED or state.reward is None:
        return False
    if state.reward.get("correct") is not None:
        return bool(state.reward["correct"])
    score = state.reward.get("score")
    return score is not None and score >= SOLVED_SCORE


def trajectories(group: Sequence[RolloutState]) -> list[list[RolloutState]]:
    """A group's samples as trajectories: the segments of one session together."""
    by_id: dict[str, list[RolloutState]] = {}
    for s in group:
        by_id.setdefault(str(s.session_id or s.rollout_id), []).append(s)
    return list(by_id.values())


def prompt_result(outcome: GroupOutcome) -> PromptResult:
    """One group reduced; a group that never came back is n failed samples."""
    n = outcome.request.n
    if outcome.group is None:
        return PromptResult(n, 0, [], 0, [failure_reason(outcome.error)] * n)
    trajs = trajectories(outcome.group)
    failures, lengths, scores, votes = [], [], [], []
    correct = truncated = 0
    extracted = False  # does the loop record answers at all?
    for segs in trajs:
        failed = next((s for s in segs if s.status == Status.FAILED), None)
        reward = segs[0].reward or {}
        extracted |= "extracted" in reward
        if failed is not None:
            failures.append(failure_reason(failed.error))
            scores.append(0.0)
        else:
            ok = is_correct(segs[0])
            correct += ok
            scores.append(float(reward.get("score") or 0.0))
            answer = reward.get("extracted")
            votes.append((None if answer is None else answer_key(str(answer)), ok))
        lengths.append(sum(len(s.response_ids) for s in segs if s.response_ids is not None))
        truncated += any(s.finish_reason == "length" for s in segs)
    return PromptResult(
        len(trajs), correct, lengths, truncated, failures, scores, votes if extracted else None
    )


def task_figures(
    task: str,
    results: Sequence[PromptResult],
    ks: Sequence[int],
    n: int | None = None,
    vote: bool | None = None,
) -> TaskFigures:
    """pass@k, mean@n and maj@n averaged over prompts, each with its bootstrap interval;
    mean length and truncation over the trajectories that came back, failures by reason.
    ``n`` (default: the largest k) names mean@n and maj@n. maj@n is shown when ``vote``
    (default: when the loop recorded an answer for some prompt); a prompt without one
    (its group lost, every sample failed) counts 0."""
    n = max(ks) if n is None else n
    vote = any(r.votes is not None for r in results) if vote is None else vote
    lengths = [x for r in results for x in r.lengths]
    reasons = Counter(x for r in results for x in r.failures)
    per_prompt = {f"pass@{k}": [_pass_at(r, k) for r in results] for k in ks}
    per_prompt[f"mean@{n}"] = [sum(r.scores) / r.samples if r.samples else 0.0 for r in results]
    if vote:
        per_prompt[f"maj@{n}"] = [
            majority_vote([a for a, _ in r.votes], [ok for _, ok in r.votes]) if r.votes else 0.0
            for r in results
        ]
    figures = {name: _figure(values) for name, values in per_prompt.items()}
    return TaskFigures(
        task=task,
        prompts=len(results),
        samples=sum(r.samples for r in results),
        pass_at={k: figures[f"pass@{k}"].value for k in ks},
        figures=figures,
        maj_missing=None if vote else NO_ANSWERS,
        mean_response_len=sum(lengths) / len(lengths) if lengths else 0.0,
        truncated_frac=sum(r.truncated for r in results) / len(lengths) if lengths else 0.0,
        failed=sum(reasons.values()),
        failures=dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def _pass_at(r: PromptResult, k: int) -> float:
    """One prompt's pass@k; a prompt whose loop returned fewer than k trajectories counts
    at pass@(its samples), one that returned none at 0."""
    return pass_at_k(r.samples, r.correct, min(k, r.samples)) if r.samples else 0.0


def _figure(per_prompt: list[float]) -> Figure:
    values = np.asarray(per_prompt, dtype=np.float64)  # [P]
    ci: Interval = bootstrap_interval(values)
    return Figure(float(values.mean()), ci.low, ci.high, per_prompt)


def load_weights(
    run: Run, run_dir: Path | None, checkpoint: Path | None
) -> tuple[str, int | None, list[str]]:
    """Load the checkpoint into the model and the rollout backend: ``checkpoint`` when given,
    else the run's newest complete one, else (a recipe) keep ``model.path``.
    Returns (weights shown, step, skipped newer checkpoints)."""

    def load(ckpt: Path) -> None:  # strict: every weight (or adapter) restored
        load_checkpoint_weights(run.model, ckpt)

    if checkpoint is not None:
        reason = verify_checkpoint(checkpoint)
        if reason is not None:
            raise NoCheckpointError(f"--checkpoint {checkpoint}: {reason}")
        load(checkpoint)
        found_path, step, skipped = checkpoint, _step_of(checkpoint), []
    elif run_dir is not None:
        try:
            found = open_checkpoint(run_dir, load)
        except NoCheckpointError as exc:
            found_none = str(exc).split("; start a new run")[0].replace(" to resume from", "")
            raise NoCheckpointError(
                f"{found_none}; nothing to evaluate: train the run, or give --checkpoint DIR"
            ) from exc
        found_path, step, skipped = found.path, found.state.step, found.skipped
    else:
        return run.recipe.model.path, None, []
    run.producer.update_weights(run.model, step or 0, force=True)
    return str(found_path), step, skipped


def _step_of(ckpt: Path) -> int | None:
    name = ckpt.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def generate(
    run: Run, task: str, rows: Sequence[dict], n: int, sampling: SamplingConfig
) -> list[PromptResult]:
    """Every row as one group of n samples through the task's loop, in row order."""
    backend = run.producer.backend
    requests = [
        GroupRequest(task, row, f"eval-{task}-{i}", n, sampling) for i, row in enumerate(rows)
    ]
    backend.submit(requests)
    outcomes: dict[str, GroupOutcome] = {}
    while backend.in_flight:
        for o in backend.collect(min_groups=backend.in_flight):
            outcomes[o.request.group_id] = o
    return [prompt_result(outcomes[r.group_id]) for r in requests]


def eval_recipe(
    source: Path, overrides: Sequence[str]
) -> tuple[RecipeConfig, Path | None, Path | None]:
    """The recipe, run directory and checkpoint of ``rltool eval SOURCE``: a run
    directory's own ``config.yaml`` (as ``train --resume`` reads it); a checkpoint
    directory of a run (``runs/a/checkpoints/step_000006``: its run's recipe); or a
    recipe YAML (no run)."""
    if not source.is_dir():
        return load_recipe(source, overrides), None, None
    run_of_ckpt = source.parents[1] if len(source.parents) > 1 else source
    if (source / MANIFEST).is_file() and (run_of_ckpt / RUN_CONFIG).is_file():
        return resume_recipe(run_of_ckpt, overrides), run_of_ckpt, source
    if not (source / RUN_CONFIG).is_file():
        raise ValueError(
            f"{source}: a directory without {RUN_CONFIG}; give a recipe YAML, the directory "
            "of a run that rltool train made (runs/<name>) or one of its checkpoints"
        )
    return resume_recipe(source, overrides), source, None


def rows_digest(rows: Sequence[dict]) -> str:
    """A task's eval rows in one hash: two evaluations are paired only on the same rows."""
    text = json.dumps(list(rows), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def evaluate_checkpoint(
    recipe: RecipeConfig,
    *,
    source: str,
    run_dir: Path | None = None,
    checkpoint: Path | None = None,
    n: int = 1,
    ks: Sequence[int] = (),
) -> EvalReport:
    """Pass@k and figures of the checkpoint on every task's eval rows. ValueErrors: a k
    outside 1..n, a task without eval rows, no complete checkpoint (NoCheckpointError)."""
    ks = check_ks(n, ks)
    if checkpoint is not None and not checkpoint.is_dir():
        raise NoCheckpointError(f"--checkpoint {checkpoint}: no such directory")
    if run_dir is not None and checkpoint is None and not (run_dir / "checkpoints").is_dir():
        raise NoCheckpointError(
            f"{run_dir}/checkpoints is missing: the run saved no checkpoint; train it, "
            "or give --checkpoint DIR"
        )
    sampling = eval_sampling(recipe, n)
    run = build_run(recipe, with_trainer=False)
    try:
        empty = [name for name, rows in run.eval_rows.items() if not rows]
        if empty:
            spec = next(s for s in run.specs if s.name == empty[0])
            raise NoEvalDataError(
                f"task {empty[0]!r}: no eval data (eval files {spec.eval_files} hold no "
                "records); give data.eval_files=[...] (or tasks[i].eval_files)"
            )
        weights, step, skipped = load_weights(run, run_dir, checkpoint)
        digests = {s.name: rows_digest(run.eval_rows[s.name]) for s in run.specs}
        per_task = {
            s.name: generate(run, s.name, run.eval_rows[s.name], n, sampling) for s in run.specs
        }
    finally:
        run.close()
    tasks = [task_figures(name, results, ks, n) for name, results in per_task.items()]
    everything = [r for rs in per_task.values() for r in rs]
    return EvalReport(
        source=source,
        weights=weights,
        step=step,
        n=n,
        ks=ks,
        sampling=asdict(sampling),
        tasks=tasks,
        # maj@n over all tasks only when every task votes
        overall=task_figures(
            "overall", everything, ks, n, vote=all(f.maj_missing is None for f in tasks)
        ),
        skipped=skipped,
        seed=recipe.trainer.seed,
        rows=digests,
    )
