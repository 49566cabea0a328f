"""The lean decode loop with refill: all of a ``generate``'s prompts in one loop of at most
``slots`` live rows; whenever a quarter of the slots have finished, the finished rows leave and
the next prompts take their place (one prefill of their distinct contexts), so no batch waits
for its longest row while its other slots idle.

Each distinct prompt's keys and values (all but its last token) are held once and read by its
rows grouped (hf_prompt_attention.py); a row's own cache holds its prompt's last token and the
tokens it made. Keys are stored after their rotary embedding, so columns need not start at 0:
each rebuild keeps the prompts and own columns the staying rows still attend, the new prompts
right-aligned beside them. Sampling draws for the live rows only, so under one
seed the sampled tokens differ from ``generate``'s (same distribution); greedy tokens and
logprobs are those of the reference path. Shape legend: N = prompts, b = live rows, W = own
columns, K = key/value heads, D = head size, V = vocabulary.
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
from rltool.engines.hf_prompt_attention import PROMPTS_KWARG, SharedPrompts

if TYPE_CHECKING:  # hf.py imports this module
    from rltool.engines.hf import HFEngine


@dataclass(slots=True)
class _Live:
    """The rows being decoded; column ``filled`` of their own cache is where each fed token's
    key goes. Their prompts' keys are held once per distinct prompt (``prompts``)."""

    cache: Cache  # layers of [b, K, W, D]: each row's own columns (shared prompts: from the
    # prompt's last token on; else its whole context)
    filled: int
    keep: torch.Tensor  # [b, W] bool: the own columns each row attends
    prompts: SharedPrompts | None  # all but each prompt's last token once (None: in own columns)
    tail: torch.Tensor  # [b, L] the last L tokens of each row (stop strings), the fed one last
    fed: torch.Tensor  # [b, 1] the token fed next
    pos: torch.Tensor  # [b, 1] its position
    row: torch.Tensor  # [b] the prompt index of each live row
    done: torch.Tensor  # [b] bool: finished, still in the batch (masked)


