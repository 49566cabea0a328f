"""The lean decode loop with refill: all of a ``generate``'s prompts in one loop of at most
``slots`` live rows; whenever a quarter of the slots have finished, the next prompts take the
finished rows' slots (one prefill of their distinct contexts), so no batch waits for its longest
row while its other slots idle. Once no prompt is left to start, finished rows leave the batch.
At a pause point with new weights waiting (``chunk_tokens``), the loop stops; its unfinished
rows go on in the next loop, on the new weights, from their prompt and tokens so far.

Every row writes its keys from column 0 of its slot at a column of its own (``_Cursor``), so a
refill writes only the new rows: the staying rows are neither copied nor realigned. Each
distinct prompt's keys and values (all but its last token) are held once and read by its rows
grouped (hf_prompt_attention.py) where that pays (``shares_prompts``); a row's own columns then
hold its prompt's last token and the tokens it made, else its whole context. Sampling draws for
the live rows only, so under one seed the sampled tokens differ from ``generate``'s (same
distribution); greedy tokens and logprobs are those of the reference path. Shape legend:
N = prompts, b = slots, W = own columns, K = key/value heads, D = head size, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import torch
from transformers.cache_utils import Cache, StaticLayer
from transformers.generation.stopping_criteria import StopStringCriteria

from rltool.config.schema import SamplingConfig
from rltool.engines.base import Generation
from rltool.engines.hf_decode import LeanDecoder, _filter_logits
from rltool.engines.hf_prefill import left_pad
from rltool.engines.hf_prompt_attention import PROMPTS_KWARG, SharedPrompts
from rltool.engines.hf_rows import RowsSoFar

if TYPE_CHECKING:  # hf.py imports this module
    from rltool.engines.hf import HFEngine


@dataclass(slots=True)
class _Cursor:
    """Where a decode step writes: row r's key at column ``col[r]`` of its slot; attention
    reads the first ``width`` columns (masked per row)."""

    rows: torch.Tensor  # [b] 0..b-1
    col: torch.Tensor  # [b]
    width: int = 0


class _RowLayer(StaticLayer):
    """A static layer whose rows each write their next key at their own column (the shared
    cursor's), so rows that started at different steps share the buffers as they are."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, at: _Cursor):
        super().__init__(keys.shape[2])
        self.keys, self.values, self.at = keys, values, at  # [b, K, W, D]
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        at = self.at  # key_states: [b, K, 1, D]
        self.keys[at.rows, :, at.col] = key_states[:, :, 0]
        self.values[at.rows, :, at.col] = value_states[:, :, 0]
        self.cumulative_length.fill_(at.width)
        return self.keys[:, :, : at.width], self.values[:, :, : at.width]  # [b, K, width, D]


@dataclass(slots=True)
class _Live:
    """The slots being decoded. A row's prompt's keys are held once per distinct prompt
    (``prompts``) or in the row's own columns (None)."""

    cache: Cache  # layers of _RowLayer [b, K, W, D]
    at: _Cursor
    keep: torch.Tensor  # [b, W] bool: the own columns each row attends
    prompts: SharedPrompts | None
    tail: torch.Tensor  # [b, L] the last L tokens of each row (stop strings), the fed one last
    fed: torch.Tensor  # [b, 1] the token fed next
    pos: torch.Tensor  # [b, 1] its position
    row: torch.Tensor  # [b] the prompt index of each row
    done: torch.Tensor  # [b] bool: finished (or never started), still in the batch (masked)


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


def _tails(contexts: Sequence[Sequence[int]], tail: int, pad_id: int) -> torch.Tensor:
    """The last ``tail`` tokens of each context, left-padded: [c, L]."""
    out = torch.full((len(contexts), tail), pad_id, dtype=torch.long)
    for i, c in enumerate(contexts):
        last = c[len(c) - tail :] if tail else []
        out[i, tail - len(last) :] = torch.as_tensor(last, dtype=torch.long)
    return out


def _prompts_of(
    dec: LeanDecoder,
    live: _Live,
    free: torch.Tensor,
    new: tuple[Cache | None, torch.Tensor, torch.Tensor],
) -> SharedPrompts:
    """The shared prompts of ``live``'s rows once the slots ``free`` [c] take new contexts
    (``new``: their prefix cache, the distinct context of each, the distinct contexts' mask);
    the other rows keep theirs."""
    prefix, new_of, umask = new
    device = live.row.device
    staying = torch.ones(len(live.row), dtype=torch.bool, device=device)
    staying[free] = False
    kept = staying.nonzero().squeeze(-1)  # [s]
    if len(kept):
        *old, old_of = _kept_prompts(live, kept)
    else:  # every slot takes a new context (the first fill among them)
        old, old_of = [[], [], torch.zeros((0, 0), dtype=torch.bool, device=device)], kept
    keys, values, keep = _joined(dec, old, (prefix, umask))
    prompt_of = torch.empty(len(live.row), dtype=torch.long, device=device)
    prompt_of[kept] = old_of
    prompt_of[free] = new_of + len(old[2])
    return SharedPrompts.of_rows(keys, values, keep, prompt_of)


def _start(dec: LeanDecoder, b: int, width: int, tail: int) -> _Live:
    """``b`` empty slots (finished: each refill takes them) of ``width`` own columns."""
    layers, heads, head_dim = _kv_shape(dec)
    device, dtype = dec.model.device, dec.model.dtype
    at = _Cursor(torch.arange(b, device=device), torch.zeros(b, dtype=torch.long, device=device))

    def buffer() -> torch.Tensor:  # zeros: masked columns are read too, and 0 x value must be 0
        return torch.zeros((b, heads, width, head_dim), dtype=dtype, device=device)

    cache = Cache(layers=[_RowLayer(buffer(), buffer(), at) for _ in range(layers)])
    keep = torch.zeros((b, width), dtype=torch.bool, device=device)
    ids = torch.zeros((b, 1), dtype=torch.long, device=device)
    tails = torch.zeros((b, tail), dtype=torch.long, device=device)
    done = torch.ones(b, dtype=torch.bool, device=device)
    return _Live(cache, at, keep, None, tails, ids, ids.clone(), ids[:, 0].clone(), done)


def _refill(
    dec: LeanDecoder, live: _Live, contexts: Sequence[Sequence[int]], first: int, shared: bool
) -> None:
    """``contexts`` (prompts ``first``...) take the first finished slots of ``live``, in place:
    one prefill of their distinct contexts, written into their slots (or, ``shared``, into the
    shared prompts); the other rows' columns stay as they are."""
    device = live.row.device
    free = live.done.nonzero().squeeze(-1)[: len(contexts)]  # [c]
    prefix, new_of, umask = dec.prefix(contexts)
    ids, mask = left_pad(contexts, dec.pad_id)  # [c, P]
    live.keep[free] = False
    if shared:
        live.prompts = _prompts_of(dec, live, free, (prefix, new_of, umask))
        live.at.col[free] = 0
    else:
        pn = 0 if prefix is None else umask.shape[1] - 1  # columns of all but the last token
        if pn:
            for layer, src in zip(live.cache.layers, prefix.layers, strict=True):
                layer.keys[free, :, :pn] = src.keys[new_of]
                layer.values[free, :, :pn] = src.values[new_of]
            live.keep[free, :pn] = mask[:, :-1].bool().to(device)
        live.at.col[free] = pn
    live.fed[free] = ids[:, -1:].to(device)
    live.pos[free] = (mask.sum(-1, keepdim=True) - 1).to(device)
    live.row[free] = torch.arange(first, first + len(contexts), device=device)
    live.tail[free] = _tails(contexts, live.tail.shape[1], dec.pad_id).to(device)
    live.done[free] = False


def _compact(live: _Live) -> _Live:
    """The unfinished rows of ``live`` alone (no slot is refilled any more): the finished
    rows' slots and the prompts only they read are dropped."""
    sel = (~live.done).nonzero().squeeze(-1)  # [s]
    at = _Cursor(torch.arange(len(sel), device=sel.device), live.at.col[sel])
    layers = [_RowLayer(x.keys[sel], x.values[sel], at) for x in live.cache.layers]
    prompts = None
    if live.prompts is not None:
        prompts = SharedPrompts.of_rows(*_kept_prompts(live, sel))
    rows = (live.tail[sel], live.fed[sel], live.pos[sel], live.row[sel], live.done[sel])
    return _Live(Cache(layers=layers), at, live.keep[sel], prompts, *rows)


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the CUDA device's free memory, else the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def fitting_slots(
    dec: LeanDecoder, prompts: Sequence[Sequence[int]], max_new: int, engine: HFEngine
) -> int:
    """The rows the loop decodes at once: ``engine.slots``, fewer where a row's keys and
    values (its whole context in its own columns: the larger layout) and the step's float32
    vocabulary rows (logits, scores, probabilities) would take more than
    ``engine.cache_memory`` of the free memory, and never fewer than ``engine.batch_size`` (a
    batch of the per-batch loop holds as much)."""
    layers, heads, head_dim = _kv_shape(dec)
    width = max(map(len, prompts)) - 1 + max_new
    kv = 2 * layers * heads * head_dim * width * dec.model.dtype.itemsize
    vocab = 4 * 4 * dec.model.config.get_text_config(decoder=True).vocab_size
    fit = int(engine.cache_memory * free_memory(dec.model.device)) // (kv + vocab)
    return max(engine.batch_size, min(engine.slots, fit))


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
    contexts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    sampling: SamplingConfig,
    stop: StopStringCriteria | None,
    slots: int,
    may_refill: Callable[[], bool],
    pause: Callable[[int], bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [n, T] and logprobs [n, T] (T = the largest budget), tokens made [n] and finished
    [n] (EOS or stop string) of ``contexts[:n]``, each making at most its ``budgets`` entry.
    n = all of them unless the loop stopped early: ``may_refill()`` said no (new weights
    wait: the live rows end and no further context starts) or ``pause(s)`` said yes after s
    decode steps (a pause point: the live rows stop where they are, unfinished)."""
    device, max_new = dec.model.device, max(budgets)
    n_all = len(contexts)
    budget = torch.as_tensor(budgets, dtype=torch.long, device=device)  # [n]
    tokens = torch.full((n_all, max_new), dec.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((n_all, max_new), device=device)
    made = torch.zeros(n_all, dtype=torch.long, device=device)
    finished = torch.zeros(n_all, dtype=torch.bool, device=device)
    greedy = sampling.temperature == 0
    temperature = 1.0 if greedy else sampling.temperature
    started = steps = 0
    tail = 0 if stop is None else stop.maximum_token_len  # what a stop string looks back on
    shared = shares_prompts(contexts, slots)
    # own columns: shared, the prompt's last token and the fed tokens; else the whole context
    width = max_new if shared else max(map(len, contexts)) - 1 + max_new
    live = _start(dec, min(slots, n_all), width, tail)
    while True:
        b = len(live.row)
        running = b - int(live.done.sum())
        if started < n_all and 4 * (b - running) >= b and may_refill():
            new = contexts[started : started + b - running]
            _refill(dec, live, new, started, shared)
            started += len(new)
        elif running == 0:
            break
        elif 4 * running <= 3 * b:  # compact: finished rows leave
            live = _compact(live)
        at = live.at
        at.width = int(at.col.max()) + 1
        live.keep[at.rows, at.col] = True
        extra = {}
        if live.prompts is not None:
            live.prompts.calls = 0
            extra = {PROMPTS_KWARG: live.prompts}
        out = dec.model(
            input_ids=live.fed,
            attention_mask=live.keep[:, None, None, : at.width],  # 4D, used as is
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
        live.done |= ended | (made[live.row] >= budget[live.row])
        live.fed, live.pos = chosen[:, None], live.pos + 1
        at.col += (~live.done).long()  # a finished row writes its (ignored) keys in place
        steps += 1
        if pause(steps):
            break
    return tokens[:started], logprobs[:started], made[:started], finished[:started]


def generate_refilling(
    engine: HFEngine, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
) -> list[Generation]:
    """``engine.generate`` on the refilling loop, at most ``fitting_slots`` rows live. New weights
    handed over meanwhile are taken, with ``engine.chunk_tokens``, at the next pause point
    (every that many decode steps): the live rows stop there and go on from prompt + tokens so
    far on the new weights, ahead of the prompts not yet started. Without, they are taken once
    the live rows end (no prompt starts before)."""
    stop = StopStringCriteria(engine.tokenizer, sampling.stop) if sampling.stop else None
    max_new = sampling.max_new_tokens
    rows = RowsSoFar.empty(len(prompts))
    todo = list(range(len(prompts)))  # the rows to start or go on with, in this order
    while todo:
        engine._apply_pending()
        assert engine._lean is not None
        contexts = [[*prompts[r], *rows.tokens[r]] for r in todo]
        budgets = [max_new - len(rows.tokens[r]) for r in todo]
        slots = fitting_slots(engine._lean, contexts, max(budgets), engine)
        out = decode_refilling(
            engine._lean,
            contexts,
            budgets,
            sampling,
            stop,
            slots,
            lambda: not engine.weights_waiting,
            engine.pauses_at,
        )
        started = len(out[0])
        for r, t, lp, m, e in zip(todo[:started], *(x.tolist() for x in out), strict=True):
            rows.add(r, t[:m], lp[:m], engine.model_step, e)
        todo = rows.unfinished(todo[:started], max_new) + todo[started:]
    return rows.generations(engine.tokenizer)
