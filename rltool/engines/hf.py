"""In-process rollout engine on Hugging Face models: the lean decode loop (the default:
hf_refill.py, all prompts with finished slots refilled; hf_decode.py a batch at a time where
rows must stay in step) or ``generate`` (``decode="reference"``, the fallback and reference:
hf_reference.py).

Shape legend: B = sequences in a batch.
Design (weights and partial rollouts, logprobs, seeding): docs/engines.md#the-hugging-face-engine
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria

from rltool.config.checks import check_value
from rltool.config.schema import ModelConfig, RolloutConfig, SamplingConfig
from rltool.engines.base import Generation, RolloutEngine, eos_ids
from rltool.engines.hf_decode import LeanDecoder, can_decode_lean
from rltool.engines.hf_prefill import SharedPrefill
from rltool.engines.hf_reference import generate_rows
from rltool.engines.hf_refill import generate_refilling
from rltool.engines.hf_routing import rows_routing
from rltool.engines.hf_rows import RowsSoFar
from rltool.engines.hf_sampling import SampleSeeds, generators
from rltool.engines.registry import ENGINES
from rltool.lora import has_lora_layers, merged_copy
from rltool.lora_sync import rollout_weights
from rltool.models import embedding_rows
from rltool.moe import find_routers, recording


def _check_sampling(sampling: SamplingConfig) -> None:
    """Sampling may come from a request (a verl loop, a session), not only the recipe: the
    recipe's own ranges (config/checks.py) apply to it too."""
    problems = [
        problem
        for name in ("temperature", "top_p", "top_k", "max_new_tokens")
        if (
            problem := check_value(
                f"sampling.{name}", getattr(sampling, name), f"rollout.sampling.{name}"
            )
        )
    ]
    if problems:
        raise ValueError("; ".join(problems))