def _kept_prompts(
    live: _Live, sel: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The prompts of the staying rows ``sel`` [s] without the leading columns none of them
    attends: keys and values (a layer [k, K, P, D]), mask [k, P], each row's prompt [s]."""
    kept, prompt_of = torch.unique(live.prompts.prompt_of[sel], return_inverse=True)  # [k], [s]
    keep = live.prompts.keep[kept]  # [k, P]
    cols = keep.any(0).nonzero()
    lo = int(cols[0]) if len(cols) else keep.shape[1]
    keys = [k[kept][:, :, lo:] for k in live.prompts.keys]
    values = [v[kept][:, :, lo:] for v in live.prompts.values]
    return keys, values, keep[:, lo:], prompt_of


def _joined(
    dec: LeanDecoder,
    old: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor],
    new: tuple[Cache | None, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The kept prompts then the new distinct ones, right-aligned at one width: keys and values
    (a layer [k + u, K, P, D]) and mask [k + u, P]. ``new``: the new contexts' prefix cache
    (None: one-token contexts) and their left-padded mask [u, Pn]."""
    old_keys, old_values, old_keep = old
    prefix, umask = new
    pn = umask.shape[1] - 1 if prefix is not None else 0
    k, u, p = old_keep.shape[0], umask.shape[0], max(old_keep.shape[1], pn)
    layers, heads, head_dim = _kv_shape(dec)
    device, dtype = dec.model.device, dec.model.dtype
    keep = torch.zeros((k + u, p), dtype=torch.bool, device=device)
    keep[:k, p - old_keep.shape[1] :] = old_keep
    if pn:
        keep[k:, p - pn :] = umask[:, :-1].bool().to(device)

    def joined(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor:
        x = torch.zeros((k + u, heads, p, head_dim), dtype=dtype, device=device)
        if old is not None:
            x[:k, :, p - old.shape[2] :] = old
        if new is not None:
            x[k:, :, p - pn :] = new
        return x  # [k + u, K, P, D]

    new_layers = prefix.layers if pn else [None] * layers
    keys = [
        joined(old_keys[i] if k else None, None if n is None else n.keys)
        for i, n in enumerate(new_layers)
    ]
    values = [
        joined(old_values[i] if k else None, None if n is None else n.values)
        for i, n in enumerate(new_layers)
    ]
    return keys, values, keep


def _kv_shape(dec: LeanDecoder) -> tuple[int, int, int]:
    """Layers, key/value heads and head size of the decoder's model."""
    cfg = dec.model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def _own_cache(
    dec: LeanDecoder,
    live: _Live | None,
    sel: torch.Tensor,
    lo: int,
    b: int,
    col: int,
    w: int,
    prompts: tuple[Cache, torch.Tensor] | None,
):
    """A cache of ``b`` rows and ``w`` columns filled up to ``col``: the own columns ``lo``...
    of the staying rows ``sel`` of ``live``, right-aligned at ``col``; then the new rows, with
    ``prompts`` (a prefix cache and the prefix of each new row) right-aligned at ``col`` where
    prompts are not shared."""
    layers, heads, head_dim = _kv_shape(dec)
    model, s = dec.model, len(sel)
    n = 0 if live is None else live.filled - lo
    cache = Cache(layers=[_FilledLayer(w) for _ in range(layers)])
    shape = torch.empty((b, heads, 0, head_dim), dtype=model.dtype, device=model.device)
    for i, layer in enumerate(cache.layers):
        layer.lazy_initialization(shape, shape)
        # columns read but masked (before a row's first) must be finite: 0 x value = 0
        layer.keys[:, :, :col] = 0
        layer.values[:, :, :col] = 0
        if s and n:
            old = live.cache.layers[i]
            layer.keys[:s, :, col - n : col] = old.keys[sel, :, lo : live.filled]
            layer.values[:s, :, col - n : col] = old.values[sel, :, lo : live.filled]
        if prompts is not None:
            prefix, rows = prompts
            src = prefix.layers[i]
            p = src.keys.shape[2]
            layer.keys[s:, :, col - p : col] = src.keys[rows]
            layer.values[s:, :, col - p : col] = src.values[rows]
        layer.filled = col
        layer.cumulative_length.fill_(col)
    return cache


def _tails(contexts: Sequence[Sequence[int]], tail: int, pad_id: int) -> torch.Tensor:
    """The last ``tail`` tokens of each context, left-padded: [c, L]."""
    out = torch.full((len(contexts), tail), pad_id, dtype=torch.long)
    for i, c in enumerate(contexts):
        last = c[len(c) - tail :] if tail else []
        out[i, tail - len(last) :] = torch.as_tensor(last, dtype=torch.long)
    return out


def _rebuild(
    dec: LeanDecoder,
    live: _Live | None,
    contexts: Sequence[Sequence[int]],
    first: int,
    width: int,
    tail: int,
    shared: bool,
) -> _Live:
    """The unfinished rows of ``live`` followed by ``contexts`` (prompts ``first``...), with
    room for ``width`` more own columns; finished rows, prompts no row reads any more and dead
    columns are dropped; each new distinct context is prefilled once. ``shared``: the prompts
    are held once (SharedPrompts), else each row holds its own in its own columns."""
    device = dec.model.device
    sel, lo = torch.zeros(0, dtype=torch.long, device=device), 0
    if live is not None:
        sel = (~live.done).nonzero().squeeze(-1)  # [s]
        attended = live.keep[sel, : live.filled].any(0).nonzero()
        lo = int(attended[0]) if len(attended) else live.filled
    n = 0 if live is None else live.filled - lo
    s, b = len(sel), len(sel) + len(contexts)
    prefix, new_of, umask = dec.prefix(contexts) if contexts else (None, sel[:0], None)
    pn = 0 if prefix is None else umask.shape[1] - 1  # prompt columns of the new rows
    col = n if shared else max(n, pn)
    prompts = _prompts_of(dec, live, sel, (prefix, new_of, umask)) if shared else None
    keep = torch.zeros((b, col + width), dtype=torch.bool, device=device)
    parts = ([], [], [], [])  # fed, pos, row, tail
    if s:
        keep[:s, col - n : col] = live.keep[sel, lo : live.filled]
        for part, x in zip(parts, (live.fed, live.pos, live.row, live.tail), strict=True):
            part.append(x[sel])
    if contexts:
        ids, mask = left_pad(contexts, dec.pad_id)  # [c, P]
        if not shared and pn:
            keep[s:, col - pn : col] = mask[:, :-1].bool().to(device)
        parts[0].append(ids[:, -1:].to(device))
        parts[1].append((mask.sum(-1, keepdim=True) - 1).to(device))
        parts[2].append(torch.arange(first, first + len(contexts), device=device))
        parts[3].append(_tails(contexts, tail, dec.pad_id).to(device))
    fed, pos, row, tails = (torch.cat(p) for p in parts)
    own_prompts = None if shared or prefix is None else (prefix, new_of)
    cache = _own_cache(dec, live, sel, lo, b, col, col + width, own_prompts)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    return _Live(cache, col, keep, prompts, tails.to(device), fed, pos, row, done)


def _prompts_of(
    dec: LeanDecoder,
    live: _Live | None,
    sel: torch.Tensor,
    new: tuple[Cache | None, torch.Tensor, torch.Tensor | None],
) -> SharedPrompts:
    """The shared prompts of the staying rows ``sel`` of ``live`` and of the new rows (their
    prefix cache, distinct context of each row and the distinct contexts' mask)."""
    prefix, new_of, umask = new
    if live is not None:
        *old, old_of = _kept_prompts(live, sel)
    else:
        old, old_of = [[], [], torch.zeros((0, 0), dtype=torch.bool, device=sel.device)], sel
    if umask is None:
        umask = torch.zeros((0, 1), dtype=torch.long)
    keys, values, keep = _joined(dec, old, (prefix, umask))
    prompt_of = torch.cat([old_of, new_of + len(old[2])])  # [b]
    return SharedPrompts.of_rows(keys, values, keep, prompt_of)


def shares_prompts(prompts: Sequence[Sequence[int]], slots: int) -> bool:
    """Whether the refill loop holds each distinct prompt once: where a step has at least 128
    rows and a prompt at least 4 rows on average. Below that, shared-prompt attention's dozen
    small operations a layer cost more than the prompt copies they save (one layer, 2 threads:
    64 rows of 8 per prompt 1.18 ms against SDPA's 1.10; 128 rows of 4, 1.04 against 1.41;
    256 rows of 8, 3.2 against 4.8; docs/engines.md)."""
    rows = min(slots, len(prompts))
    return rows >= 128 and len(prompts) >= 4 * len({tuple(p) for p in prompts})


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
    tail = 0 if stop is None else stop.maximum_token_len  # what a stop string looks back on
    shared = shares_prompts(prompts, slots)
    while True:
        running = 0 if live is None else len(live.row) - int(live.done.sum())
        free = slots - running
        if started < n_all and 4 * free >= slots and may_refill():
            new = prompts[started : started + free]
            live = _rebuild(dec, live, new, started, max_new, tail, shared)
            started += len(new)
        elif running == 0:
            break
        elif 4 * running <= 3 * len(live.row):  # compact: finished rows leave
            live = _rebuild(dec, live, [], started, max_new, tail, shared)
        c = live.filled
        live.keep[:, c] = True
        extra = {} if live.prompts is None else {PROMPTS_KWARG: live.prompts}
        if live.prompts is not None:
            live.prompts.calls = 0
        out = dec.model(
            input_ids=live.fed,
            attention_mask=live.keep[:, None, None, : c + 1],  # 4D, used as is
            position_ids=live.pos,
            cache=live.cache,
            use_cache=True,
            **extra,
        )
        if live.prompts is not None and live.prompts.calls != len(live.cache.layers):
            raise RuntimeError(
                "the decode step's shared-prompt attention was skipped: transformers' `sdpa` "
                "attention function was replaced by one that does not route "
                f"`{PROMPTS_KWARG}` (rltool.engines.hf_prompt_attention.attention_or_sdpa)"
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
        ended = torch.isin(chosen, dec.eos)  # [b]
        if stop is not None:
            live.tail = torch.cat([live.tail[:, 1:], chosen[:, None]], 1)
            ended |= stop(live.tail, scores).to(device)
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
