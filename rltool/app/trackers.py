"""Experiment trackers behind ``logging.trackers``: every metrics line of a run also goes
to each of them. Each is an optional extra, checked before the model loads.
Design: docs/app.md#trackers
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rltool.config.schema import LoggingConfig, RecipeConfig
from rltool.registry import Registry


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackerKind:
    package: str  # the import its tracker needs, checked before the model loads
    open: Callable[[Path, RecipeConfig], Tracker]  # (run_dir, recipe) -> a started tracker


TRACKERS: Registry[TrackerKind] = Registry("tracker", "logging.trackers")


def tracker_names(cfg: LoggingConfig) -> list[str]:
    """``logging.trackers`` in order, once each; ``logging.tensorboard: true`` adds tensorboard."""
    names = [*cfg.trackers, *(["tensorboard"] if cfg.tensorboard else [])]
    return list(dict.fromkeys(names))


def check_trackers(cfg: LoggingConfig) -> None:
    """Every tracker is known and its package installed, or a ValueError saying what to
    install."""
    for name in tracker_names(cfg):
        kind = TRACKERS.get(name)
        if importlib.util.find_spec(kind.package) is None:
            raise ValueError(
                f"logging.trackers: {name} needs the {kind.package} package: "
                f"pip install 'rltool[{name}]'"
            )


def open_trackers(run_dir: Path, recipe: RecipeConfig) -> list[Tracker]:
    """The started trackers of ``recipe.logging``, writing under ``run_dir``."""
    check_trackers(recipe.logging)
    return [TRACKERS.get(name).open(run_dir, recipe) for name in tracker_names(recipe.logging)]


class TensorBoardTracker:
    """Scalars under ``RUN_DIR/tensorboard`` (``tensorboard --logdir runs``)."""

    def __init__(self, run_dir: Path, recipe: RecipeConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named ``logging.name`` in ``logging.project``, with the resolved recipe as
    its config; files under ``RUN_DIR/wandb`` (``WANDB_MODE=offline`` keeps them local)."""

    def __init__(self, run_dir: Path, recipe: RecipeConfig) -> None:
        import wandb

        config: dict[str, Any] = dataclasses.asdict(recipe)
        self._run = wandb.init(
            project=recipe.logging.project,
            name=recipe.logging.name,
            dir=str(run_dir),
            config=config,
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


TRACKERS.register("tensorboard")(TrackerKind("tensorboard", TensorBoardTracker))
TRACKERS.register("wandb")(TrackerKind("wandb", WandbTracker))
