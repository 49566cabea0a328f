"""The rollout-engine interface: token ids in, token ids and logprobs out, weights in.

Every engine (in-process Hugging Face, vLLM, OpenAI-compatible servers) implements
``RolloutEngine``; the producer, the agent loops and the batchers call nothing else on
it. Engines are built by name through ``rltool.engines.registry``; the ones that hold
their own copy of the weights share ``rltool.engines.chunked``. Shape legend: R =
generated tokens of one sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rltool.config.schema import SamplingConfig


class ServersDown(ConnectionError):
    """No rollout server is left to answer (each dead, hung or past its deadline); the
    message names every server and why. ``rltool train`` stops on it (exit 3)."""


@dataclass(slots=True)
class Generation:
    token_ids: list[int]  # [R] generated tokens, EOS included when emitted, no padding
    logprobs: list[float]  # [R] log p(token) under the sampling distribution (temperature applied)
    model_steps: list[int]  # [R] policy version (train step of the weights) per token
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    text: str  # decoded token_ids, special tokens skipped
    # [P + R, L, k] MoE experts per position of prompt + token_ids (rows of -1: never fed to
    # the model, as the last token); None for a dense model or an engine that cannot record
    routed_experts: np.ndarray | None = None
    # why this sample cannot be trained (the engine's answer broke the data contract, as a
    # token id outside the vocabulary); the agent loop marks the sample FAILED with it
    error: str | None = None


def eos_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The ids every engine stops at: the tokenizer's EOS plus any extra EOS ids of the
    model's generation config (``model`` None: the tokenizer's alone)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    cfg_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += cfg_eos if isinstance(cfg_eos, list) else [] if cfg_eos is None else [cfg_eos]
    if not ids:
        raise ValueError("the tokenizer and the model's generation config define no EOS token")
    return sorted(set(ids))


class RolloutEngine(ABC):
    """Generates continuations of tokenized prompts with the current policy.

    Weights reach an engine one of two ways: ``sync_weights`` when it samples from
    the trainer's own model object (a synchronous run in one process: only the
    step changes), ``load_weights`` when it holds its own copy (asynchronous runs,
    Ray workers).
    """

    # the policy's embedding rows: every token id must be below it (data-contract
    # invariant 10); None where the engine does not know it
    vocab_size: int | None = None
    # loads a LoRA policy's adapters as an adapter (``rltool.lora_sync.AdapterPayload``
    # through ``load_weights``) instead of merged full weights
    takes_adapters: bool = False

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
        """Take the trainer's current weights, stamped as ``model_step`` (shared model)."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        """Copy in the trainer's weights of ``model_step``; may be called from another
        thread while ``generate`` runs (the engine applies them when it can). An engine
        that ``takes_adapters`` also accepts an ``AdapterPayload`` here."""

    @property
    def weights_waiting(self) -> bool:
        """Weights handed to ``load_weights`` that the engine has not applied yet. An
        engine that applies them at once never has any waiting."""
        return False

    def seed_per_sample(self, seed: int) -> bool:
        """From here on, sample each sequence from its own stream seeded from ``seed`` and
        the sample's identity, so its tokens do not depend on the rest of its batch
        (``trainer.deterministic``); False where the engine cannot (it leaves sampling as is)."""
        return False

    def pop_metrics(self) -> dict[str, float]:
        """Counters the engine kept since the last call (e.g. ``rollout/server_retries``),
        then reset; summed over a step's batches."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 (a hook: engines that hold nothing skip it)
        """Release what the engine holds (threads, processes, device memory); the run is
        ending. An engine that holds nothing beyond its Python objects has nothing to do."""
