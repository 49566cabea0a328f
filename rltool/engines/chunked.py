"""The base of the engines that hold their own copy of the weights (vLLM in process, servers).

What they share: generation in rounds of at most ``rollout.chunk_tokens`` new tokens
(partial rollouts: between rounds, weights that arrived are loaded), each token stamped
with the step of the weights that sampled it, a stop string split across two rounds cut
where it ends, the trainer's weights (``rltool.lora_sync.rollout_weights``: a LoRA
policy's adapters where the engine ``takes_adapters``, else merged) written to a file or
an adapter folder and applied through ``PendingWeights``, the bytes each sync moved
(``rollout/weight_sync_bytes``), the EOS ids. What each engine does itself: send one
round's requests (``_complete``), write a weights file or an adapter and load it
(``_write_weights``, ``_write_adapter``, ``_load_file``). Shape legend: R = generated
tokens of one sequence. Design: docs/engines.md#weight-hand-off
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine, eos_ids
from rltool.engines.weight_handoff import PendingWeights
from rltool.lora_sync import AdapterPayload, RolloutWeights, rollout_weights, weights_nbytes
from rltool.metric_names import ROLLOUT_WEIGHT_SYNC_BYTES
from rltool.models import embedding_rows


@dataclass(frozen=True, slots=True)
class Request:
    """``n`` samples of at most ``max_tokens`` new tokens after ``context`` (prompt +
    tokens so far)."""

    context: tuple[int, ...]
    n: int
    max_tokens: int


@dataclass(slots=True)
class Completion:
    """One sample of a request."""

    token_ids: list[int]  # [R]
    logprobs: list[float]  # [R]
    stopped: bool  # EOS or a stop string (False: the token budget ran out)
    error: str | None = None  # the answer breaks the contract: the row ends, its sample fails


@dataclass(slots=True)
class _Row:
    """What one output row generated so far (R entries each)."""

    prompt: tuple[int, ...]
    tokens: list[int]
    logprobs: list[float]
    steps: list[int]
    finished: bool = False
    error: str | None = None  # Completion.error: the row's tokens are not the policy's


def first_stop(tokenizer: Any, tokens: list[int], stops: Sequence[str], start: int) -> int | None:
    """Length of the shortest prefix of ``tokens`` (longer than ``start``) whose text holds a
    stop string, or None: a stop string split across two calls (partial rollouts)."""
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    for n in range(start + 1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:n]) for s in stops):
            return n
    return None


class ChunkedEngine(RolloutEngine):
    """Generates in rounds; holds its own copy of the weights, loaded from files.

    ``model``: the trainer's model (a synchronous in-process run), whose weights
    ``sync_weights`` sends; None where only ``load_weights`` is used.
    """

    def __init__(
        self,
        tokenizer: Any,
        model: torch.nn.Module | None,
        chunk_tokens: int | None = None,
        model_step: int = 0,
        vocab_size: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.model = model
        if vocab_size is None and model is not None:
            vocab_size = embedding_rows(model)
        self.vocab_size = vocab_size  # None: the engine knows no model (tests, library use)
        self.owner = type(self).__name__  # names the engine in errors
        self.chunk_tokens = chunk_tokens
        self.eos = eos_ids(tokenizer, model)
        self._weights = PendingWeights(self._load_file, self.owner, model_step)
        self._sync_bytes = 0  # handed to load_weights since the last pop_metrics

    @abstractmethod
    def _complete(
        self, requests: Sequence[Request], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """``request.n`` completions per request, in order."""

    @abstractmethod
    def _write_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> Path:
        """Write ``state_dict`` to a file the engine can load; its path."""

    def _write_adapter(self, payload: AdapterPayload, model_step: int) -> Path:
        """Write a LoRA adapter where the engine can load it (peft's folder); its path.
        Only an engine that ``takes_adapters`` is sent one."""
        raise ValueError(
            f"{self.owner} does not load LoRA adapters (takes_adapters is False); send it "
            "merged weights (rltool.lora.rollout_state_dict)"
        )

    @abstractmethod
    def _load_file(self, path: Path, model_step: int) -> None:
        """Load a written file, or an adapter's folder (under ``PendingWeights``' lock)."""

    def _start_generate(self) -> None:
        """Runs before a ``generate``, after waiting weights were applied."""

    def _end_generate(self) -> None:
        """Runs after a ``generate``, after waiting weights were applied."""

    @property
    def model_step(self) -> int:
        return self._weights.step

    @property
    def weights_waiting(self) -> bool:
        return self._weights.waiting

    def pop_metrics(self) -> dict[str, float]:
        """The bytes of the weights sent since the last call, when any were."""
        sent, self._sync_bytes = self._sync_bytes, 0
        return {ROLLOUT_WEIGHT_SYNC_BYTES: float(sent)} if sent else {}

    def sync_weights(self, model_step: int) -> None:
        """The trainer's model is not the engine's copy: its weights (a LoRA policy's
        adapters where the engine takes them, else merged under the base names) are sent
        as ``load_weights`` sends them."""
        if self.model is None:
            raise ValueError(
                f"{self.owner}.sync_weights needs the trainer's model (the engine was built "
                "without it); use load_weights"
            )
        self.load_weights(rollout_weights(self.model, self.takes_adapters), model_step)

    def load_weights(self, state_dict: RolloutWeights, model_step: int) -> None:
        """Write the weights (or an ``AdapterPayload``) now; they are loaded now, or,
        during a ``generate``, at its next pause point (every ``chunk_tokens``) or when it
        ends (a later call replaces them while they wait)."""
        self._weights.check(model_step)
        if isinstance(state_dict, AdapterPayload):
            path = self._write_adapter(state_dict, model_step)
        else:
            path = self._write_weights(state_dict, model_step)
        self._sync_bytes += weights_nbytes(state_dict)
        self._weights.offer(path, model_step)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        rows = [_Row(tuple(int(t) for t in p), [], [], []) for p in prompts]
        with self._weights.generating(start=self._start_generate, end=self._end_generate):
            while self._round(rows, sampling):
                pass
        return [
            Generation(
                token_ids=r.tokens,
                logprobs=r.logprobs,
                model_steps=r.steps,
                finish_reason="stop" if r.finished else "length",
                # ids outside the vocabulary cannot be decoded (the tokenizer's OverflowError)
                text="" if r.error else self.tokenizer.decode(r.tokens, skip_special_tokens=True),
                error=r.error,
            )
            for r in rows
        ]

    def _round(self, rows: list[_Row], sampling: SamplingConfig) -> bool:
        """One request per distinct context of the unfinished rows (``n`` = its rows: a
        group's prompt is prefilled once), at most ``chunk_tokens`` new tokens each; False
        when every row is done."""
        budget = sampling.max_new_tokens
        active = [r for r in rows if not r.finished and len(r.tokens) < budget]
        if not active:
            return False
        self._weights.apply_waiting()  # a pause point
        step = self._weights.step
        by_context: dict[tuple[int, ...], list[_Row]] = {}
        for r in active:
            by_context.setdefault(r.prompt + tuple(r.tokens), []).append(r)
        requests = []
        for context, members in by_context.items():
            left = budget - len(members[0].tokens)
            chunk = left if self.chunk_tokens is None else min(left, self.chunk_tokens)
            requests.append(Request(context, len(members), chunk))
        answers = self._complete(requests, sampling)
        for members, completions in zip(by_context.values(), answers, strict=True):
            if len(completions) != len(members):
                raise RuntimeError(
                    f"{self.owner}: asked for {len(members)} samples, got {len(completions)}"
                )
            for r, c in zip(members, completions, strict=True):
                done = len(r.tokens)
                r.tokens += c.token_ids
                r.logprobs += c.logprobs
                r.steps += [step] * len(c.token_ids)
                if c.error is not None:  # nothing more to generate for a failed sample
                    r.error, r.finished = c.error, True
                    continue
                cut = self._cut_at_stop(r, sampling.stop, done)  # even if it stopped later
                r.finished = cut or c.stopped
        return True

    def _cut_at_stop(self, row: _Row, stop: Sequence[str], done: int) -> bool:
        """A stop string that spans a pause point (the engine saw only its second part):
        cut the row after the token that completes it. True if one did."""
        if not stop or done == 0:
            return False
        k = first_stop(self.tokenizer, row.tokens, stop, done)
        if k is None:
            return False
        del row.tokens[k:], row.logprobs[k:], row.steps[k:]
        return True
