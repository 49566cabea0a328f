"""The plain layout: shifted samples packed back to back into rows of at most ``max_len``.

Shape legend: S = training samples, T_s = len(input_ids) of sample s, F = sum of T_s
(every field of every sample concatenated once, unshifted), L_s = T_s - 1 its shifted
length, N = sum of L_s (all shifted positions, packed order), K = width of a
per-position extra, B = packs.

The one shift and the packing are both index arithmetic on the concatenated
fields (``rltool.training.flat.Flat``): packed position j of sample s reads its
model input (and routed_experts, the routing of that input) at flat position
``start_s + j`` and its target, rollout logprob and the teacher's targets at
``start_s + j + 1``, so no target ever crosses into the next sample.
Rows come from best-fit-decreasing packing (``rltool.packing.pack_lengths``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from rltool.packing import pack_lengths
from rltool.rollout.state import IGNORE_INDEX, RolloutState
from rltool.training.batch import Pack, SharedPack
from rltool.training.flat import Flat, segments


def _extra_F(
    samples: Sequence[RolloutState],
    name: str,
    get: Callable[[RolloutState], Any],
    dtype: type,
    ndim: int = 2,
) -> np.ndarray | None:
    """A per-position extra of every sample concatenated, [F, K] (``ndim`` 3: [F, L, K]);
    None when no sample has it."""
    values = [get(s) for s in samples]
    if all(v is None for v in values):
        return None
    arrays: list[np.ndarray] = []
    for s, v in zip(samples, values, strict=True):
        if v is None:
            raise ValueError(
                f"sample {s.rollout_id}: {name} missing while other samples of the step carry it; "
                "every sample of a step must have it or none"
            )
        try:
            a = np.array(v, dtype=dtype)  # [T, K]
        except ValueError as exc:
            raise ValueError(f"sample {s.rollout_id}: {name} rows differ in width") from exc
        if a.ndim != ndim or (arrays and a.shape[1:] != arrays[0].shape[1:]):
            rest = (
                ", ".join(map(str, arrays[0].shape[1:]))
                if arrays
                else ("L, K" if ndim == 3 else "K")
            )
            raise ValueError(f"sample {s.rollout_id}: {name} has shape {a.shape}, need [T, {rest}]")
        arrays.append(a)
    return np.concatenate(arrays)  # [F, K]


def _teacher_kind(samples: Sequence[RolloutState]) -> str | None:
    kinds = {s.teacher_targets.kind for s in samples if s.teacher_targets is not None}
    if len(kinds) > 1:
        raise ValueError(f"teacher_targets kinds {sorted(kinds)} mixed in one step; use one kind")
    return kinds.pop() if kinds else None


@dataclass(frozen=True, slots=True)
class PlainLayout:
    """Where each training sample goes in the packed stream."""

    rows: list[list[int]]  # [B] sample indices per pack, ascending
    order_S: np.ndarray  # [S] sample indices in packed order
    L_packed: np.ndarray  # [S] shifted lengths in packed order
    offset_packed: np.ndarray  # [S] start of each sample in the packed stream, packed order
    offset_S: np.ndarray  # [S] the same by sample index
    row_first: np.ndarray  # [B] first packed sample of each row
    row_packed: np.ndarray  # [S] row of each sample, packed order
    pack_bounds: np.ndarray  # [B + 1] pack starts in the packed stream

    def pack_and_start_S(self) -> tuple[np.ndarray, np.ndarray]:
        """(pack, offset inside that pack) of each sample, by sample index.  # [S] each"""
        pack_S = np.empty(self.order_S.size, dtype=np.int64)  # [S]
        pack_S[self.order_S] = self.row_packed
        return pack_S, self.offset_S - self.pack_bounds[pack_S]


