"""Attention over packed rows without an [N, N] mask: the kernel each row trains with.

Shape legend: N = positions of a row, H = attention heads, D = head size.

Conversion picks the kernel (``choose_kernels``, recorded on every ``Pack``) and
``logprobs.packed_logits`` runs it. Kernels (docs/attention.md says why):

- ``sdpa-varlen``: plain rows; causal SDPA per sample (the fused kernel, memory linear
  in N; samples of similar length batched): ``segment_attention``, registered as
  transformers' ``sdpa`` (unchanged for a forward without ``Segments``);
- ``sdpa-tree``: shared-prefix rows on the CPU; each prefix causally alone, each
  branch's queries against its prefix's and its own keys (a small explicit mask);
  branches that begin alike run merged (``branch_merge.py``, ``segments_from``);
- ``flash-varlen``: plain rows with ``model.attn_implementation`` flash_attention_*:
  transformers' variable-length kernel, told the samples by ``cu_seq_lens``;
- ``flex-block``: shared-prefix rows on CUDA: ``flex_attention`` with a ``BlockMask``;
- ``native``: transformers' own mask from the restarting positions (eager: [N, N], as its
  scores; flex_attention: a BlockMask); ``dense``: eager with the explicit tree mask
  (``attention_allowed``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers import AttentionInterface
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)

from rltool.engines.hf_prompt_attention import attention_or_sdpa
from rltool.training.batch import Pack, SharedPack

SDPA_VARLEN, SDPA_TREE = "sdpa-varlen", "sdpa-tree"
FLASH_VARLEN, FLEX_BLOCK = "flash-varlen", "flex-block"
NATIVE, DENSE = "native", "dense"
KERNELS = (SDPA_VARLEN, SDPA_TREE, FLASH_VARLEN, FLEX_BLOCK, NATIVE, DENSE)
SEGMENTED = (SDPA_VARLEN, SDPA_TREE)  # run by the rltool_segments attention function
KERNEL_NOTES = {  # one line each, for inspect-batch
    SDPA_VARLEN: "causal SDPA per sample, no [N, N] mask",
    SDPA_TREE: "SDPA per shared prefix and per branch, alike branch starts merged, no [N, N] mask",
    FLASH_VARLEN: "flash attention, variable length by cu_seq_lens, no [N, N] mask",
    FLEX_BLOCK: "flex_attention with a block-sparse BlockMask, no [N, N] mask",
    NATIVE: "eager attention, transformers' [N, N] mask from the restarting position_ids",
    DENSE: "eager attention with the explicit [N, N] tree mask",
}

SEGMENTS_KWARG = "rltool_segments"  # the forward keyword that carries a row's Segments


def choose_kernels(attn_implementation: str, device: str) -> tuple[str, str | None]:
    """(kernel of plain rows, kernel of shared-prefix rows or None: no sharing) for a model
    with ``attn_implementation`` on ``device`` ("cpu", "cuda", "cuda:N")."""
    cuda = device.startswith("cuda")
    if attn_implementation == "sdpa":
        return SDPA_VARLEN, FLEX_BLOCK if cuda else SDPA_TREE
    if attn_implementation == "eager":
        return NATIVE, DENSE
    if attn_implementation.startswith("flash_attention"):
        return FLASH_VARLEN, None
    if attn_implementation == "flex_attention":  # transformers' BlockMask from the positions
        return NATIVE, FLEX_BLOCK if cuda else None
    raise ValueError(
        f"model.attn_implementation {attn_implementation!r}: packed rows train with sdpa, "
        "eager, flash_attention_2/3 or flex_attention"
    )


Piece = tuple[int, int, int, int]  # (prefix start, prefix end, start, end); no prefix: a, a


def pieces_of(pack: Pack) -> list[Piece]:
    """The row as independent causal pieces: positions [start, end) attend causally to
    the prefix [prefix start, prefix end) followed by themselves. A plain row: its samples;
    a shared row: each tree's prefix, then each branch after its prefix."""
    if not isinstance(pack, SharedPack):
        return [(a, a, a, e) for a, e in pairwise(pack.cu_seq_lens.tolist()) if e > a]
    key = torch.stack([pack.tree_ids, pack.branch_ids], 1)  # [N, 2]
    change = (key[1:] != key[:-1]).any(1).nonzero().flatten() + 1
    starts = [0, *change.tolist()]
    ends = [*starts[1:], len(pack)]
    tree, branch = pack.tree_ids[starts].tolist(), pack.branch_ids[starts].tolist()
    prefix_of: dict[int, tuple[int, int]] = {}
    out: list[Piece] = []
    for a, e, t, b in zip(starts, ends, tree, branch, strict=True):
        if b == 0:
            prefix_of[t] = (a, e)
        out.append((*prefix_of.get(t, (a, a)), a, e) if b else (a, a, a, e))
    return out


