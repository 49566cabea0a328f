"""Decode attention over shared prompts: the keys and values of each distinct prompt are held
once, not once per sample of its group, and a decode step's queries read them grouped by prompt.

A decode step is memory-bound on the CPU: with every row holding its own copy of its prompt's
keys and values, the 8 samples of a group read the same prompt 8 times a layer. Here the prompt
part of the scores is one batched product per prompt ([R queries] x [P keys]) and each row's own
columns (its prompt's last token and the tokens it made) a product per row; one softmax spans
both parts, so the result is that of attention over the row's whole context.

The lean refill loop (hf_refill.py) passes a ``SharedPrompts`` as the forward keyword
``rltool_prefix``; transformers hands it to the registered ``sdpa`` attention function, which
routes it here (``attention_or_sdpa``; the trainer's ``segment_attention`` falls back to it).
Shape legend: b = rows, U = distinct prompts, R = most rows of one prompt, P = prompt columns,
T = a row's own columns, H = query heads, K = key/value heads, D = head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PROMPTS_KWARG = "rltool_prefix"  # the forward keyword that carries the SharedPrompts


@dataclass(slots=True)
class SharedPrompts:
    """The distinct prompts' keys and values (all but each prompt's last token, left-padded)
    and the prompt of each row, as a slot of a [U, R] grid."""

    keys: list[torch.Tensor]  # a layer: [U, K, P, D]
    values: list[torch.Tensor]  # a layer: [U, K, P, D]
    keep: torch.Tensor  # [U, P] bool: the prompt's real columns
    prompt_of: torch.Tensor  # [b] the prompt of each row
    slot: torch.Tensor  # [b] prompt * R + the row's rank among its prompt's rows
    per_prompt: int  # R
    calls: int = 0  # attention calls served (the decoder checks one per layer)
    # the columns each row attends, prompt then own, for the step's own-column mask (every
    # layer of a forward gets the same mask tensor: made once a step)
    _allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of_rows(
        cls,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        keep: torch.Tensor,
        prompt_of: torch.Tensor,
    ) -> SharedPrompts:
        """The grid slots of rows whose prompts are ``prompt_of`` [b]."""
        u = keep.shape[0]
        onehot = torch.nn.functional.one_hot(prompt_of, u)  # [b, U]
        rank = (onehot.cumsum(0) * onehot).sum(-1) - 1  # [b] rows of its prompt before it
        per = int(onehot.sum(0).max()) if len(prompt_of) else 1
        return cls(keys, values, keep, prompt_of, prompt_of * per + rank, per)

    def allowed(self, own: torch.Tensor) -> torch.Tensor:
        """[b, P + T] bool: the row's prompt columns, then ``own`` [b, 1, 1, T]."""
        if self._allowed is None or self._allowed[0] is not own:
            mask = torch.cat([self.keep[self.prompt_of], own.view(len(own), -1)], -1)
            self._allowed = (own, mask)
        return self._allowed[1]


def _grid(x: torch.Tensor, prompts: SharedPrompts) -> torch.Tensor:
    """Rows [b, H, ...] laid out by prompt: [U, K, R * H/K, ...] (absent slots zero)."""
    u, k = prompts.keep.shape[0], prompts.keys[0].shape[1]
    _, h, *rest = x.shape
    grid = x.new_zeros((u * prompts.per_prompt, h, *rest)).index_copy_(0, prompts.slot, x)
    grid = grid.view(u, prompts.per_prompt, k, h // k, *rest).transpose(1, 2)
    return grid.reshape(u, k, prompts.per_prompt * (h // k), *rest)


def _rows(grid: torch.Tensor, prompts: SharedPrompts, h: int) -> torch.Tensor:
    """The inverse of ``_grid``: [U, K, R * H/K, ...] -> rows [b, H, ...]."""
    u, k, _, *rest = grid.shape
    grid = grid.view(u, k, prompts.per_prompt, h // k, *rest).transpose(1, 2)
    return grid.reshape(u * prompts.per_prompt, h, *rest).index_select(0, prompts.slot)


def prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One decode step: ``query`` [b, H, 1, D] against the row's prompt (``kwargs``'
    SharedPrompts, layer ``module.layer_idx``) and its own columns ``key``/``value``
    [b, K, T, D] where ``attention_mask`` [b, 1, 1, T] (bool) allows. Returns [b, 1, H, D]."""
    prompts: SharedPrompts = kwargs[PROMPTS_KWARG]
    if query.shape[2] != 1:
        raise ValueError(f"shared-prompt attention decodes one token a row, got {query.shape[2]}")
    layer = module.layer_idx
    pk, pv = prompts.keys[layer], prompts.values[layer]  # [U, K, P, D]
    b, h, _, d = query.shape
    k, p = key.shape[1], pk.shape[2]
    scale = d**-0.5 if scaling is None else scaling
    q = query[:, :, 0]  # [b, H, D]
    from_prompt = _rows(_grid(q, prompts) @ pk.transpose(-1, -2), prompts, h)  # [b, H, P]
    own = q.view(b, k, h // k, d) @ key.transpose(-1, -2)  # [b, K, H/K, T]
    scores = torch.cat([from_prompt, own.view(b, h, -1)], -1) * scale  # [b, H, P + T]
    allowed = prompts.allowed(attention_mask)  # [b, P + T]
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)  # [b, H, P + T]
    out = _rows(_grid(probs[..., :p], prompts) @ pv, prompts, h)  # [b, H, D]
    out = out + (probs[..., p:].view(b, k, h // k, -1) @ value).view(b, h, d)
    prompts.calls += 1
    return out[:, None].to(query.dtype), None  # [b, 1, H, D]


def attention_or_sdpa(module, query, key, value, attention_mask, **kwargs):
    """``prompt_attention`` for a forward that passes SharedPrompts, else transformers' sdpa."""
    if kwargs.get(PROMPTS_KWARG) is not None:
        return prompt_attention(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


# the trainer's segment_attention (rltool/training/attention.py) replaces this and falls back
# to attention_or_sdpa; the decoder checks every layer was served (SharedPrompts.calls)
if ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward:
    AttentionInterface.register("sdpa", attention_or_sdpa)
