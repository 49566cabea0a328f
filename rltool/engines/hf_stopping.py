"""When a row of a Hugging Face ``generate`` call stops: EOS, stop strings, pause points.

``FinishRecorder`` ends a row at its first EOS or stop string and records its
length then; ``PauseForWeights`` ends the whole call at a pause point once new
weights wait (partial rollouts). Shape legend: B = rows of the batch, E = EOS ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StopStringCriteria


class FinishRecorder(StoppingCriteria):
    """Stops a row at EOS or a stop string and records how many tokens it had then.

    ``generate`` fills finished rows with padding, and the pad id may equal an
    EOS id, so where a row ended cannot be read back from the output; this
    criterion records it while generating.
    """

    def __init__(
        self,
        prompt_len: int,
        eos_ids: torch.Tensor,
        stop: StopStringCriteria | None,
        batch: int,
    ):
        self.prompt_len = prompt_len
        self.eos_ids = eos_ids  # [E]
        self.stop = stop
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [B] 0 = not finished yet

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.isin(input_ids[:, -1], self.eos_ids)  # [B]
        if self.stop is not None:
            done |= self.stop(input_ids, scores)
        done = done.cpu()
        n_new = input_ids.shape[1] - self.prompt_len
        self.lengths = torch.where(done & (self.lengths == 0), n_new, self.lengths)  # [B]
        return done.to(input_ids.device)


class PauseForWeights(StoppingCriteria):
    """Ends the ``generate`` call at a pause point (every ``every`` new tokens) once
    ``weights_waiting()``; rows it stops are not finished and continue in the next call."""

    def __init__(self, weights_waiting: Callable[[], bool], prompt_len: int, every: int):
        self.weights_waiting, self.prompt_len, self.every = weights_waiting, prompt_len, every

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        n_new = input_ids.shape[1] - self.prompt_len
        pause = n_new % self.every == 0 and self.weights_waiting()
        return torch.full((input_ids.shape[0],), pause, dtype=torch.bool, device=input_ids.device)
