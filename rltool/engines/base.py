"""The rollout-engine interface: token ids in, token ids and logprobs out.

The in-process Hugging Face engine implements it now; a server engine (vLLM or
SGLang over HTTP) implements the same interface later. Shape legend:
R = generated tokens of one sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from rltool.config.schema import SamplingConfig


@dataclass(slots=True)
class Generation:
    token_ids: list[int]  # [R] generated tokens, EOS included when emitted, no padding
    logprobs: list[float]  # [R] log p(token) under the sampling distribution (temperature applied)
    model_steps: list[int]  # [R] policy version (train step of the weights) per token
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    text: str  # decoded token_ids, special tokens skipped


class RolloutEngine(ABC):
    """Generates continuations of tokenized prompts with the current policy."""

    @property
    @abstractmethod
    def model_step(self) -> int:
        """Train step of the weights the engine samples from."""

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        """One Generation per prompt, in order. Batched internally."""

    @abstractmethod
    def sync_weights(self, model_step: int) -> None:
        """Take the trainer's current weights, stamped as ``model_step``."""
