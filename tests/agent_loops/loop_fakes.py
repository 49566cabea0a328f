"""Shared helpers of the agentic loop tests: an engine that answers by context, span finding."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation, RolloutEngine
from rltool.rollout.state import IGNORE_INDEX, RolloutState

LOGPROB = -0.25  # every generated token's logprob


class ContextEngine(RolloutEngine):
    """Replies ``reply(decoded context)`` + EOS, whatever order concurrent sessions arrive in.

    Thread-safe bookkeeping of the batches it was called with.
    """

    def __init__(self, tokenizer, reply: Callable[[str], str], model_step: int = 0):
        self.tokenizer = tokenizer
        self.reply = reply
        self._step = model_step
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    @property
    def model_step(self) -> int:
        return self._step

    def sync_weights(self, model_step: int) -> None:
        self._step = model_step

    def load_weights(self, state_dict, model_step: int) -> None:
        self._step = model_step

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig):
        with self._lock:
            self.batch_sizes.append(len(prompts))
        out = []
        for p in prompts:
            context = self.tokenizer.decode(list(p), skip_special_tokens=False)
            ids = self.tokenizer.encode(self.reply(context), add_special_tokens=False)
            ids = [*ids, self.tokenizer.eos_token_id]
            out.append(
                Generation(
                    token_ids=ids,
                    logprobs=[LOGPROB] * len(ids),
                    model_steps=[self._step] * len(ids),
                    finish_reason="stop",
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                )
            )
        return out


def spans(state: RolloutState) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(supervised runs, unsupervised runs after the prompt) as [start, end) index pairs."""
    sup_T = np.asarray(state.labels) != IGNORE_INDEX  # [T]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], sup_T.astype(np.int8), [0]])))
    supervised = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    gaps = [(supervised[k][1], supervised[k + 1][0]) for k in range(len(supervised) - 1)]
    return supervised, gaps


def decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)