class HFEngine(RolloutEngine):
    """Batched ``generate``; on the trainer's own model object (sync, no weight copy) or on a
    copy that takes the trainer's weights through ``load_weights`` (async; and a shared LoRA
    policy, whose merged copy ``sync_weights`` refreshes: no peft layer in the decode loop)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 64,
        model_step: int = 0,
        chunk_tokens: int | None = None,
        share_prefill: bool = True,
        record_routing: bool | None = None,
        decode: str = "lean",
        slots: int = 256,
        cache_memory: float = 0.25,
    ):
        """``record_routing``: record the experts of every position (MoE models); None =
        whenever the model has MoE routers. ``decode``: ``lean`` (hf_decode.py: static cache,
        own decode loop; ``reference`` where the model does not allow it) or ``reference``
        (``generate``). ``slots``: rows the lean refill loop decodes at once, fewer where
        their KV cache would take more than ``cache_memory`` of the free device memory, never
        fewer than ``batch_size`` (hf_refill.fitting_slots)."""
        if decode not in ("lean", "reference"):
            raise ValueError(f"decode={decode!r}: expected 'lean' or 'reference'")
        # the trainer's LoRA policy, shared: read at each sync, never generated with
        self._lora_source = model if has_lora_layers(model) else None
        if self._lora_source is not None:
            model = merged_copy(model).requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.slots, self.cache_memory = slots, cache_memory
        self.chunk_tokens = chunk_tokens
        self._model_step = model_step
        self.eos_ids = eos_ids(tokenizer, model)
        self.vocab_size = embedding_rows(model)  # its samples are ids of its own logits
        pad = tokenizer.pad_token_id
        self.pad_id = self.eos_ids[0] if pad is None else pad
        # None: every row prefills its own context, repeats included (the reference path)
        self._prefill = SharedPrefill(model, self.pad_id) if share_prefill else None
        lean = decode == "lean" and can_decode_lean(model)
        self._lean = LeanDecoder(model, self.pad_id, self.eos_ids) if lean else None
        required = "rollout.record_routing" if record_routing else None
        self._routers = find_routers(model, required) if record_routing is not False else None
        # weights handed over while a generate runs wait here for the next chunk boundary
        self._lock = threading.Lock()
        self._generating = False
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._sample_seeds: SampleSeeds | None = None  # None: torch's global generator

    def seed_per_sample(self, seed: int) -> bool:
        """Each sample from its own stream from here on (engines/hf_sampling.py)."""
        self._sample_seeds = SampleSeeds(seed)
        return True

    @property
    def model_step(self) -> int:
        return self._model_step

    @property
    def weights_waiting(self) -> bool:
        """New weights were handed over during this generate and wait for a pause point."""
        return self._pending is not None  # one reference read: no lock needed

    def pauses_at(self, n: int) -> bool:
        """Whether the lean loops stop after their ``n``-th decode step: a pause point (every
        ``chunk_tokens``) with new weights waiting."""
        every = self.chunk_tokens
        return every is not None and n % every == 0 and self.weights_waiting

    def sync_weights(self, model_step: int) -> None:
        """Record the step (the engine samples from the trainer's model object), or copy a
        shared LoRA policy's merged weights in (``load_weights``)."""
        if model_step < self._model_step:
            raise ValueError(f"sync_weights({model_step}) goes back from step {self._model_step}")
        if self._lora_source is not None:
            self.load_weights(rollout_weights(self._lora_source, self.takes_adapters), model_step)
            return
        self._model_step = model_step

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        """Copy the trainer's weights of ``model_step`` into this engine's model; thread-safe.

        Idle: copied now. During a ``generate``: a snapshot waits and is applied at the
        next pause point (every ``chunk_tokens`` new tokens) or when the call ends; a
        later call replaces a snapshot still waiting.
        """
        with self._lock:
            latest = self._pending[1] if self._pending is not None else self._model_step
            if model_step < latest:
                raise ValueError(f"load_weights({model_step}) goes back from step {latest}")
            if self._generating:
                snapshot = {k: v.detach().clone() for k, v in state_dict.items()}
                self._pending = (snapshot, model_step)
            else:
                self._copy_in(state_dict, model_step)

    def _copy_in(self, state_dict: Mapping[str, torch.Tensor], model_step: int) -> None:
        self.model.load_state_dict(state_dict, strict=True)  # in-place copy, every weight
        self._model_step = model_step

    def _apply_pending(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._copy_in(*self._pending)
                self._pending = None

    @contextmanager
    def _generating_now(self) -> Iterator[None]:
        with self._lock:
            if self._generating:
                raise RuntimeError("HFEngine.generate is already running; one call at a time")
            self._generating = True
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)
            with self._lock:
                self._generating = False
                if self._pending is not None:
                    self._copy_in(*self._pending)
                    self._pending = None

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[Generation]:
        _check_sampling(sampling)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        with self._generating_now():
            if self._refills(sampling):
                return generate_refilling(self, prompts, sampling)
            out: list[Generation] = []
            for start in range(0, len(prompts), self.batch_size):
                self._apply_pending()
                batch = prompts[start : start + self.batch_size]
                seeds = None
                if self._sample_seeds is not None and sampling.temperature > 0:
                    seeds = self._sample_seeds.next(batch, self._model_step)
                out += self._generate_batch(batch, sampling, seeds)
            return out

    def _refills(self, sampling: SamplingConfig) -> bool:
        """The lean loop over all prompts (hf_refill.py): not with routing capture or
        per-sample streams, which need every row in every forward or rows in step."""
        streams = self._sample_seeds is not None and sampling.temperature > 0
        return self._lean is not None and self._routers is None and not streams

    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """Whole generations; with ``chunk_tokens``, a call that stopped at a pause point for
        new weights is continued: the unfinished rows go on from prompt + tokens so far
        (finished rows drop out) with the new weights, each row on its own stream still
        (``seeds``: one per row; None = torch's global generator)."""
        rows = RowsSoFar.empty(len(prompts))
        streams = None if seeds is None else generators(seeds, self.model.device)
        while active := rows.unfinished(range(len(prompts)), sampling.max_new_tokens):
            done = len(rows.tokens[active[0]])
            assert all(len(rows.tokens[r]) == done for r in active), "unfinished rows out of step"
            self._apply_pending()
            contexts = [[*prompts[r], *rows.tokens[r]] for r in active]
            budget = sampling.max_new_tokens - done
            own = None if streams is None else [streams[r] for r in active]
            new, logprobs, finished, routing = self._generate_rows(contexts, sampling, budget, own)
            for r, t, lp, fin, rt in zip(active, new, logprobs, finished, routing, strict=True):
                rows.routing[r] = rt  # a continued row's context was routed again: the latest
                rows.add(r, t, lp, self._model_step, fin)
        return rows.generations(self.tokenizer)

    @torch.no_grad()
    def _generate_rows(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new: int,
        streams: Sequence[torch.Generator] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[bool], list[Any]]:
        """One ``generate`` call of at most ``max_new`` tokens: per row the new tokens (up to
        and including EOS or the stop string), their logprobs, whether the row ended, and the
        experts of context + new tokens (None per row when not recorded). ``streams``: each
        row samples from its own generator (None: from torch's global one); the lean decoder
        draws from the global one, so per-sample streams take ``generate``'s path."""
        stop = StopStringCriteria(self.tokenizer, sampling.stop) if sampling.stop else None
        if self._lean is not None and streams is None:
            return self._lean_rows(contexts, sampling, max_new, stop)
        return generate_rows(self, contexts, sampling, max_new, stop, streams)

    def _lean_rows(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new: int,
        stop: StopStringCriteria | None,
    ) -> tuple[list[list[int]], list[list[float]], list[bool], list[Any]]:
        """``_generate_rows`` on the lean decode loop (same pause points, same routing)."""
        with (
            recording(self.model, self._routers)
            if self._routers is not None
            else contextlib.nullcontext([]) as forwards
        ):
            assert self._lean is not None
            new, logprobs, ended = self._lean.decode(
                contexts, sampling, max_new, stop, self.pauses_at, compact=self._routers is None
            )
        finished = ended > 0  # [B]
        lengths = torch.where(finished, ended, new.shape[1]).tolist()  # [B]
        tokens = [new[row, :n].tolist() for row, n in enumerate(lengths)]
        lps = [logprobs[row, :n].tolist() for row, n in enumerate(lengths)]
        routing: list[Any] = [None] * len(contexts)
        if self._routers is not None:
            shared = max(len(c) for c in contexts) >= 2  # the prefix forward came first
            routing = rows_routing(forwards, contexts, lengths, shared)
        return tokens, lps, finished.tolist(), routing


@ENGINES.register("hf")
def build_hf_engine(
    rollout: RolloutConfig, model_cfg: ModelConfig, model: Any, tokenizer: Any
) -> HFEngine:
    """``rollout.engine: hf``: ``generate`` on the policy loaded in this process."""
    assert model is not None and tokenizer is not None, "the hf engine needs a loaded model"
    return HFEngine(
        model,
        tokenizer,
        batch_size=rollout.batch_size,
        chunk_tokens=rollout.chunk_tokens,
        record_routing=rollout.record_routing,
        decode=rollout.hf_decode,
        slots=rollout.hf_slots,
        cache_memory=rollout.hf_cache_memory,
    )
