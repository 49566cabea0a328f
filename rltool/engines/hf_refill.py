"""The lean decode loop with refill: all of a ``generate``'s prompts in one loop of at most
``slots`` live rows; whenever a quarter of the slots have finished, the finished rows leave and
the next prompts take their place (one prefill of their distinct contexts), so no batch waits
for its longest row while its other slots idle.

Keys are stored after their rotary embedding, so a row's columns need not start at column 0:
each rebuild right-aligns the rows that stay and the new contexts at one common column and
drops the leading columns no row attends. Sampling draws for the live rows only, so under one
seed the sampled tokens differ from ``generate``'s (same distribution); greedy tokens and
logprobs are those of the reference path. Shape legend: N = prompts, b = live rows, W = cache
columns, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache
from transformers.generation.stopping_criteria import StopStringCriteria

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation
from rltool.engines.hf_decode import LeanDecoder, _FilledLayer, _filter_logits
from rltool.engines.hf_prefill import left_pad

if TYPE_CHECKING:  # hf.py imports this module
    from rltool.engines.hf import HFEngine


@dataclass(slots=True)
class _Live:
    """The rows being decoded; column ``filled`` is where each fed token's key goes."""

    cache: Cache  # layers of [b, H, W, D]
    filled: int
    keep: torch.Tensor  # [b, W] bool: the columns each row attends
    seq: torch.Tensor  # [b, W + 1] the token of each column, the last chosen one after it
    fed: torch.Tensor  # [b, 1] the token fed next
    pos: torch.Tensor  # [b, 1] its position
    row: torch.Tensor  # [b] the prompt index of each live row
    done: torch.Tensor  # [b] bool: finished, still in the batch (masked)


def _rebuild(
    dec: LeanDecoder, live: _Live | None, contexts: Sequence[Sequence[int]], first: int, width: int
) -> _Live:
    """The unfinished rows of ``live`` followed by ``contexts`` (prompts ``first``...), in a
    new cache with room for ``width`` more columns; finished rows and dead columns are dropped."""
    device = dec.model.device
    if live is not None:
        sel = (~live.done).nonzero().squeeze(-1)  # [s]
        attended = live.keep[sel, : live.filled].any(0).nonzero()
        lo = int(attended[0]) if len(attended) else live.filled
        old_w = live.filled - lo
    else:
        sel, lo, old_w = torch.zeros(0, dtype=torch.long, device=device), 0, 0
    ids, mask = left_pad(contexts, dec.pad_id) if contexts else (None, None)  # [n, P]
    pn = 0 if ids is None else ids.shape[1]
    col = max(old_w, pn - 1)
    s, b, w = len(sel), len(sel) + len(contexts), col + width
    if s == 0 and pn >= 2:  # only new contexts, at columns [0, col): the prefill's own cache
        cache = dec._prefill(contexts, mask, w)
    else:
        prefix = dec._prefill(contexts, mask, pn - 1) if pn >= 2 else None
        cache = _moved(dec, live, sel, lo, prefix, b, col, w)
    keep = torch.zeros((b, w), dtype=torch.bool, device=device)
    seq = torch.full((b, w + 1), dec.pad_id, dtype=torch.long, device=device)
    parts = ([], [], [])  # fed, pos, row
    if s:
        keep[:s, col - old_w : col] = live.keep[sel, lo : live.filled]
        seq[:s, col - old_w : col + 1] = live.seq[sel, lo : live.filled + 1]
        for part, x in zip(parts, (live.fed, live.pos, live.row), strict=True):
            part.append(x[sel])
    if ids is not None:
        keep[s:, col - pn + 1 : col] = mask[:, :-1].bool().to(device)
        seq[s:, col - pn + 1 : col + 1] = ids.to(device)
        parts[0].append(ids[:, -1:].to(device))
        parts[1].append((mask.sum(-1, keepdim=True) - 1).to(device))
        parts[2].append(torch.arange(first, first + len(contexts), device=device))
    fed, pos, row = (torch.cat(p) for p in parts)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    return _Live(cache, col, keep, seq, fed, pos, row, done)


