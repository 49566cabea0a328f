"""The training samples' token fields, concatenated once, as the conversion reads them.

Shape legend: S = training samples, T_s = len(input_ids) of sample s, F = positions
of the concatenation they were cut from (``rltool.rollout.fields.TokenFields``, built
by the contract check; shared, not copied). Sample s sits at
``[start_S[s], start_S[s] + T_S[s])`` of every ``*_F`` array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rltool.rollout.fields import TokenFields, segments
from rltool.rollout.staleness import token_staleness
from rltool.rollout.state import IGNORE_INDEX


@dataclass(frozen=True, slots=True)
class Flat:
    """The training samples' unshifted fields; read-only to the conversion."""

    T_S: np.ndarray  # [S] int64
    P_S: np.ndarray  # [S] int64, len(prompt_ids)
    start_S: np.ndarray  # [S] int64
    input_ids_F: np.ndarray  # [F] int64
    labels_F: np.ndarray  # [F] int64
    logprobs_F: np.ndarray  # [F] float64, zeros for a sample without logprobs
    steps_start_S: np.ndarray  # [S] int64, offset in steps; -1 without response_model_steps
    steps: np.ndarray  # [sum of R over samples with steps] int64, response_model_steps
    supervised_F: np.ndarray  # [F + 1] bool, label != -100; one False past the end
    supervised_S: np.ndarray  # [S] int64, supervised labels of each sample

    @classmethod
    def of(cls, fields: TokenFields, idx: np.ndarray) -> Flat:
        """The samples ``idx`` of ``fields``, whose arrays are shared."""
        f = fields.take(idx)
        return cls(
            f.T_S, f.P_S, f.start_S, f.input_ids_F, f.labels_F, f.logprobs_F,
            f.steps_start_S, f.steps, f.supervised_F,
            f.prompt_supervised_S + f.response_supervised_S,
        )  # fmt: skip

    def supervised_targets(self) -> np.ndarray:
        """Supervised labels of each sample after the shift (all but position 0).  # [S]"""
        return self.supervised_S - self.supervised_F[self.start_S]

    def supervised_staleness(self, train_step: int) -> np.ndarray:
        """Staleness of every supervised response token of the samples with model steps."""
        w = self.steps_start_S >= 0  # [S]
        R_W = (self.T_S - self.P_S)[w]  # [W]
        label_pos = segments((self.start_S + self.P_S)[w], R_W)  # [sum R_W] response positions
        step_pos = segments(self.steps_start_S[w], R_W)  # [sum R_W]
        supervised = self.labels_F[label_pos] != IGNORE_INDEX
        return token_staleness(train_step, self.steps[step_pos[supervised]])
