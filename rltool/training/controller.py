"""TrainingController: grouped rollouts in, one policy update out.

``fit(groups)`` is the only place where training data is built from rollouts:
validate groups, compute session-clustered advantages, shift once, pack (all in
``convert_groups``), then hand the packs to the policy updater. Stale tokens come
already marked as not trained: the replay buffer did it when it served the groups
(``rollout/staleness.py``); the controller only reads labels. Conversion time
counts in ``time/train``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rltool.metric_names import TIME_TRAIN
from rltool.rollout.state import RolloutState
from rltool.training.batch import TrainBatch
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.updater import PolicyUpdater


@dataclass(slots=True)
class FitResult:
    batch: TrainBatch
    metrics: dict[str, float]  # data_info, actor/*, time/convert, time/train


class TrainingController:
    def __init__(self, updater: PolicyUpdater, conversion: ConversionConfig) -> None:
        self.updater = updater
        self.conversion = conversion

    def fit(self, groups: list[list[RolloutState]], train_step: int) -> FitResult:
        """Train on one step's groups; returns the batch and every metric of the step."""
        t0 = time.perf_counter()
        batch = convert_groups(groups, self.conversion, train_step=train_step)
        t_convert = time.perf_counter() - t0
        metrics = dict(batch.data_info)
        if batch.packs:
            metrics.update(self.updater.step(batch.packs))
        metrics["time/convert"] = t_convert
        metrics[TIME_TRAIN] = time.perf_counter() - t0
        return FitResult(batch=batch, metrics=metrics)
