"""What ``rltool train`` shows on the terminal: a progress bar, one line per step,
held-out evaluations, and a summary table at the end."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rltool import metric_names as mn

if TYPE_CHECKING:  # records only: the view does not import the producer (torch)
    from rltool.produce.backend import WorkerDeath
    from rltool.produce.result import GroupError
    from rltool.rollout.state import RolloutState

# (metric key, label, format) of the compact per-step line
STEP_FIELDS = (
    (mn.ROLLOUT_REWARD_MEAN, "reward", "{:.3f}"),
    (mn.DATA_TRAINING_SAMPLES, "samples", "{:.0f}"),
    (mn.DATA_SUPERVISED_TOKENS, "sup.tok", "{:.0f}"),
    (mn.DATA_RESPONSE_LEN_MEAN, "resp.len", "{:.1f}"),
    (mn.DATA_SKIPPED_GROUPS, "skipped", "{:.0f}"),
    (mn.ACTOR_CLIP_FRAC, "clip", "{:.3f}"),
    (mn.ACTOR_KL, "kl", "{:.4f}"),
    (mn.ACTOR_GRAD_NORM, "|g|", "{:.2f}"),
    (mn.TIME_GENERATE, "gen", "{:.1f}s"),
    (mn.TIME_TRAIN, "train", "{:.1f}s"),
    (mn.TIME_STEP, "step", "{:.1f}s"),
)


def _fmt(metrics: dict[str, float], key: str, fmt: str) -> str | None:
    value = metrics.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return fmt.format(value)


def staleness_figure(metrics: dict[str, float]) -> str | None:
    """``0:96 1:32 2+:0 exp 2 mask 5``: response tokens by staleness, samples expired and
    tokens masked as too stale; None when the step has no staleness figures."""
    if not all(k in metrics for k in mn.STALENESS_TOKENS):
        return None
    s0, s1, s2 = (int(metrics[k]) for k in mn.STALENESS_TOKENS)
    expired = int(metrics.get(mn.EXPIRED_SAMPLES, 0))
    masked = int(metrics.get(mn.STALE_TOKENS, 0))
    return f"0:{s0} 1:{s1} 2+:{s2} exp {expired} mask {masked}"


def failure_counts(metrics: dict[str, float]) -> str | None:
    """``6 (4 reward: timeout, 2 agent: ValueError)``: the step's failed samples by
    reason (the ``failures/*`` figures); None when no sample failed."""
    total = int(metrics.get(mn.FAILURES_SAMPLES, 0))
    if total == 0:
        return None
    reasons = [
        (k.removeprefix(mn.FAILURES), int(v))
        for k, v in metrics.items()
        if k.startswith(mn.FAILURES) and k != mn.FAILURES_SAMPLES
    ]
    reasons.sort(key=lambda rn: (-rn[1], rn[0]))
    return f"{total} (" + ", ".join(f"{n} {r}" for r, n in reasons) + ")"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _fates(errors: Sequence[GroupError]) -> str:
    """``3 retried, 1 counted failed``: what the producer did with the groups."""
    retried = sum(e.retried for e in errors)
    parts = [f"{retried} retried"] if retried else []
    if len(errors) - retried:
        parts.append(f"{len(errors) - retried} counted failed (second failure)")
    return ", ".join(parts)


def death_line(death: WorkerDeath, errors: Sequence[GroupError]) -> str:
    """One line per worker death, with the groups it had in flight (``errors``)."""
    head = f"rollout {death.worker} died: {death.reason}; restarted in {death.restart_s:.1f} s"
    lost = _plural(len(errors), "in-flight group")
    if not errors:
        return f"{head}; no group in flight"
    if all(e.retried for e in errors):
        return f"{head}; {lost} retried"
    return f"{head}; {lost}: {_fates(errors)}"


def error_lines(errors: Sequence[GroupError], deaths: Sequence[WorkerDeath]) -> list[str]:
    """The rollout errors of one step: a line per worker death (its lost groups counted in),
    then a line per other distinct error (a loop that raised, a lost result)."""
    by_error: dict[str, list[GroupError]] = {}
    for e in errors:
        by_error.setdefault(e.error, []).append(e)
    lines = [death_line(d, by_error.pop(d.error, [])) for d in deaths]
    for error, group in by_error.items():
        if len(group) == 1:
            lines.append(f"rollout: {group[0]}")
            continue
        ids = ", ".join(e.group_id for e in group[:3]) + (", ..." if len(group) > 3 else "")
        lines.append(f"rollout: {len(group)} groups ({ids}): {error}; {_fates(group)}")
    return lines


class TrainView:
    def __init__(self, quiet: bool = False, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.quiet = quiet
        self.show_staleness = False  # async runs: token staleness and overlap on each step line

    def phase(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[bold cyan]rltool[/] {escape(text)}")

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]{escape(text)}[/]")

    def warn(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[yellow]{escape(text)}[/]")

    def rollout_errors(self, errors: Sequence[GroupError], deaths: Sequence[WorkerDeath]) -> None:
        for line in error_lines(errors, deaths):
            self.warn(line)

    @contextmanager
    def progress(self, total: int, done: int = 0) -> Iterator[Callable[[], None]]:
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self.console, disable=self.quiet) as bar:
            task = bar.add_task("train", total=total, completed=done)
            yield lambda: bar.advance(task)

    def step_line(self, step: int, metrics: dict[str, float], skipped: list[Any]) -> None:
        if self.quiet:
            return
        parts = [f"[bold]step {step:>4}[/]"]
        for key, label, fmt in STEP_FIELDS:
            text = _fmt(metrics, key, fmt)
            if text is not None:
                parts.append(f"{label} [cyan]{text}[/]")
        figure = staleness_figure(metrics) if self.show_staleness else None
        if figure is not None:
            parts.append(f"stale [cyan]{figure}[/]")
            parts.append(f"overlap [cyan]{metrics.get(mn.TIME_OVERLAP, 0.0):.1f}s[/]")
        fired = mn.alarms_fired(metrics)
        if fired:  # health alarms (app/alarms.py); the message comes on a streak's first step
            parts.append(f"[bold red]alarm {escape(', '.join(fired))}[/]")
        self.console.print("  ".join(parts))
        if skipped:
            reasons: dict[str, int] = {}
            for g in skipped:
                reasons[g.reason] = reasons.get(g.reason, 0) + 1
            text = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
            self.console.print(f"           [yellow]skipped groups: {escape(text)}[/]")
        failed = failure_counts(metrics)
        if failed is not None:
            self.console.print(f"           [yellow]failed samples: {escape(failed)}[/]")
        dropped = int(metrics.get(mn.ROLLOUT_SERVERS_DROPPED, 0))
        if dropped:
            self.console.print(
                f"           [yellow]rollout servers dropped: {dropped} (hung or down; each "
                "named in a warning; the run goes on with the others)[/]"
            )

    def failure(self, reason: str, example: RolloutState) -> None:
        """A reason seen for the first time in the run: one sample's whole error."""
        if self.quiet:
            return
        where = f"sample {example.rollout_id}, task {example.task_name or '?'}"
        self.console.print(
            f"[bold yellow]new failure reason:[/] [yellow]{escape(reason)}[/] "
            f"[dim]({escape(where)}); the whole error:[/]"
        )
        self.console.print(escape(example.error or "(no error recorded)"), soft_wrap=True)

    def eval_line(self, step: int, metrics: dict[str, float]) -> None:
        if self.quiet:
            return
        acc = metrics.get(mn.EVAL_ACCURACY, math.nan)
        extra = "  ".join(
            f"{k.removeprefix(mn.EVAL)} {v:.3f}"
            for k, v in metrics.items()
            if k.startswith(mn.EVAL) and k != mn.EVAL_ACCURACY
        )
        self.console.print(
            f"[bold magenta]eval @ step {step:>4}[/]  accuracy [bold]{acc:.3f}[/]  "
            f"[dim]{escape(extra)}"
            f"  ({metrics.get(mn.TIME_EVAL, 0.0):.1f}s)[/]"
        )

    def summary(self, outcome: Any, history: list[dict[str, float]]) -> None:
        table = Table(title=f"rltool train: {outcome.run_dir}", show_header=True)
        table.add_column("")
        table.add_column("value", justify="right")
        first = outcome.first_eval.get(mn.EVAL_ACCURACY, math.nan)
        last = outcome.last_eval.get(mn.EVAL_ACCURACY, math.nan)
        table.add_row("steps", f"{outcome.steps_done} (stopped by {outcome.stopped_by})")
        table.add_row("held-out accuracy", f"{first:.3f} -> {last:.3f} ({last - first:+.3f})")
        if history:
            table.add_row(
                "reward, first -> last step", _first_last(history, mn.ROLLOUT_REWARD_MEAN)
            )
            for key in (mn.TIME_GENERATE, mn.TIME_TRAIN, mn.TIME_OVERLAP, mn.TIME_STEP):
                mean = sum(h.get(key, 0.0) for h in history) / len(history)
                table.add_row(f"{key} (mean)", f"{mean:.2f}s")
        failures = getattr(outcome, "failures", {})
        if failures:
            table.add_row("failed samples", str(sum(failures.values())), style="yellow")
            for reason, n in failures.items():
                table.add_row(f"  {escape(reason)}", str(n), style="yellow")
        self.console.print(table)


def _first_last(history: list[dict[str, float]], key: str) -> str:
    return f"{history[0].get(key, math.nan):.3f} -> {history[-1].get(key, math.nan):.3f}"
