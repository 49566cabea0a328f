"""Left padding and the shared prefill of repeated contexts for Hugging Face ``generate``.

Shape legend: B = rows, U = distinct contexts, P = padded length.
Design: docs/engines.md#shared-prefill
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] and attention mask [B, P] of ``prompts`` padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for row, p in enumerate(prompts):  # one copy per sequence
        ids[row, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions over the real tokens, 0 on padding: what ``generate`` derives from the mask."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, P]


def can_share_prefill(model: PreTrainedModel) -> bool:
    """Whether a cache built by one forward can be handed to ``generate`` (decoder-only,
    default dynamic cache, positions and cache taken by ``forward``)."""
    params = inspect.signature(model.forward).parameters
    cfg_cache = getattr(model.generation_config, "cache_implementation", None)
    return (
        not model.config.is_encoder_decoder
        and model._supports_default_dynamic_cache()
        and cfg_cache is None
        and {"position_ids", "cache", "use_cache"} <= params.keys()
    )


class SharedPrefill:
    """Builds the KV cache of repeated contexts once per distinct context.

    Turns itself off for good the first time the model's cache turns out not to be
    a plain ``DynamicCache`` (e.g. sliding-window or linear-attention layers).
    """

    def __init__(self, model: PreTrainedModel, pad_id: int):
        self.model = model
        self.pad_id = pad_id
        self.enabled = can_share_prefill(model)
        # the prefix forward's logits are unused: keep only one position where the model allows
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._prefix_kwargs = {"logits_to_keep": 1} if takes_keep else {}

    def cache(self, contexts: Sequence[Sequence[int]], mask: torch.Tensor) -> DynamicCache | None:
        """The KV cache of every row's padded context but its last token, each distinct
        context computed once and copied to its repeats; None (the unshared path) where no
        context repeats, the contexts are one token wide, or sharing is off. ``mask`` [B, P]
        is the batch's left-padded attention mask."""
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]  # [B]
        if not self.enabled or len(distinct) == len(contexts) or mask.shape[1] < 2:
            return None
        device = self.model.device
        ids, umask = left_pad(list(distinct), self.pad_id)  # [U, P]
        assert umask.shape == (len(distinct), mask.shape[1]), "distinct contexts padded differently"
        prefix_mask = umask[:, :-1]  # [U, P-1]
        out = self.model(
            input_ids=ids[:, :-1].to(device),
            # generate drops an all-ones mask; so does the prefill, to run the same kernels
            attention_mask=None if bool(mask.all()) else prefix_mask.to(device),
            position_ids=position_ids(prefix_mask).to(device),
            use_cache=True,
            **self._prefix_kwargs,
        )
        cache = getattr(out, "cache", None)
        if type(cache) is not DynamicCache or any(
            type(x) is not DynamicLayer for x in cache.layers
        ):
            self.enabled = False
            return None
        cache.batch_select_indices(torch.tensor(row_of, device=device))  # [B] rows per distinct
        return cache