def _moved(
    dec: LeanDecoder,
    live: _Live | None,
    sel: torch.Tensor,
    lo: int,
    prefix: Cache | None,
    b: int,
    col: int,
    w: int,
) -> Cache:
    """A cache of ``b`` rows and ``w`` columns filled up to ``col``: the rows ``sel`` of
    ``live`` (its columns ``lo``...), then the new contexts' rows of ``prefix``, all right-
    aligned at ``col``."""
    model, s = dec.model, len(sel)
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = Cache(layers=[_FilledLayer(w) for _ in range(cfg.num_hidden_layers)])
    shape = torch.empty((b, heads, 0, head_dim), dtype=model.dtype, device=model.device)
    for i, layer in enumerate(cache.layers):
        layer.lazy_initialization(shape, shape)
        if s:
            old = live.cache.layers[i]
            n = live.filled - lo
            layer.keys[:s, :, col - n : col] = old.keys[sel, :, lo : live.filled]
            layer.values[:s, :, col - n : col] = old.values[sel, :, lo : live.filled]
        if prefix is not None:
            n = prefix.layers[i].keys.shape[2]
            layer.keys[s:, :, col - n : col] = prefix.layers[i].keys
            layer.values[s:, :, col - n : col] = prefix.layers[i].values
        layer.filled = col
        layer.cumulative_length.fill_(col)
    return cache


@torch.no_grad()
def decode_refilling(
    dec: LeanDecoder,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    stop: StopStringCriteria | None,
    slots: int,
    may_refill: Callable[[], bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [n, T] and logprobs [n, T] (T = max_new_tokens), tokens made [n] and finished
    [n] (EOS or stop string) of ``prompts[:n]``; n = all of them unless ``may_refill()``
    said no (new weights wait): then the live rows end and no further prompt starts."""
    device, max_new = dec.model.device, sampling.max_new_tokens
    n_all = len(prompts)
    tokens = torch.full((n_all, max_new), dec.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n_all, max_new), device=device)
    made = torch.zeros(n_all, dtype=torch.long, device=device)
    finished = torch.zeros(n_all, dtype=torch.bool, device=device)
    greedy = sampling.temperature == 0
    temperature = 1.0 if greedy else sampling.temperature
    live: _Live | None = None
    started = 0
    while True:
        running = 0 if live is None else len(live.row) - int(live.done.sum())
        free = slots - running
        if started < n_all and 4 * free >= slots and may_refill():
            new = prompts[started : started + free]
            live = _rebuild(dec, live, new, started, max_new)
            started += len(new)
        elif running == 0:
            break
        elif 4 * running <= 3 * len(live.row):  # compact: finished rows leave
            live = _rebuild(dec, live, [], started, max_new)
        c = live.filled
        live.keep[:, c] = True
        out = dec.model(
            input_ids=live.fed,
            attention_mask=live.keep[:, None, None, : c + 1],  # 4D, used as is
            position_ids=live.pos,
            cache=live.cache,
            use_cache=True,
        )
        live.filled = c + 1
        scores = out.logits[:, -1].float() / temperature  # [b, V]
        if greedy:
            chosen = scores.argmax(-1)  # [b]
        else:
            filtered = _filter_logits(scores, sampling.top_k, sampling.top_p)
            chosen = torch.multinomial(filtered.softmax(-1), 1).squeeze(-1)  # [b]
        lp = scores.log_softmax(-1).gather(-1, chosen[:, None]).squeeze(-1)  # [b]
        chosen = chosen.masked_fill(live.done, dec.pad_id)
        act = live.row[~live.done]  # prompt indices of the rows that made a token
        tokens[act, made[act]] = chosen[~live.done]
        logprobs[act, made[act]] = lp[~live.done]
        made[act] += 1
        live.seq[:, c + 1] = chosen
        ended = torch.isin(chosen, dec.eos)  # [b]
        if stop is not None:
            ended |= stop(live.seq[:, : c + 2], scores).to(device)
        ended &= ~live.done
        finished[live.row[ended]] = True
        live.done |= ended | (made[live.row] >= max_new)
        live.fed, live.pos = chosen[:, None], live.pos + 1
    return tokens[:started], logprobs[:started], made[:started], finished[:started]


def generate_refilling(
    engine: HFEngine, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
) -> list[Generation]:
    """``engine.generate`` on the refilling loop: at most ``batch_size`` rows live; new weights
    handed over meanwhile are taken once the live rows end (no prompt starts before)."""
    tokenizer = engine.tokenizer
    stop = StopStringCriteria(tokenizer, sampling.stop) if sampling.stop else None
    out: list[Generation] = []
    while len(out) < len(prompts):
        engine._apply_pending()
        assert engine._lean is not None
        rows = decode_refilling(
            engine._lean,
            prompts[len(out) :],
            sampling,
            stop,
            engine.batch_size,
            lambda: not engine.weights_waiting,
        )
        for t, lp, m, e in zip(*(x.tolist() for x in rows), strict=True):
            text = tokenizer.decode(t[:m], skip_special_tokens=True)
            steps = [engine.model_step] * m
            out.append(Generation(t[:m], lp[:m], steps, "stop" if e else "length", text))
    return out
