"""The lean decode path of the Hugging Face engine (``rollout.hf_decode: lean``): one prefill of
each distinct context, a preallocated (static) KV cache, and a decode loop whose per-step work is
a fixed set of tensor operations over the whole batch (finished rows stay in, masked).

It returns what ``HFEngine._generate_rows`` returns for ``generate``, the parity reference:
the same greedy tokens, logprobs of the untempered-then-tempered logits (``log_softmax(logits /
T)``), the same pause points and the same recorded forwards for routing capture.
Shape legend: B = rows, U = distinct contexts, P = padded context length, W = cache length
(P - 1 + max_new), V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.generation.stopping_criteria import StopStringCriteria

from rltool.config.schema import SamplingConfig
from rltool.engines.hf_prefill import can_share_prefill, left_pad, position_ids


def can_decode_lean(model: PreTrainedModel) -> bool:
    """Whether the lean loop can drive ``model``: a decoder whose layers all attend fully
    (no sliding window or linear attention) through sdpa attention."""
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (
        can_share_prefill(model)
        and set(layer_types) == {"full_attention"}
        and cfg._attn_implementation == "sdpa"
    )


def _filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of tempered ``scores`` [B, V], as ``generate``'s
    warpers do it (at least one token kept)."""
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]  # [B, 1]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)  # [B, V]
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return scores


class _FilledLayer(StaticLayer):
    """A static layer whose attention reads only the filled columns (a view of the
    preallocated buffers), not all W: short rows do not pay for the longest possible one."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len)
        self.filled = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As StaticLayer's, but the buffers are left unfilled: every row's column is written
        before attention reads it (the prefill's copy, a decode step's key)."""
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        kw = {"dtype": key_states.dtype, "device": self.device}
        self.keys = torch.empty((*shape, self.k_head_dim), **kw)
        self.values = torch.empty((*shape, self.v_head_dim), **kw)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        self.keys[:, :, self.filled : end] = key_states
        self.values[:, :, self.filled : end] = value_states
        self.filled = end
        self.cumulative_length.fill_(end)
        return self.keys[:, :, :end], self.values[:, :, :end]  # [b, H, filled, D]