# a branch's group runs with an explicit [G, 1, Lq, Lk] mask up to this many elements (its
# memory); a larger one takes the causal kernel and recomputes the prefix's queries instead
MASK_BUDGET = 1 << 24


@dataclass(frozen=True, slots=True)
class Segments:
    """A row's pieces batched for SDPA: pieces of similar length (within 5:4) and the same
    kind (with or without a prefix) share a call, each padded at its end by repeating its
    last position (the padded rows' outputs are dropped).

    A group without prefixes is causal attention over its keys. A group of branches asks
    only its branches' queries, against prefix + branch keys, under a mask aligned to the
    last key (query i of a piece with a prefix of P sees keys j <= P + i): the prefix's
    queries are not recomputed per branch. Over ``MASK_BUDGET`` it runs causal instead."""

    groups: tuple[torch.Tensor, ...]  # [G, Lk] long: row positions of each piece's keys, padded
    queries: tuple[torch.Tensor | None, ...]  # [G, Lq] long: the branch positions; None: causal
    masks: tuple[torch.Tensor | None, ...]  # [G, 1, Lq, Lk] bool, True = attend; None: causal
    take: torch.Tensor  # [N] long: each row position's output in the groups' flat outputs
    key_index: torch.Tensor  # [sum G * Lk] long: ``groups`` flattened, one after the other
    query_index: torch.Tensor  # [sum G * Lq] long: ``queries`` (``groups`` if causal), flat


# a piece as segments_from takes it: (row positions of the keys before its own [P] int64,
# start, end); its positions [start, end) attend causally to those keys and then themselves
KeyedPiece = tuple[np.ndarray, int, int]


def segments_of(pack: Pack, device: torch.device | str = "cpu") -> Segments:
    """The Segments of a row's pieces (``pieces_of``)."""
    keyed = [(np.arange(p0, p1), a, e) for p0, p1, a, e in pieces_of(pack)]
    return segments_from(keyed, len(pack), device)


def segments_from(pieces: list[KeyedPiece], n: int, device: torch.device | str = "cpu") -> Segments:
    """The Segments of a row of ``n`` positions cut into ``pieces``; a piece's earlier keys
    need not be contiguous (``training/branch_merge.py``: a branch after a shared part of
    its siblings' branches)."""
    size = [len(before) + e - a for before, a, e in pieces]
    shared = [len(before) > 0 for before, _, _ in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (shared[i], -size[i]))
    take = np.empty(n, dtype=np.int64)  # [N]
    groups: list[torch.Tensor] = []
    queries: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    base, i = 0, 0
    while i < len(order):  # index arrays in numpy: ~100 pieces a row, a few small ops each
        length, kind, members = size[order[i]], shared[order[i]], []
        while i < len(order) and shared[order[i]] == kind and 5 * size[order[i]] >= 4 * length:
            members.append(order[i])
            i += 1
        lq = max(pieces[j][2] - pieces[j][1] for j in members)
        masked = kind and len(members) * lq * length <= MASK_BUDGET
        idx = np.empty((len(members), length), dtype=np.int64)  # [G, Lk]
        q_idx = np.empty((len(members), lq), dtype=np.int64) if masked else None  # [G, Lq]
        prefix = np.empty(len(members), dtype=np.int64)  # [G]
        for r, j in enumerate(members):
            before, a, e = pieces[j]
            p = len(before)
            idx[r, :p], idx[r, p : p + e - a], idx[r, p + e - a :] = before, np.arange(a, e), e - 1
            if q_idx is not None:
                q_idx[r, : e - a], q_idx[r, e - a :] = np.arange(a, e), e - 1
            prefix[r] = p
            first = base + r * lq if masked else base + r * length + p
            take[a:e] = np.arange(first, first + e - a)
        groups.append(torch.from_numpy(idx))
        queries.append(None if q_idx is None else torch.from_numpy(q_idx))
        mask = None
        if masked:  # [G, 1, Lq, Lk]: key j <= P + i; padded queries see real keys only
            keys, rows = np.arange(length), np.arange(lq)
            allowed = keys[None, None, :] <= prefix[:, None, None] + rows[None, :, None]
            mask = torch.from_numpy(allowed[:, None])
        masks.append(mask)
        base += idx.size if q_idx is None else q_idx.size
    asked = [g if q is None else q for g, q in zip(groups, queries, strict=True)]
    flat = [torch.cat([t.flatten() for t in ts]).to(device) for ts in (groups, asked)]
    on = [tuple(None if t is None else t.to(device) for t in ts) for ts in (groups, queries, masks)]
    return Segments(*on, torch.from_numpy(take).to(device), *flat)


