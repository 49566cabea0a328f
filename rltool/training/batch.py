"""What the trainer sees: packed rows built from shifted samples.

Shape legend: N = tokens in one packed row (<= pack_max_length),
S = samples in that row, K = top-k width of a per-position extra, L = MoE layers.

One packed row holds several shifted samples back to back::

    input_ids    | a0 a1 a2 a3 | b0 b1 b2 | c0 c1 |
    position_ids |  0  1  2  3 |  0  1  2 |  0  1 |
    cu_seq_lens  [0,           4,         7,     9]

Attention never crosses a boundary: the row's ``attention`` kernel, chosen at
conversion (``rltool.training.attention``), runs each sample alone, and
position_ids restart per sample. Targets
are the labels shifted by one inside each sample, so no target ever reads the
next sample's first token. Positions with target -100 carry advantage 0 and
rollout logprob 0.

A ``SharedPack`` (the shared-prefix layout, ``rltool.training.layout``) lays each
prompt out once and the samples that share it as branches after it::

    input_ids    | p0 p1 p2 | p3 a0 a1 | p3 b0 b1 b2 |
    position_ids |  0  1  2 |  3  4  5 |  3  4  5  6 |
    tree_ids     |  0  0  0 |  0  0  0 |  0  0  0  0 |
    branch_ids   |  0  0  0 |  1  1  1 |  2  2  2  2 |
    cu_seq_lens  [0,                   6,           10]

A position attends causally to its tree's prefix (branch 0) and to its own
branch, never to a sibling. Each sample's span in ``cu_seq_lens`` is its branch;
the first sample of a tree also covers the prefix, whose targets are all -100.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class Pack:
    input_ids: torch.Tensor  # [N] long, model input = input_ids[:-1] of each sample
    targets: torch.Tensor  # [N] long, labels[1:] of each sample, -100 = no loss
    advantages: torch.Tensor  # [N] float32, sample advantage where target != -100, else 0
    rollout_logprobs: torch.Tensor  # [N] float32, engine logprob of the target, 0 if none
    has_rollout_logprobs: torch.Tensor  # [N] bool, the position's sample carries engine logprobs
    position_ids: torch.Tensor  # [N] long, restarts at 0 per sample
    cu_seq_lens: torch.Tensor  # [S + 1] int32, sample boundaries
    max_seq_len: int  # longest sample in the row
    sample_index: list[int]  # [S] index into TrainBatch.samples, in row order
    routed_experts: torch.Tensor | None = None  # [N, L, K] long, experts of each input token
    teacher_token_ids: torch.Tensor | None = None  # [N, K] long, aligned by the shift
    teacher_logprobs: torch.Tensor | None = None  # [N, K] float32, aligned by the shift
    teacher_kind: str | None = None  # "topk" | "sampled"
    attention: str = "sdpa-varlen"  # the kernel the row trains with (training/attention.py)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class MergedRow:
    """A shared row as the model computes it: branches merged where they begin alike
    (``training/branch_merge.py``). M = merged positions."""

    rep: torch.Tensor  # [M] long: the row position each merged position computes
    node_of: torch.Tensor  # [N] long: each row position's merged position
    # (merged positions of the keys before its own [P] int64, start, end): the pieces it
    # attends in, as ``attention.segments_from`` takes them
    pieces: list[tuple[np.ndarray, int, int]]


@dataclass(slots=True, kw_only=True)
class SharedPack(Pack):
    """A packed row whose samples share their tree's prefix (the picture above)."""

    tree_ids: torch.Tensor  # [N] long, the tree of each position
    branch_ids: torch.Tensor  # [N] long, 0 = shared prefix, > 0 = a sample's branch
    merged: MergedRow | None = None  # sdpa-tree rows whose branches begin alike


@dataclass(slots=True)
class SampleInfo:
    """Where one shifted sample lives in the packs, and what it trains on."""

    rollout_id: str
    group_id: str
    task_name: str
    pack: int  # index into TrainBatch.packs
    start: int  # offset of its first position inside that pack
    length: int  # len(input_ids) - 1, the shifted length
    # its positions: [start, start + prefix_length) ++ [branch_start, + length - prefix_length)
    prefix_length: int  # leading positions read from its tree's shared prefix; 0 in a plain row
    branch_start: int  # offset of its own positions after the prefix; start in a plain row
    advantage: float
    has_rollout_logprobs: bool  # False when the engine returned none


@dataclass(slots=True)
class SkippedGroup:
    group_id: str
    reason: str  # a short key, counted in data_info as skipped/<reason>
    detail: str = ""  # the first violation or error, for the log
    kind: str = ""  # the detail's short reason (rollout/failures.py): the log groups by it


@dataclass(slots=True)
class TrainBatch:
    packs: list[Pack]
    samples: list[SampleInfo]
    skipped_groups: list[SkippedGroup] = field(default_factory=list)
    data_info: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.packs)


def forward_positions(pack: Pack) -> int:
    """Positions the model computes for ``pack``: fewer than its length when merged."""
    merged = getattr(pack, "merged", None)
    return len(pack) if merged is None else int(merged.rep.shape[0])
