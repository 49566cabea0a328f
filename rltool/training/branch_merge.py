"""Branches' common beginnings computed once: a shared row's branches merged into a trie.

Shape legend: N = positions of a shared row, M = positions after merging (M <= N).

A shared row (``layout/shared_prefix.py``) computes each prompt once, but every sample
keeps its whole branch: the prompt's last token (whose target is the first response
token) and every response token. A position's hidden state depends only on the tokens up
to it (and their positions), so two branches of one tree that begin with the same tokens
compute the same states there: every branch repeats the prompt's last token, and sampled
answers often open alike (gsm8k_tiny: ~20% of a step's positions). ``merge_branches``
keeps each distinct (prefix, branch beginning) once, as a trie in depth-first order, and
says which merged position each row position is (``node_of``). The layout merges each
sdpa-tree row at conversion (``SharedPack.merged``; ``data/forward_positions`` counts what
the model computes); ``logprobs.packed_logits``
runs the model on the merged row and expands its logits back to the row with
``index_select``, whose backward sums the copies' gradients: every logit and gradient is
the unmerged row's (the tests hold them to the dense path, 2e-6), and everything after the
logits (targets, advantages, losses, metrics) sees the row unchanged.

A trie node's positions in depth-first order form pieces: a node, its first child, that
child's first child, ... down to a leaf; a piece attends to its prefix, its ancestors
on the trie, then causally to itself (``attention.segments_from``).
"""

from __future__ import annotations

from itertools import groupby

import numpy as np
import torch

from rltool.training.attention import KeyedPiece, pieces_of
from rltool.training.batch import MergedRow, SharedPack


class _Trie:
    """The merged positions of one tree: its prefix, then its branches' trie in depth-first
    order, appended to ``rep`` / ``node_of`` / ``pieces``."""

    def __init__(self, ids: list[int], prefix: range, branches: list[range]) -> None:
        self.ids = ids
        self.first: list[int] = []  # node -> row position of its first occurrence
        self.parent: list[int] = []  # node -> parent node, -1 under the prefix
        self.children: list[dict[int, int]] = []  # node -> token -> child, insertion order
        self.top: dict[int, int] = {}  # token -> node directly under the prefix
        self.node_at: dict[int, int] = {}  # row position -> node
        for branch in branches:
            self._insert(branch)
        self.prefix = prefix

    def _insert(self, branch: range) -> None:
        parent, level = -1, self.top
        for pos in branch:
            node = level.get(self.ids[pos])
            if node is None:
                node = len(self.first)
                level[self.ids[pos]] = node
                self.first.append(pos)
                self.parent.append(parent)
                self.children.append({})
            self.node_at[pos] = node
            parent, level = node, self.children[node]

    def emit(self, rep: list[int], node_of: list[int], pieces: list[KeyedPiece]) -> None:
        start = len(rep)
        rep.extend(self.prefix)
        for pos in self.prefix:
            node_of[pos] = start + pos - self.prefix.start
        before = list(range(start, len(rep)))  # the prefix's merged positions
        if self.prefix:
            pieces.append((np.empty(0, dtype=np.int64), start, len(rep)))
        merged = [0] * len(self.first)  # node -> merged position
        stack = list(reversed(self.top.values()))
        while stack:  # one piece per leaf: a node, then first children down to a leaf
            node, a = stack.pop(), len(rep)
            above, up = [], self.parent[node]
            while up >= 0:
                above.append(merged[up])
                up = self.parent[up]
            while True:
                merged[node] = len(rep)
                rep.append(self.first[node])
                kids = list(self.children[node].values())
                stack.extend(reversed(kids[1:]))
                if not kids:
                    break
                node = kids[0]
            keys = np.array(before + above[::-1], dtype=np.int64)
            pieces.append((keys, a, len(rep)))
        for pos, node in self.node_at.items():
            node_of[pos] = merged[node]


def merge_branches(pack: SharedPack) -> MergedRow | None:
    """The row with each tree's branches merged where they begin alike; None when nothing
    merges (or the row replays recorded MoE routing, which is per row position)."""
    if pack.routed_experts is not None:
        return None
    ids = pack.input_ids.tolist()
    rep: list[int] = []
    node_of = [0] * len(ids)
    pieces: list[KeyedPiece] = []
    by_tree = groupby(pieces_of(pack), key=lambda p: p[0] if p[1] > p[0] else p[2])
    for _, tree in by_tree:
        tree = list(tree)
        p0, p1 = tree[-1][:2]
        branches = [range(a, e) for q0, q1, a, e in tree if q1 > q0]
        if not branches:  # a prefix without branches, or a sample alone: one causal piece
            for _, _, a, e in tree:
                branches.append(range(a, e))
            p0 = p1 = branches[0].start
        _Trie(ids, range(p0, p1), branches).emit(rep, node_of, pieces)
    if len(rep) == len(ids):
        return None
    return MergedRow(torch.tensor(rep), torch.tensor(node_of), pieces)