def _gather(t: torch.Tensor, index: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """[1, h, N, D] at the flat positions ``index`` (the groups' positions one after the other)
    -> one [G, h, L, D] a group of ``shapes`` [G, L]. One ``index_select`` for all groups, then
    views: its backward is one ``index_add_`` (advanced indexing's ``index_put_`` is ~2.5x
    slower on the CPU) and the split's a ``cat``, with no zero-filled [h, N, D] per group."""
    parts = t[0].index_select(1, index).split([s.numel() for s in shapes], 1)  # [h, G * L, D]
    return [p.unflatten(1, s).transpose(0, 1) for p, s in zip(parts, shapes, strict=True)]


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, H_kv, N, D]
    value: torch.Tensor,  # [1, H_kv, N, D]
    attention_mask: torch.Tensor | BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, extended: a row's ``Segments`` (keyword
    ``rltool_segments``) run as SDPA per group of pieces, a ``BlockMask`` runs
    flex_attention, and anything else is transformers' sdpa unchanged."""
    seg: Segments | None = kwargs.pop(SEGMENTS_KWARG, None)
    if seg is None and isinstance(attention_mask, BlockMask):
        return flex_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if seg is None:  # a shared-prompt decode step, or transformers' sdpa
        return attention_or_sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention layers: set model.attn_implementation eager")
    n_rep = query.shape[1] // key.shape[1]
    k_shapes = [g.shape for g in seg.groups]
    asked = zip(seg.groups, seg.queries, strict=True)
    q_shapes = [g.shape if q is None else q.shape for g, q in asked]
    qs = _gather(query, seg.query_index, q_shapes)  # [G, H, Lq, D] a group
    ks, vs = (_gather(t, seg.key_index, k_shapes) for t in (key, value))  # [G, H_kv, Lk, D]
    outs = []
    for q, k, v, mask in zip(qs, ks, vs, seg.masks, strict=True):
        o = F.scaled_dot_product_attention(
            q,
            repeat_kv(k, n_rep),
            repeat_kv(v, n_rep),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scaling,
        )  # [G, H, Lq, D]
        outs.append(o.transpose(0, 1).flatten(1, 2))  # [H, G * Lq, D]
    out = torch.cat(outs, 1).index_select(1, seg.take)  # [H, N, D]
    return out.transpose(0, 1)[None].contiguous(), None  # [1, N, H, D]


_local = threading.local()  # inside a segmented forward of this thread: no mask is built


def _sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' sdpa mask function, except inside ``no_mask()`` (this thread's segmented
    forward), where the row needs none."""
    return None if getattr(_local, "no_mask", False) else sdpa_mask(*args, **kwargs)


# transparent unless a forward passes Segments or a BlockMask: generation, and the
# recomputation of an activation-checkpointed layer, see the same functions
AttentionInterface.register("sdpa", segment_attention)
AttentionMaskInterface.register("sdpa", _sdpa_mask)
assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is _sdpa_mask


_UNCOMPILED = torch.compiler.disable(segment_attention, recursive=True)


@contextmanager
def excluded_from_compile() -> Iterator[None]:
    """Inside: ``sdpa`` is ``segment_attention`` marked never compiled (trainer.compile: its
    groups differ per row, so compiled layers call it eagerly between their compiled parts);
    after: the plain function again, so nothing outlives the compiled forwards."""
    AttentionInterface.register("sdpa", _UNCOMPILED)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", segment_attention)


@contextmanager
def no_mask() -> Iterator[None]:
    """The sdpa mask function of this thread returns None (a segmented forward)."""
    _local.no_mask = True
    try:
        yield
    finally:
        _local.no_mask = False


def tree_mask_mod(tree_ids: torch.Tensor, branch_ids: torch.Tensor):
    """flex_attention's mask_mod of a shared row: causal, own tree, prefix or own branch."""

    def mask_mod(b, h, q_idx, kv_idx):
        same_tree = tree_ids[q_idx] == tree_ids[kv_idx]
        visible = (branch_ids[kv_idx] == 0) | (branch_ids[kv_idx] == branch_ids[q_idx])
        return (kv_idx <= q_idx) & same_tree & visible

    return mask_mod


def flex_block_mask(pack: SharedPack, device: torch.device) -> BlockMask:
    """The block-sparse mask of a shared row (flex_attention; built in blocks of 128)."""
    n = len(pack)
    mod = tree_mask_mod(pack.tree_ids.to(device), pack.branch_ids.to(device))
    return create_block_mask(mod, None, None, n, n, device=device)
