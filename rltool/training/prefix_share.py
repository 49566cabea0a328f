"""Shared-prompt rows: each distinct prompt once, the samples that share it as branches.

Shape legend: N = positions of a row, S = samples, T = trees (one prompt and its branches).

GRPO samples ``group_size`` responses per prompt, and on a short-answer task the
prompt is most of every sample (gsm8k_tiny: 29 prompt tokens, 13 response
tokens), so a packed row spends most of its forward and backward on copies of
the same prompt. A shared row lays each prompt out once, followed by every
sample's own part::

    input_ids   | p0 p1 p2 | p3 a0 a1 | p3 b0 b1 b2 |
    position_ids|  0  1  2 |  3  4  5 |  3  4  5  6 |
    branch      |  0  0  0 |  1  1  1 |  2  2  2  2 |

A position attends causally to its tree's prefix (branch 0) and to its own
branch, never to a sibling. The prefix is a sample's leading positions whose
target is -100 (for a single-turn sample: the prompt without its last token, whose
target is the first response token), so a prefix position has no loss and its
hidden states depend on the prefix alone: every supervised logprob equals the
one of the sample's own row exactly, and the prefix's gradient is the sum of
its copies' gradients. Samples whose prefixes differ in any token never share.

Each sample's span in ``cu_seq_lens`` is its branch (the first one of a tree
also covers the prefix, whose targets are all -100), so the loss aggregation
of ``losses.py`` is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.packing import pack_lengths
from rltool.rollout.state import IGNORE_INDEX
from rltool.training.batch import Pack
from rltool.training.losses import sequence_ids

_PER_POSITION = ("input_ids", "targets", "advantages", "rollout_logprobs", "position_ids")


@dataclass(slots=True)
class SharedPack(Pack):
    """A packed row whose samples share their tree's prefix (see the module docstring)."""

    tree_ids: torch.Tensor | None = None  # [N] long, the tree of each position
    branch_ids: torch.Tensor | None = None  # [N] long, 0 = shared prefix, > 0 = a sample's branch


def attention_allowed(tree_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """[N, N] bool, True where query q may attend to key k (causal, own tree, prefix or own
    branch)."""
    n = int(tree_ids.shape[0])
    pos = torch.arange(n, device=tree_ids.device)  # [N]
    causal = pos[None, :] <= pos[:, None]  # [N, N]
    same_tree = tree_ids[None, :] == tree_ids[:, None]  # [N, N]
    visible = (branch_ids[None, :] == 0) | (branch_ids[None, :] == branch_ids[:, None])  # [N, N]
    return causal & same_tree & visible


def supports_shared_rows(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes an explicit [N, N] mask (sdpa, eager); flash
    attention only knows block-diagonal packing, so its rows stay plain."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


def _shareable(pack: Pack) -> bool:
    # per-position extras of other helpers (routing replay, teacher targets) stay in plain rows
    return (
        pack.routed_experts is None
        and pack.teacher_kind is None
        and not isinstance(pack, SharedPack)
    )


@dataclass(slots=True)
class _Samples:
    """Every sample of the shareable packs, on their concatenated fields."""

    cat: dict[str, torch.Tensor]  # field -> [F] concatenation over the packs
    start_S: list[int]
    end_S: list[int]
    prefix_S: list[int]  # leading unsupervised positions (0 when the sample has no loss)
    index_S: list[int]  # TrainBatch sample index


def _samples(packs: list[Pack]) -> _Samples:
    cat = {f: torch.cat([getattr(p, f) for p in packs]) for f in _PER_POSITION}  # [F] each
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
    """Sample indices per tree: equal prefixes together, a tree at most ``max_len`` long."""
    by_prefix: dict[bytes, list[int]] = {}
    ids = s.cat["input_ids"].numpy()
    for i, (a, q) in enumerate(zip(s.start_S, s.prefix_S, strict=True)):
        key = ids[a : a + q].tobytes() if q else f"alone-{i}".encode()
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


def _row(s: _Samples, trees: list[list[int]]) -> SharedPack:
    pieces: list[torch.Tensor] = []
    tree_len: list[int] = []
    branch_len: list[int] = []  # prefix (branch 0) then each branch, per tree
    cu = [0]
    sample_index: list[int] = []
    for tree in trees:
        q = s.prefix_S[tree[0]]
        a0 = s.start_S[tree[0]]
        pieces.append(torch.arange(a0, a0 + q))
        branch_len.append(q)
        for k, i in enumerate(tree):
            a, b = s.start_S[i] + q, s.end_S[i]
            pieces.append(torch.arange(a, b))
            branch_len.append(b - a)
            cu.append(cu[-1] + (b - a) + (q if k == 0 else 0))
            sample_index.append(s.index_S[i])
        tree_len.append(q + sum(s.end_S[i] - s.start_S[i] - q for i in tree))
    src = torch.cat(pieces)  # [N] flat positions
    lengths = torch.tensor(branch_len)  # [B]
    is_prefix = torch.tensor([k == 0 for tree in trees for k in range(len(tree) + 1)])  # [B]
    branch_of = torch.where(is_prefix, 0, torch.arange(1, len(branch_len) + 1))  # [B]
    tree_ids = torch.repeat_interleave(torch.arange(len(trees)), torch.tensor(tree_len))  # [N]
    spans = torch.tensor(cu)
    return SharedPack(
        **{f: s.cat[f][src] for f in _PER_POSITION},  # [N] each
        cu_seq_lens=spans.to(torch.int32),
        max_seq_len=int((spans[1:] - spans[:-1]).max()),
        sample_index=sample_index,
        tree_ids=tree_ids,
        branch_ids=torch.repeat_interleave(branch_of, lengths),  # [N]
    )


def share_prefixes(packs: list[Pack], max_len: int | None = None) -> list[Pack]:
    """The same samples in rows where each prompt appears once per row.

    ``max_len`` bounds a row (default: the longest input pack, so no row grows);
    packs carrying routing replay or teacher targets are returned unchanged, after
    the shared rows. Summed over the rows, every loss of ``losses.py`` is unchanged.
    """
    shareable = [p for p in packs if _shareable(p)]
    others = [p for p in packs if not _shareable(p)]
    if not shareable:
        return others
    limit = max_len or max(len(p) for p in shareable)
    s = _samples(shareable)
    trees = _trees(s, limit)
    sizes = [
        s.prefix_S[t[0]] + sum(s.end_S[i] - s.start_S[i] - s.prefix_S[i] for i in t) for t in trees
    ]
    rows = pack_lengths(sizes, max(limit, max(sizes)))
    return [_row(s, [trees[t] for t in row]) for row in rows] + others
