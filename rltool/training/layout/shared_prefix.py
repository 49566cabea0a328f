"""The shared-prefix layout: each distinct prompt once per row, its samples as branches.

Shape legend: N = positions of a row, F = positions of every input row together,
P = input rows, S = samples, T = trees (one prefix and its branches), K = pieces of
a row (each tree's prefix, then its branches).

GRPO samples ``group_size`` responses per prompt, and on a short-answer task the
prompt is most of every sample (gsm8k_tiny: 29 prompt tokens, 13 response
tokens), so a plain row spends most of its forward and backward on copies of
the same prompt. A shared row (``SharedPack``, drawn in ``rltool.training.batch``)
lays each prompt out once, followed by every sample's own part.

The prefix is a sample's leading positions whose target is -100 (for a
single-turn sample: the prompt without its last token, whose target is the first
response token), so a prefix position has no loss and its hidden states depend
on the prefix alone: every supervised logprob equals the one of the sample's own
plain row, and the prefix's gradient is the sum of its copies' gradients.
Samples whose prefixes differ in any token, or in the recorded experts of any
prefix token (``routed_experts``, routing replay), never share.

The rows are built from the plain rows, in their order: samples are grouped by
prefix into trees of at most ``max_len`` positions (default: the longest plain
row, so no row grows), and the trees are packed best-fit-decreasing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rltool.packing import pack_lengths
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.attention import SDPA_TREE
from rltool.training.batch import Pack, SharedPack
from rltool.training.branch_merge import merge_branches
from rltool.training.losses import sequence_ids

_PER_POSITION = (
    "input_ids",
    "targets",
    "advantages",
    "rollout_logprobs",
    "has_rollout_logprobs",
    "position_ids",
)


def shareable(pack: Pack) -> bool:
    """Rows with teacher targets stay plain; routed experts share (a prefix is shared only
    when its routing is the same too)."""
    return pack.teacher_kind is None


@dataclass(slots=True)
class _Samples:
    """Every sample of the plain rows, on their concatenated fields."""

    cat: dict[str, torch.Tensor]  # field -> [F] concatenation over the rows
    start_S: list[int]
    end_S: list[int]
    prefix_S: list[int]  # leading unsupervised positions (0 when the sample has no loss)
    index_S: list[int]  # TrainBatch sample index


def _fields(packs: list[Pack]) -> tuple[str, ...]:
    """The per-position fields the rows carry (routed_experts when the step recorded it)."""
    routed = packs[0].routed_experts is not None
    return _PER_POSITION + (("routed_experts",) if routed else ())


def _samples(packs: list[Pack]) -> _Samples:
    # [F] each, routed_experts [F, L, K]
    cat = {f: torch.cat([getattr(p, f) for p in packs]) for f in _fields(packs)}
    offsets = torch.tensor([0] + [len(p) for p in packs]).cumsum(0)[:-1]  # [P]
    cu = torch.cat(
        [
            p.cu_seq_lens[:-1].to(torch.long) + o
            for p, o in zip(packs, offsets.tolist(), strict=True)
        ]
        + [torch.tensor([len(cat["input_ids"])])]
    )  # [S + 1]
    n = int(cu[-1])
    seq = sequence_ids(cu, n)  # [F]
    positions = torch.arange(n)  # [F]
    supervised = cat["targets"] != IGNORE_INDEX  # [F]
    num_samples = int(cu.shape[0]) - 1
    first = torch.full((num_samples,), n, dtype=torch.long)  # [S] n = no supervised position
    first = first.scatter_reduce(0, seq[supervised], positions[supervised], "amin")  # [S]
    starts, ends = cu[:-1], cu[1:]  # [S]
    prefix = torch.where(first < ends, first - starts, torch.zeros_like(first))  # [S]
    index = [i for p in packs for i in p.sample_index]
    return _Samples(cat, starts.tolist(), ends.tolist(), prefix.tolist(), index)


def _trees(s: _Samples, max_len: int) -> list[list[int]]:
    """Sample indices per tree: equal prefixes (tokens, and routing where recorded) together,
    a tree at most ``max_len`` long."""
    by_prefix: dict[bytes, list[int]] = {}
    ids = s.cat["input_ids"].numpy()
    routed = s.cat.get("routed_experts")
    experts = None if routed is None else routed.numpy()  # [F, L, K]
    for i, (a, q) in enumerate(zip(s.start_S, s.prefix_S, strict=True)):
        key = ids[a : a + q].tobytes() if q else f"alone-{i}".encode()
        if q and experts is not None:
            key += experts[a : a + q].tobytes()
        by_prefix.setdefault(key, []).append(i)
    trees: list[list[int]] = []
    for members in by_prefix.values():
        q = s.prefix_S[members[0]]
        tree: list[int] = []
        used = q
        for i in members:
            branch = s.end_S[i] - s.start_S[i] - q
            if tree and used + branch > max_len:
                trees.append(tree)
                tree, used = [], q
            tree.append(i)
            used += branch
        trees.append(tree)
    return trees


@dataclass(frozen=True, slots=True)
class SharedLayout:
    """The shared rows, and where each sample sits in them, by TrainBatch sample index."""

    packs: list[SharedPack]
    pack_S: np.ndarray  # [S] its row
    start_S: np.ndarray  # [S] its tree's prefix in the row (its own branch when no prefix)
    prefix_S: np.ndarray  # [S] positions of that prefix
    branch_S: np.ndarray  # [S] its own branch in the row


def _row(
    s: _Samples, trees: list[list[int]], b: int, out: SharedLayout, attention: str
) -> SharedPack:
    """One row of ``trees``; writes the placement of its samples (row ``b``) into ``out``."""
    pieces: list[torch.Tensor] = []
    tree_len: list[int] = []
    branch_len: list[int] = []  # prefix (branch 0) then each branch, per tree
    cu = [0]
    sample_index: list[int] = []
    offset = 0  # row position of the next piece
    for tree in trees:
        q = s.prefix_S[tree[0]]
        a0 = s.start_S[tree[0]]
        prefix_at = offset
        pieces.append(torch.arange(a0, a0 + q))
        branch_len.append(q)
        offset += q
        for k, i in enumerate(tree):
            a, e = s.start_S[i] + q, s.end_S[i]
            j = s.index_S[i]
            out.pack_S[j], out.start_S[j], out.prefix_S[j] = b, prefix_at, q
            out.branch_S[j] = offset
            pieces.append(torch.arange(a, e))
            branch_len.append(e - a)
            offset += e - a
            cu.append(cu[-1] + (e - a) + (q if k == 0 else 0))
            sample_index.append(j)
        tree_len.append(q + sum(s.end_S[i] - s.start_S[i] - q for i in tree))
    src = torch.cat(pieces)  # [N] flat positions
    lengths = torch.tensor(branch_len)  # [K]
    is_prefix = torch.tensor([k == 0 for tree in trees for k in range(len(tree) + 1)])  # [K]
    branch_of = torch.where(is_prefix, 0, (~is_prefix).cumsum(0))  # [K] 0, then 1, 2, ...
    tree_ids = torch.repeat_interleave(torch.arange(len(trees)), torch.tensor(tree_len))  # [N]
    spans = torch.tensor(cu)
    row = SharedPack(
        **{f: t[src] for f, t in s.cat.items()},  # [N] each, routed_experts [N, L, K]
        cu_seq_lens=spans.to(torch.int32),
        max_seq_len=int((spans[1:] - spans[:-1]).max()),
        sample_index=sample_index,
        tree_ids=tree_ids,
        branch_ids=torch.repeat_interleave(branch_of, lengths),  # [N]
        attention=attention,
    )
    if attention == SDPA_TREE:  # the kernel that runs merged rows (branch_merge.py)
        row.merged = merge_branches(row)
    return row


def share_prefixes(
    packs: list[Pack], max_len: int | None = None, attention: str = SDPA_TREE
) -> SharedLayout:
    """The samples of the plain rows ``packs`` in rows where each prompt appears once per row.

    ``max_len`` bounds a tree (default: the longest input row, so no row grows; a
    longer tree gets a row of its own); ``attention``: the rows' kernel. Summed over the
    rows, every loss of ``losses.py`` is unchanged.
    """
    assert packs and all(shareable(p) for p in packs), "only rows without teacher targets share"
    limit = max_len or max(len(p) for p in packs)
    s = _samples(packs)
    trees = _trees(s, limit)
    sizes = [
        s.prefix_S[t[0]] + sum(s.end_S[i] - s.start_S[i] - s.prefix_S[i] for i in t) for t in trees
    ]
    rows = pack_lengths(sizes, max(limit, max(sizes)))
    n = len(s.index_S)
    out = SharedLayout([], *(np.zeros(n, dtype=np.int64) for _ in range(4)))
    out.packs.extend(
        _row(s, [trees[t] for t in row], b, out, attention) for b, row in enumerate(rows)
    )
    return out
