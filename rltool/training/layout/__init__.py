"""Row layouts: how conversion places shifted samples into the packs the updater trains on.

The layout is decided once, here, at conversion: the updater trains on exactly
these packs and ``inspect-batch`` shows them.

- plain (``plain.py``): samples back to back, best-fit-decreasing into rows of
  ``trainer.pack_max_length``;
- shared prefix (``shared_prefix.py``, ``trainer.prefix_sharing``): the plain
  rows regrouped so each prompt is laid out once per row, its samples as
  branches. Rows carrying teacher targets stay plain, and so do all rows when
  the attention has no kernel for shared rows (flash attention on the CPU).

Every pack records its attention kernel (``rltool.training.attention``).

Shape legend: S = training samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rltool.rollout.state import RolloutState
from rltool.training.attention import SDPA_TREE, SDPA_VARLEN
from rltool.training.batch import Pack
from rltool.training.flat import Flat
from rltool.training.layout.plain import plain_layout, plain_packs
from rltool.training.layout.shared_prefix import share_prefixes, shareable


@dataclass(frozen=True, slots=True)
class Packed:
    """The packs, and where each training sample sits in them (see ``SampleInfo``)."""

    packs: list[Pack]
    pack_S: np.ndarray  # [S] its pack
    start_S: np.ndarray  # [S] offset of its first position in that pack
    prefix_S: np.ndarray  # [S] leading positions shared with its tree (0 in a plain row)
    branch_S: np.ndarray  # [S] offset of its positions after the prefix


def pack_samples(
    samples: Sequence[RolloutState],
    flat: Flat,
    adv_S: np.ndarray,
    max_len: int,
    prefix_sharing: bool,
    kernels: tuple[str, str | None] = (SDPA_VARLEN, SDPA_TREE),
) -> Packed:
    """Shift and pack ``samples`` (their fields concatenated in ``flat``, their advantages
    ``adv_S`` [S]) into rows of ``max_len``; with ``prefix_sharing``, as shared-prefix rows.
    ``kernels``: the attention of plain rows and of shared rows (None: rows stay plain).

    Raises ValueError for a sample longer than ``max_len`` and for extras present on
    only some samples.
    """
    lay = plain_layout(flat, [s.rollout_id for s in samples], max_len)
    packs = plain_packs(samples, flat, lay, adv_S)
    pack_S, start_S = lay.pack_and_start_S()
    plain_kernel, shared_kernel = kernels
    for p in packs:
        p.attention = plain_kernel
    if prefix_sharing and shared_kernel and packs and all(shareable(p) for p in packs):
        shared = share_prefixes(packs, attention=shared_kernel)
        return Packed(
            list(shared.packs), shared.pack_S, shared.start_S, shared.prefix_S, shared.branch_S
        )
    return Packed(packs, pack_S, start_S, np.zeros_like(start_S), start_S)