def plain_layout(flat: Flat, rollout_ids: Sequence[str], max_len: int) -> PlainLayout:
    L_S = flat.T_S - 1  # [S]
    rows = pack_lengths(L_S, max_len, ids=rollout_ids)
    order_S = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=L_S.size)  # [S]
    L_packed = L_S[order_S]  # [S]
    offset_packed = np.cumsum(L_packed) - L_packed  # [S]
    offset_S = np.empty_like(offset_packed)
    offset_S[order_S] = offset_packed
    n_rows = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # [B]
    row_first = np.cumsum(n_rows) - n_rows  # [B]
    row_packed = np.repeat(np.arange(n_rows.size), n_rows)  # [S]
    pack_bounds = np.append(offset_packed[row_first], L_S.sum())  # [B + 1]
    return PlainLayout(
        rows, order_S, L_packed, offset_packed, offset_S, row_first, row_packed, pack_bounds
    )


def check_pack_widths(pack: Pack, index: int = 0) -> None:
    """Every per-position field of a pack has the width of its input_ids (contract 5.4)."""
    n = len(pack)
    fields = {
        "targets": pack.targets,
        "advantages": pack.advantages,
        "rollout_logprobs": pack.rollout_logprobs,
        "has_rollout_logprobs": pack.has_rollout_logprobs,
        "position_ids": pack.position_ids,
        "routed_experts": pack.routed_experts,
        "teacher_token_ids": pack.teacher_token_ids,
        "teacher_logprobs": pack.teacher_logprobs,
    }
    if isinstance(pack, SharedPack):
        fields |= {"tree_ids": pack.tree_ids, "branch_ids": pack.branch_ids}
    for name, t in fields.items():
        if t is not None and t.shape[0] != n:
            raise ValueError(f"pack {index}: {name} has {t.shape[0]} positions, input_ids has {n}")
    if int(pack.cu_seq_lens[-1]) != n:
        raise ValueError(f"pack {index}: cu_seq_lens ends at {int(pack.cu_seq_lens[-1])}, not {n}")


@dataclass(frozen=True, slots=True)
class _Streams:
    """Every training sample's shifted fields in packed order.  # [N] each"""

    input_ids: np.ndarray  # int64, input_ids[:-1]
    targets: np.ndarray  # int64, labels[1:]
    rollout_logprobs: np.ndarray  # float32, logprobs[1:]
    has_rollout_logprobs: np.ndarray  # bool, the sample's logprobs are not None
    advantages: np.ndarray  # float32, the sample's advantage where the target is supervised
    position_ids: np.ndarray  # int64, 0 .. L_s - 1 per sample


def _shifted_streams(
    flat: Flat, lay: PlainLayout, adv_S: np.ndarray, has_lp_S: np.ndarray
) -> _Streams:
    """The shifted fields of every training sample in packed order: one slice copy per
    sample and field."""
    n = int(lay.pack_bounds[-1])
    ids_N, targets_N = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    lp_N, adv_N = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    pos_N = np.empty(n, dtype=np.int64)
    ramp = np.arange(int(lay.L_packed.max(initial=0)), dtype=np.int64)
    ids_F, labels_F, lp_F = flat.input_ids_F, flat.labels_F, flat.logprobs_F  # [F]
    for o, a, length, adv in zip(
        lay.offset_packed.tolist(),
        flat.start_S[lay.order_S].tolist(),
        lay.L_packed.tolist(),
        adv_S[lay.order_S].tolist(),
        strict=True,
    ):
        e = o + length
        ids_N[o:e] = ids_F[a : a + length]  # model input: input_ids[:-1]
        targets_N[o:e] = labels_F[a + 1 : a + 1 + length]  # target: labels[1:]
        lp_N[o:e] = lp_F[a + 1 : a + 1 + length]  # logprobs[1:]
        adv_N[o:e] = adv
        pos_N[o:e] = ramp[:length]
    adv_N[targets_N == IGNORE_INDEX] = 0.0  # a true 0 (multiplying would leave -0.0)
    has_lp_N = np.repeat(has_lp_S[lay.order_S], lay.L_packed)  # [N]
    return _Streams(ids_N, targets_N, lp_N, has_lp_N, adv_N, pos_N)


