"""TrainingController: grouped rollouts in, one policy update out.

``fit(groups)`` is the only place where training data is built from rollouts:
validate groups, compute session-clustered advantages, shift once, pack (all in
``convert_groups``), then hand the packs to the policy updater. Stale tokens come
already marked as not trained: the replay buffer did it when it served the groups
(``rollout/staleness.py``); the controller only reads labels. Conversion time
counts in ``time/train``.

Anything random in a step's training (clip_cov's draw of tokens) draws from torch's
generator seeded by (``seed``, train step) and forked, so it is the same whether the
step's groups were just generated or read back from a dump (``rltool replay``), and
generation's random stream is left as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

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
    def __init__(self, updater: PolicyUpdater, conversion: ConversionConfig, seed: int = 0) -> None:
        self.updater = updater
        self.conversion = conversion
        self.seed = seed  # trainer.seed: with the train step, seeds the step's random draws

    def fit(self, groups: list[list[RolloutState]], train_step: int) -> FitResult:
        """Train on one step's groups; returns the batch and every metric of the step."""
        t0 = time.perf_counter()
        batch = convert_groups(groups, self.conversion, train_step=train_step)
        t_convert = time.perf_counter() - t0
        metrics = dict(batch.data_info)
        if batch.packs:
            with torch.random.fork_rng(devices=_cuda_devices()):
                torch.manual_seed(step_seed(self.seed, train_step))
                metrics.update(self.updater.step(batch.packs))
        metrics["time/convert"] = t_convert
        metrics[TIME_TRAIN] = time.perf_counter() - t0
        return FitResult(batch=batch, metrics=metrics)


def step_seed(seed: int, train_step: int) -> int:
    """The seed of one train step's random draws: a function of the run's seed and the
    step only, so a replayed step draws what the original step drew."""
    return int(np.random.SeedSequence([seed, train_step]).generate_state(1)[0])


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
