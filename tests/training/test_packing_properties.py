"""Packing and shift invariants over random samples (hypothesis), plus the packer's figures."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltool.packing import pack_lengths, padding_waste
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status
from rltool.training.convert import ConversionConfig, convert_groups

# ---------------------------------------------------------------- pack_lengths


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), max_size=60),
    slack=st.integers(0, 60),
)
def test_pack_lengths_invariants(lengths: list[int], slack: int) -> None:
    max_len = max(lengths, default=1) + slack
    rows = pack_lengths(lengths, max_len)
    flat = [i for r in rows for i in r]
    assert sorted(flat) == list(range(len(lengths)))  # every sample exactly once
    assert all(r == sorted(r) and r for r in rows)
    assert all(sum(lengths[i] for i in r) <= max_len for r in rows)
    # any-fit: a row is opened only for a sample that fits no earlier row, so no two rows
    # could have shared one
    if len(rows) > 1:
        filled = sorted(sum(lengths[i] for i in r) for r in rows)
        assert filled[0] + filled[1] > max_len


def test_pack_lengths_hand_worked() -> None:
    # longest first: 6 -> row 0 (spare 2); 5 -> row 1 (spare 3); 3 -> best fit row 1 (spare 0);
    # 2 -> row 0 (spare 0)
    assert pack_lengths([3, 6, 2, 5], 8) == [[1, 2], [0, 3]]


def test_pack_lengths_names_a_sample_that_cannot_fit() -> None:
    with pytest.raises(
        ValueError, match=r"sample 'r-7': shifted length 9 > trainer\.pack_max_length 8"
    ):
        pack_lengths([3, 9], 8, ids=["r-3", "r-7"])
    with pytest.raises(ValueError, match="sample 1: shifted length 9"):
        pack_lengths([3, 9], 8)


def test_padding_waste_target() -> None:
    """4096 samples of ~1k tokens (uniform 512..1536) in rows of 8192: under 5% waste."""
    lengths = np.random.default_rng(0).integers(512, 1537, size=4096)
    rows = pack_lengths(lengths, 8192)
    waste = padding_waste(int(lengths.sum()), len(rows), 8192)
    assert waste < 0.05
    assert len(rows) <= int(np.ceil(lengths.sum() / 8192)) + 10  # within 2% of the bound


def test_padding_waste() -> None:
    assert padding_waste(10, 2, 8) == 1 - 10 / 16
    assert padding_waste(0, 0, 8) == 0.0


# ---------------------------------------------------------------- the shift, packed


@st.composite
def groups(draw: st.DrawFn) -> list[list[RolloutState]]:
    out = []
    for g in range(draw(st.integers(1, 4))):
        group = []
        for k in range(draw(st.integers(1, 4))):
            p = draw(st.integers(0, 6))
            r = draw(st.integers(2 if p == 0 else 1, 12))
            ids = draw(st.lists(st.integers(0, 999), min_size=p + r, max_size=p + r))
            sup = draw(st.lists(st.booleans(), min_size=r, max_size=r))
            labels = [IGNORE_INDEX] * p + [
                t if m else IGNORE_INDEX for t, m in zip(ids[p:], sup, strict=True)
            ]
            lps = [0.0] * p + [-(j + 1) / 64 if m else 0.0 for j, m in enumerate(sup)]
            s = RolloutState(
                rollout_id=f"g{g}-{k}",
                group_id=f"g{g}",
                session_id=draw(st.sampled_from([None, "a", "b"])),
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                input_ids=ids,
                labels=labels,
                logprobs=lps if draw(st.booleans()) else None,
                reward={"score": float(draw(st.integers(0, 3)))},
                status=Status.COMPLETED,
            )
            group.append(s)
        out.append(group)
    return out


@settings(max_examples=200, deadline=None)
@given(
    batch_groups=groups(),
    slack=st.integers(0, 30),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp"]),
)
def test_shift_and_packing_invariants(
    batch_groups: list[list[RolloutState]], slack: int, estimator: str
) -> None:
    samples = [s for g in batch_groups for s in g]
    max_len = max(len(s.input_ids) - 1 for s in samples) + slack
    batch = convert_groups(
        batch_groups, ConversionConfig(estimator=estimator, pack_max_length=max_len)
    )
    assert batch.skipped_groups == []
    assert [s.rollout_id for s in batch.samples] == [s.rollout_id for s in samples]
    # every sample appears exactly once, in the pack and at the offset its SampleInfo says
    placed = sorted(i for p in batch.packs for i in p.sample_index)
    assert placed == list(range(len(samples)))
    for k, p in enumerate(batch.packs):
        n = len(p)
        assert n <= max_len
        for t in (p.targets, p.advantages, p.rollout_logprobs, p.position_ids):
            assert t.shape == (n,)  # per-position widths equal
        cu = p.cu_seq_lens.tolist()
        assert cu[0] == 0 and cu[-1] == n
        assert p.max_seq_len == max(b - a for a, b in pairwise(cu))
        for j, i in enumerate(p.sample_index):
            info = batch.samples[i]
            assert (info.pack, info.start, info.length) == (k, cu[j], cu[j + 1] - cu[j])
            # position_ids restart at 0 at each cu_seq_lens boundary
            assert p.position_ids[cu[j] : cu[j + 1]].tolist() == list(range(info.length))
    for i, s in enumerate(samples):
        info = batch.samples[i]
        p = batch.packs[info.pack]
        span = slice(info.start, info.start + info.length)
        targets = p.targets[span]
        # the one shift, inside the sample: no target crosses a boundary
        assert p.input_ids[span].tolist() == s.input_ids[:-1].tolist()
        assert targets.tolist() == s.labels[1:].tolist()
        lps = s.logprobs[1:].tolist() if s.logprobs is not None else [0.0] * info.length
        assert p.rollout_logprobs[span].tolist() == torch.tensor(lps, dtype=torch.float32).tolist()
        adv = p.advantages[span]
        active = targets != IGNORE_INDEX
        assert not adv.isnan().any()
        assert (adv[~active] == 0).all()
        assert torch.equal(adv[active], torch.full_like(adv[active], np.float32(info.advantage)))
        assert info.length == len(s.input_ids) - 1
