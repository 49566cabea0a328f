"""Per-sample sampling streams for the Hugging Face engine (``trainer.deterministic``).

``generate`` samples a batch from torch's global generator: one draw per row per token,
so a sample's tokens depend on how many rows share its batch and where it sits. Here
each sample has its own ``torch.Generator``, seeded from (run seed, weights step, the
prompt's tokens, how many times this engine already sampled that prompt at that step):
its tokens depend on nothing else in the batch. The draw itself happens in a logits
processor that applies the warpers ``generate`` would (temperature, top-k, top-p),
samples each row with a uniform from its own stream and leaves only that token;
``generate`` then runs greedy and picks it. Shape legend: B = rows, V = vocabulary.
Design: docs/replay.md#deterministic-mode
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rltool.config.schema import SamplingConfig


class SampleSeeds:
    """The seed of each sample an engine draws: (run seed, step, prompt, k) where k counts
    the earlier samples of the same prompt at the same step (a group's n repeats get
    k = 0..n-1, whatever else is in the batch, and a prompt drawn again later in the step
    gets new k)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._step = -1
        self._drawn: dict[bytes, int] = {}  # prompt digest -> samples drawn at self._step

    def next(self, prompts: Sequence[Sequence[int]], step: int) -> list[int]:
        if step != self._step:
            self._step, self._drawn = step, {}
        out = []
        for prompt in prompts:
            digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes()).digest()
            k = self._drawn.get(digest, 0)
            self._drawn[digest] = k + 1
            head = np.asarray([self.seed, step, k], dtype=np.int64).tobytes()
            mixed = hashlib.blake2b(head + digest, digest_size=8).digest()
            out.append(int.from_bytes(mixed, "little") >> 1)  # < 2**63: any Generator takes it
        return out


def generators(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


class PerSampleSampler(LogitsProcessor):
    """Samples row b from ``streams[b]``; the scores it returns keep only that token, so a
    greedy ``generate`` takes it. The warpers and their order are ``generate``'s own for
    ``do_sample=True`` (engines/hf.py sets no other processor)."""

    def __init__(self, sampling: SamplingConfig, streams: Sequence[torch.Generator]):
        self.streams = list(streams)
        self.warpers: list[LogitsProcessor] = []
        if sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k != 0:
            self.warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert scores.shape[0] == len(self.streams), "one sampling stream per row"
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        # inverse-CDF sampling: one uniform per row from its own stream, the rest batched
        # (B multinomial calls cost more); float64 sums, and u scaled by the row's total,
        # so the index found is always a token of nonzero probability
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(-1)  # [B, V]
        u = torch.cat(  # [B, 1]
            [torch.rand(1, generator=g, device=g.device, dtype=cdf.dtype) for g in self.streams]
        ).unsqueeze(1)
        chosen = torch.searchsorted(cdf, u * cdf[:, -1:], side="right")  # [B, 1]
        out = torch.full_like(scores, -float("inf"))  # [B, V]
        return out.scatter_(1, chosen, 0.0)
