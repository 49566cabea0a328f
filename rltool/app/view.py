"""What the run driver tells the person watching: the interface, and a silent default.

The driver reports through a ``RunView``; ``rltool.report.train_view.TrainView``
renders it in the terminal with rich. The application never imports the report
package: the CLI hands it a view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from rltool.produce.backend import WorkerDeath
from rltool.produce.result import GroupError
from rltool.rollout.state import RolloutState


class RunView(Protocol):
    show_staleness: bool  # async runs: token staleness and overlap on each step line

    def phase(self, text: str) -> None: ...

    def note(self, text: str) -> None: ...

    def rollout_errors(
        self, errors: Sequence[GroupError], deaths: Sequence[WorkerDeath]
    ) -> None: ...

    def progress(self, total: int, done: int = 0) -> AbstractContextManager[Callable[[], None]]: ...

    def step_line(self, step: int, metrics: dict[str, float], skipped: list[Any]) -> None: ...

    def failure(self, reason: str, example: RolloutState) -> None:
        """The first sample of the run that failed for ``reason``, shown in full."""

    def eval_line(self, step: int, metrics: dict[str, float]) -> None: ...

    def summary(self, outcome: Any, history: list[dict[str, float]]) -> None: ...


class SilentView:
    """A RunView that shows nothing (library use, benchmarks, tests)."""

    show_staleness = False

    def phase(self, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def rollout_errors(self, errors: Sequence[GroupError], deaths: Sequence[WorkerDeath]) -> None:
        pass

    @contextmanager
    def progress(self, total: int, done: int = 0) -> Iterator[Callable[[], None]]:
        yield lambda: None

    def step_line(self, step: int, metrics: dict[str, float], skipped: list[Any]) -> None:
        pass

    def failure(self, reason: str, example: RolloutState) -> None:
        pass

    def eval_line(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def summary(self, outcome: Any, history: list[dict[str, float]]) -> None:
        pass
