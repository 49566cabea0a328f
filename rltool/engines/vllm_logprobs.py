"""vLLM logits processor that makes vLLM report the trainer's logprobs; runs inside vLLM.

The trainer scores ``log_softmax(logits / t)`` at the sampled token (t the sampling
temperature, 1 for greedy), before top-p/top-k. No vLLM ``logprobs_mode`` is that when
top-p or top-k cut the vocabulary (``processed_logprobs`` renormalises over the kept
tokens). This processor replaces each row's logits z by ``t * log_softmax(z / t)``: the
same distribution (softmax ignores a constant shift) and the same argmax, so sampling is
unchanged; after vLLM divides by t, a kept token's ``processed_logits`` value is exactly
``log_softmax(z / t)`` at it. Use it as

    vllm serve MODEL --logprobs-mode processed_logits \\
        --logits-processors rltool.engines.vllm_logprobs:TrainerLogprobs

Imported only in vLLM's environment. Design: docs/engines.md#the-openai-server-engine
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

_GREEDY_EPS = 1e-5  # vLLM treats a temperature below this as greedy (scaled by 1)


class TrainerLogprobs(LogitsProcessor):
    """Every row's logits become ``t * log_softmax(z / t)`` (t = 1 for greedy rows)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.temperatures: dict[int, float] = {}  # batch index -> its temperature

    def is_argmax_invariant(self) -> bool:
        # False so that vLLM applies it before temperature and to greedy rows too
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.temperatures,
            batch_update,
            lambda params, _prompt, _out: (
                params.temperature if params.temperature >= _GREEDY_EPS else 1.0
            ),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        t = torch.ones(rows, 1, dtype=torch.float32, device=logits.device)  # [B, 1]
        for i, temp in self.temperatures.items():
            if i < rows:
                t[i, 0] = temp
        z = logits.to(torch.float32)  # [B, V]
        return torch.log_softmax(z / t, dim=-1) * t  # [B, V]