def _extra_targets(flat: Flat, lay: PlainLayout) -> np.ndarray:
    """Index, into the extras' own concatenation (training samples only, unshifted), of each
    packed position's target: position j of sample s reads ``start_s + j + 1``.  # [N]"""
    starts = np.cumsum(flat.T_S) - flat.T_S  # [S]
    return segments(starts[lay.order_S] + 1, lay.L_packed)  # [N]


def plain_packs(
    samples: Sequence[RolloutState], flat: Flat, lay: PlainLayout, adv_S: np.ndarray
) -> list[Pack]:
    """The packs of ``lay``: every sample shifted once, with its advantage and extras."""
    has_lp_S = np.array([s.logprobs is not None for s in samples], dtype=bool)  # [S]
    st = _shifted_streams(flat, lay, adv_S, has_lp_S)

    def teacher(attr: str) -> Callable[[RolloutState], Any]:
        return lambda s: None if s.teacher_targets is None else getattr(s.teacher_targets, attr)

    routed = _extra_F(samples, "routed_experts", lambda s: s.routed_experts, np.int64, ndim=3)
    t_ids = _extra_F(samples, "teacher_targets.token_ids", teacher("token_ids"), np.int64)
    t_lps = _extra_F(samples, "teacher_targets.logprobs", teacher("logprobs"), np.float32)
    tgt_extra = None
    if routed is not None or t_ids is not None:
        tgt_extra = _extra_targets(flat, lay)
    per_position: dict[str, torch.Tensor | None] = {
        "input_ids": torch.from_numpy(st.input_ids),  # [N]
        "targets": torch.from_numpy(st.targets),  # [N]
        "advantages": torch.from_numpy(st.advantages),  # [N]
        "rollout_logprobs": torch.from_numpy(st.rollout_logprobs),  # [N]
        "has_rollout_logprobs": torch.from_numpy(st.has_rollout_logprobs),  # [N]
        "position_ids": torch.from_numpy(st.position_ids),  # [N]
        # routing belongs to the model input: position j reads start_s + j (the target's - 1)
        "routed_experts": None if routed is None else torch.from_numpy(routed[tgt_extra - 1]),
        "teacher_token_ids": None if t_ids is None else torch.from_numpy(t_ids[tgt_extra]),
        "teacher_logprobs": None if t_lps is None else torch.from_numpy(t_lps[tgt_extra]),
    }  # extras: [N, K], routed_experts [N, L, K]
    kind = _teacher_kind(samples)
    row_tokens = np.diff(lay.pack_bounds).tolist()  # [B]
    # one split per field gives every pack its view of the packed stream
    split = {k: None if t is None else t.split(row_tokens) for k, t in per_position.items()}
    cu_views = _cu_seq_lens(lay)
    max_len_B = np.maximum.reduceat(lay.L_packed, lay.row_first).tolist() if lay.rows else []
    packs = []
    for b, row in enumerate(lay.rows):
        pack = Pack(
            **{k: None if views is None else views[b] for k, views in split.items()},
            cu_seq_lens=cu_views[b],
            max_seq_len=max_len_B[b],
            sample_index=row,
            teacher_kind=kind,
        )
        check_pack_widths(pack, b)
        packs.append(pack)
    return packs


def _cu_seq_lens(lay: PlainLayout) -> tuple[torch.Tensor, ...]:
    """Every pack's cu_seq_lens (its samples' starts, then its end, from 0) as views
    of one int32 array.  # B x [S_row + 1]"""
    n_B = np.diff(np.append(lay.row_first, lay.order_S.size))  # [B] samples per row
    cu = np.empty(lay.order_S.size + n_B.size, dtype=np.int32)  # [S + B]
    at_S = np.arange(lay.order_S.size) + lay.row_packed  # [S] slot of each sample's start
    cu[at_S] = lay.offset_packed - lay.pack_bounds[lay.row_packed]
    cu[lay.row_first + n_B + np.arange(n_B.size)] = np.diff(lay.pack_bounds)  # row ends
    return torch.from_numpy(cu).split((n_B + 1).tolist())