class LeanDecoder:
    """Decodes one batch of left-padded contexts on a static KV cache."""

    def __init__(self, model: PreTrainedModel, pad_id: int, eos_ids: Sequence[int]):
        self.model = model
        self.pad_id = pad_id
        self.eos = torch.tensor(list(eos_ids), device=model.device)  # [E]

    def prefix(
        self, contexts: Sequence[Sequence[int]]
    ) -> tuple[DynamicCache | None, torch.Tensor, torch.Tensor]:
        """Each distinct context's cache but its last token (a layer [U, K, P-1, D]; None where
        every context is one token), the distinct context of each row [B] and the distinct
        contexts' left-padded mask [U, P]: the first recorded forward."""
        device = self.model.device
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]  # [B]
        ids, umask = left_pad(list(distinct), self.pad_id)  # [U, P]
        rows = torch.tensor(row_of, device=device)
        if ids.shape[1] < 2:
            return None, rows, umask
        prefix_mask = umask[:, :-1]  # [U, P-1]
        out = self.model(
            input_ids=ids[:, :-1].to(device),
            attention_mask=None if bool(umask.all()) else prefix_mask.to(device),
            position_ids=position_ids(prefix_mask).to(device),
            use_cache=True,
            logits_to_keep=1,
        )
        assert type(out.cache) is DynamicCache and all(
            type(x) is DynamicLayer for x in out.cache.layers
        ), "can_decode_lean admitted a model whose cache is not a plain DynamicCache"
        return out.cache, rows, umask

    def _prefill(self, contexts: Sequence[Sequence[int]], width: int) -> Cache:
        """A static cache of W positions holding every row's context but its last token, each
        distinct context computed once (``prefix``) and copied to its rows."""
        n_layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        cache = Cache(layers=[_FilledLayer(width) for _ in range(n_layers)])
        prefix, rows, _ = self.prefix(contexts)
        if prefix is None:
            return cache
        for layer, src in zip(cache.layers, prefix.layers, strict=True):
            keys, values = src.keys[rows], src.values[rows]  # [B, H, P-1, D]
            p = keys.shape[2]
            layer.lazy_initialization(keys, values)
            layer.keys[:, :, :p] = keys
            layer.values[:, :, :p] = values
            layer.cumulative_length.fill_(p)
            layer.filled = p
        return cache

    @torch.no_grad()
    def decode(
        self,
        contexts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new: int,
        stop: StopStringCriteria | None,
        pause: Callable[[int], bool],
        compact: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New tokens [B, T], their logprobs [B, T] and each row's finished length [B] (0 =
        not finished), T <= ``max_new``; ``pause(n)`` after n new tokens ends the call early.

        ``compact``: once half the rows still decoded have finished, the rest leave the batch
        (their cache rows are copied out: at most log2(B) times); off, every forward has B rows
        (what routing capture needs). Sampling always draws for all B rows, as ``generate``
        does, so one seed gives the same draws either way.
        """
        device = self.model.device
        ids, mask = left_pad(contexts, self.pad_id)  # [B, P]
        b, p = ids.shape
        cache = self._prefill(contexts, p - 1 + max_new)
        # the columns each decoded row attends to, set as the decode reaches them
        keep = torch.zeros((b, 1, 1, p - 1 + max_new), dtype=torch.bool, device=device)
        keep[:, 0, 0, : p - 1] = mask[:, :-1].bool().to(device)  # [b, 1, 1, W]
        pos = (mask.sum(-1, keepdim=True) - 1).to(device)  # [b, 1] position of the fed token
        fed = ids[:, -1:].to(device)  # [b, 1]
        live = torch.arange(b, device=device)  # [b] the batch row of each decoded row
        seq = torch.full((b, p + max_new), self.pad_id, dtype=torch.long, device=device)
        seq[:, :p] = ids.to(device)  # [B, P + max_new] for stop strings
        scores = torch.zeros((b, self.model.config.get_text_config().vocab_size), device=device)
        logprobs = torch.zeros((b, max_new), device=device)  # [B, max_new]
        lengths = torch.zeros(b, dtype=torch.long, device=device)  # [B] 0 = not finished
        done = torch.zeros(b, dtype=torch.bool, device=device)  # [B]
        greedy = sampling.temperature == 0
        temperature = 1.0 if greedy else sampling.temperature
        steps = 0
        for step in range(max_new):
            keep[:, 0, 0, p - 1 + step] = True
            out = self.model(
                input_ids=fed,
                attention_mask=keep[..., : p + step],  # 4D: used as is (sdpa: True = attend)
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
            step_scores = out.logits[:, -1].float() / temperature  # [b, V]
            if scores.shape[1] != step_scores.shape[1]:  # a vocabulary resized since
                scores = torch.zeros((b, step_scores.shape[1]), device=device)
            scores.index_copy_(0, live, step_scores)  # [B, V] finished rows: stale, unused
            if greedy:
                chosen = scores.argmax(-1)  # [B]
            else:
                filtered = _filter_logits(scores, sampling.top_k, sampling.top_p)
                chosen = torch.multinomial(filtered.softmax(-1), 1).squeeze(-1)  # [B]
            picked = chosen[live, None]  # [b, 1]
            lp = step_scores.log_softmax(-1).gather(-1, picked).squeeze(-1)  # [b]
            logprobs[live, step] = lp
            chosen = chosen.masked_fill(done, self.pad_id)  # finished rows take padding
            seq[:, p + step] = chosen
            steps = step + 1
            ended = torch.isin(chosen, self.eos)  # [B]
            if stop is not None:
                ended |= stop(seq[:, : p + steps], scores).to(device)
            lengths = torch.where(ended & (lengths == 0), steps, lengths)
            done |= ended
            if bool(done.all()) or pause(steps):
                break
            fed, pos = picked, pos + 1
            still = ~done[live]  # [b]
            if compact and 4 * int(still.sum()) <= 3 * len(live):
                keep, pos, fed, live = keep[still], pos[still], fed[still], live[still]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[still], layer.values[still]
        return seq[:, p : p + steps].cpu(), logprobs[:, :steps].cpu(), lengths.cpu()
