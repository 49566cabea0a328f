"""The machine view of a TrainBatch: what ``inspect-batch --format json`` prints.

Per sample, the shifted fields are gathered from the sample's pack, so a
reader sees exactly what the loss sees for that sample (inputs, targets,
per-position advantages, rollout logprobs) without the other samples of the
row. Floats are rounded to 6 decimals so that a golden comparison is stable
across platforms.

The top level says the row layout (``plain`` or ``shared-prefix``) and the
attention kernel the rows train with (``rltool.training.attention``).

A shared-prefix pack adds fields to the plain schema: the pack gets
``tree_ids`` and ``branch_ids`` (per position; branch 0 = its tree's shared
prefix), and each of its samples ``prefix_length`` and ``branch_start``: the
sample's positions are ``[start, start + prefix_length)`` (the prefix, shared
with the other samples of its tree) followed by ``[branch_start, branch_start +
length - prefix_length)`` (its own branch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rltool.training.batch import Pack, SampleInfo, SharedPack, TrainBatch

FLOAT_DECIMALS = 6


@dataclass(slots=True)
class SampleSlice:
    """One shifted sample gathered from its pack. L = SampleInfo.length."""

    input_ids: torch.Tensor  # [L] long
    targets: torch.Tensor  # [L] long, -100 = no loss
    advantages: torch.Tensor  # [L] float32
    rollout_logprobs: torch.Tensor  # [L] float32


def sample_positions(info: SampleInfo) -> torch.Tensor:
    """The pack positions of one sample: its tree's prefix, then its branch.  # [L] long"""
    q = info.prefix_length
    prefix = torch.arange(info.start, info.start + q)  # [q]
    return torch.cat([prefix, torch.arange(info.branch_start, info.branch_start + info.length - q)])


def slice_sample(batch: TrainBatch, info: SampleInfo) -> SampleSlice:
    """The per-position fields of one sample, as they sit in its pack."""
    pack = batch.packs[info.pack]
    at = sample_positions(info)  # [L]
    return SampleSlice(
        input_ids=pack.input_ids[at],  # [L]
        targets=pack.targets[at],  # [L]
        advantages=pack.advantages[at],  # [L]
        rollout_logprobs=pack.rollout_logprobs[at],  # [L]
    )


def _floats(values: torch.Tensor) -> list[float]:
    return [round(v, FLOAT_DECIMALS) for v in values.double().tolist()]


def _round_info(data_info: dict[str, float]) -> dict[str, float]:
    return {k: round(float(v), FLOAT_DECIMALS) for k, v in data_info.items()}


def sample_record(batch: TrainBatch, info: SampleInfo) -> dict[str, Any]:
    s = slice_sample(batch, info)
    record = {
        "rollout_id": info.rollout_id,
        "group_id": info.group_id,
        "pack": info.pack,
        "start": info.start,
        "length": info.length,
        "advantage": round(float(info.advantage), FLOAT_DECIMALS),
        "input_ids": s.input_ids.tolist(),
        "targets": s.targets.tolist(),
        "advantages": _floats(s.advantages),
        "rollout_logprobs": _floats(s.rollout_logprobs),
    }
    if isinstance(batch.packs[info.pack], SharedPack):
        record |= {"prefix_length": info.prefix_length, "branch_start": info.branch_start}
    return record


def pack_record(pack: Pack) -> dict[str, Any]:
    record = {
        "length": len(pack),
        "cu_seq_lens": pack.cu_seq_lens.tolist(),
        "position_ids": pack.position_ids.tolist(),
    }
    if isinstance(pack, SharedPack):
        record |= {"tree_ids": pack.tree_ids.tolist(), "branch_ids": pack.branch_ids.tolist()}
    return record


def layout_of(batch: TrainBatch) -> tuple[str, str]:
    """(row layout, attention kernel(s), comma-separated) of the batch's packs."""
    layout = "shared-prefix" if any(isinstance(p, SharedPack) for p in batch.packs) else "plain"
    return layout, ",".join(sorted({p.attention for p in batch.packs})) or "none"


def batch_to_json(batch: TrainBatch, sample_indices: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``--format json`` object. ``sample_indices`` (into ``batch.samples``)
    filters ``samples`` only; packs, skipped groups and data_info are always whole."""
    indices = range(len(batch.samples)) if sample_indices is None else sample_indices
    layout, attention = layout_of(batch)
    return {
        "layout": layout,
        "attention": attention,
        "samples": [sample_record(batch, batch.samples[i]) for i in indices],
        "packs": [pack_record(p) for p in batch.packs],
        "skipped_groups": [
            {"group_id": g.group_id, "reason": g.reason} for g in batch.skipped_groups
        ],
        "data_info": _round_info(batch.data_info),
    }
