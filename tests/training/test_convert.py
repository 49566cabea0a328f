"""convert_groups (data-contract section 5) on hand-worked batches.

Regression lock for the one shift: the worked example of section 7, packed
alignment across samples, session clusters, task weights, skipped groups,
staleness figures and data_info, all written out by hand. Conversion is pure:
staleness is baked explicitly (``bake_staleness``) before converting.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rltool.rollout.fields as fields_module
from rltool.agent_loops.canonical import build_prompt_response_fields
from rltool.config.schema import AlgorithmConfig, ModelConfig, RecipeConfig, TrainerConfig
from rltool.rollout.contract import check_group, errors
from rltool.rollout.staleness import StalenessLimits, bake_staleness
from rltool.rollout.state import IGNORE_INDEX, RolloutState, Status, TeacherTargets
from rltool.training.advantages import EPS
from rltool.training.batch import Pack, SharedPack, TrainBatch
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.layout.plain import check_pack_widths

X = IGNORE_INDEX


def make(
    rid: str,
    prompt: list[int],
    response: list[int],
    supervised: list[int],
    lps: list[float] | None = None,
    *,
    score: float | None = 1.0,
    gid: str = "g",
    **fields: object,
) -> RolloutState:
    """A COMPLETED sample; ``supervised[i]`` says whether response token i is trained,
    ``lps[i]`` is its engine logprob (0.0 written wherever it is not supervised)."""
    labels = [X] * len(prompt) + [t if m else X for t, m in zip(response, supervised, strict=True)]
    logprobs = None
    if lps is not None:
        logprobs = [0.0] * len(prompt) + [
            lp if m else 0.0 for lp, m in zip(lps, supervised, strict=True)
        ]
    return RolloutState(
        rollout_id=rid,
        group_id=gid,
        prompt_ids=prompt,
        response_ids=response,
        input_ids=prompt + response,
        labels=labels,
        logprobs=logprobs,
        reward=None if score is None else {"score": score},
        status=fields.pop("status", Status.COMPLETED),
        **fields,
    )


def sample_view(batch: TrainBatch, i: int) -> dict[str, list]:
    """The per-position fields of sample i, cut out of its pack."""
    info = batch.samples[i]
    p = batch.packs[info.pack]
    span = slice(info.start, info.start + info.length)
    return {
        "input_ids": p.input_ids[span].tolist(),
        "targets": p.targets[span].tolist(),
        "advantages": p.advantages[span].tolist(),
        "rollout_logprobs": p.rollout_logprobs[span].tolist(),
        "position_ids": p.position_ids[span].tolist(),
    }


def f32(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).tolist()


# ---------------------------------------------------------------- the one shift


def test_worked_example_of_section_7() -> None:
    # dr_grpo on rewards 3 and 0 gives advantages +1.5 and -1.5
    a = make("a", [10, 11, 12], [20, 21, 22], [1, 0, 1], [-0.1, 0.0, -0.3], score=3.0)
    b = make("b", [10, 11, 12], [20, 21, 22], [1, 0, 1], [-0.1, 0.0, -0.3], score=0.0)
    assert a.labels.tolist() == [X, X, X, 20, X, 22]
    assert a.logprobs.tolist() == [0.0, 0.0, 0.0, -0.1, 0.0, -0.3]
    batch = convert_groups([[a, b]], ConversionConfig(estimator="dr_grpo", pack_max_length=16))

    view = sample_view(batch, 0)
    assert view["input_ids"] == [10, 11, 12, 20, 21]
    assert view["targets"] == [X, X, 20, X, 22]
    assert view["rollout_logprobs"] == f32([0.0, 0.0, -0.1, 0.0, -0.3])
    assert view["advantages"] == [0.0, 0.0, 1.5, 0.0, 1.5]
    assert batch.samples[0].advantage == 1.5
    assert batch.samples[0].length == 5 == len(a.input_ids) - 1
    assert sample_view(batch, 1)["advantages"] == [0.0, 0.0, -1.5, 0.0, -1.5]
    info = batch.data_info
    assert (info["data/prompt_len/min"], info["data/prompt_len/max"]) == (3.0, 3.0)
    assert (info["data/response_len/min"], info["data/response_len/max"]) == (2.0, 2.0)


def _three_samples() -> list[RolloutState]:
    """Shifted lengths 3, 5, 2; dr_grpo advantages +0.5, -0.5, 0 (rewards 1, 0, 0.5)."""
    return [
        make("s0", [1, 2], [3, 4], [1, 1], [-0.3, -0.4], score=1.0),
        make("s1", [5], [6, 7, 8, 9, 10], [1, 0, 1, 1, 0], [-0.6, 0, -0.8, -0.9, 0], score=0.0),
        make("s2", [11, 12], [13], [1], [-0.13], score=0.5),
    ]


def test_packed_alignment_one_pack() -> None:
    """Regression lock: advantages exactly as long as the shifted inputs, and no target
    reads the next sample's first token."""
    batch = convert_groups(
        [_three_samples()], ConversionConfig(estimator="dr_grpo", pack_max_length=16)
    )
    assert len(batch.packs) == 1
    p = batch.packs[0]
    assert p.input_ids.tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 11, 12]
    # s0's last target is its own 4 (not s1's 5); s1's last is its -100 (not s2's 11)
    assert p.targets.tolist() == [X, 3, 4, 6, X, 8, 9, X, X, 13]
    assert p.advantages.tolist() == [0, 0.5, 0.5, -0.5, 0, -0.5, -0.5, 0, 0, 0]
    assert p.rollout_logprobs.tolist() == f32([0, -0.3, -0.4, -0.6, 0, -0.8, -0.9, 0, 0, -0.13])
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert p.cu_seq_lens.tolist() == [0, 3, 8, 10]
    assert p.cu_seq_lens.dtype == torch.int32
    assert p.input_ids.dtype == p.targets.dtype == p.position_ids.dtype == torch.long
    assert p.advantages.dtype == p.rollout_logprobs.dtype == torch.float32
    assert p.max_seq_len == 5
    assert p.sample_index == [0, 1, 2]
    assert [(s.pack, s.start, s.length) for s in batch.samples] == [(0, 0, 3), (0, 3, 5), (0, 8, 2)]
    assert batch.data_info["data/padding_waste"] == pytest.approx(1 - 10 / 16)


def test_packed_alignment_two_packs() -> None:
    # rows of 5: best fit decreasing puts s1 (5) alone, then s0 (3) and s2 (2) together
    batch = convert_groups(
        [_three_samples()], ConversionConfig(estimator="dr_grpo", pack_max_length=5)
    )
    p0, p1 = batch.packs
    assert p0.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert p0.targets.tolist() == [6, X, 8, 9, X]
    assert p0.cu_seq_lens.tolist() == [0, 5]
    assert p1.input_ids.tolist() == [1, 2, 3, 11, 12]
    assert p1.targets.tolist() == [X, 3, 4, X, 13]
    assert p1.advantages.tolist() == [0, 0.5, 0.5, 0, 0]
    assert p1.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert p1.cu_seq_lens.tolist() == [0, 3, 5]
    assert (p0.sample_index, p1.sample_index) == ([1], [0, 2])
    assert [(s.pack, s.start) for s in batch.samples] == [(1, 0), (0, 0), (1, 3)]
    for k, p in enumerate(batch.packs):
        check_pack_widths(p, k)
    info = batch.data_info
    assert (info["data/packs"], info["data/training_tokens"], info["data/padding_waste"]) == (
        2.0,
        10.0,
        0.0,
    )


def test_pack_width_check_names_the_field() -> None:
    p = convert_groups([_three_samples()], ConversionConfig(pack_max_length=16)).packs[0]
    p.advantages = p.advantages[:-1]  # one short, the classic off-by-one
    with pytest.raises(ValueError, match="pack 3: advantages has 9 positions, input_ids has 10"):
        check_pack_widths(p, 3)


def test_sample_longer_than_pack_is_named() -> None:
    with pytest.raises(ValueError, match=r"'s1'.*5 > trainer\.pack_max_length 4"):
        convert_groups([_three_samples()], ConversionConfig(pack_max_length=4))


def test_without_engine_logprobs_rollout_logprobs_are_zero() -> None:
    s = [make(f"n{i}", [1, 2], [3, 4], [1, 1], None, score=float(i)) for i in range(2)]
    batch = convert_groups([s], ConversionConfig(pack_max_length=16))
    assert batch.packs[0].rollout_logprobs.tolist() == [0.0] * 6
    assert [x.has_rollout_logprobs for x in batch.samples] == [False, False]
    assert batch.packs[0].has_rollout_logprobs.tolist() == [False] * 6


def test_engine_logprobs_flag_follows_each_sample_through_both_layouts() -> None:
    """The fact comes from ``logprobs is None``, not from the values: n1's are all 0.0."""
    s = [
        make("n0", [1, 2], [3, 4], [1, 1], None, score=0.0),
        make("n1", [1, 2], [5], [1], [0.0], score=1.0),
        make("n2", [1, 2], [6, 7], [1, 1], [-0.2, -0.3], score=0.5),
    ]
    plain = convert_groups([s], ConversionConfig(pack_max_length=16)).packs[0]
    assert plain.has_rollout_logprobs.tolist() == [False] * 3 + [True] * 2 + [True] * 3
    cfg = ConversionConfig(pack_max_length=16, prefix_sharing=True)
    shared = convert_groups([s], cfg).packs[0]
    # the prefix (input 1) once, then the branches 2 3 | 2 | 2 6
    assert shared.input_ids.tolist() == [1, 2, 3, 2, 2, 6]
    assert shared.has_rollout_logprobs.tolist() == [False] * 3 + [True] + [True] * 2


def _one_prompt_group() -> list[RolloutState]:
    """Prompt 1 2 3, responses 7 8 / 9 / 4 5 6 (shifted lengths 4, 3, 5)."""
    return [
        make("a", [1, 2, 3], [7, 8], [1, 1], [-0.1, -0.2], score=1.0),
        make("b", [1, 2, 3], [9], [1], [-0.3], score=0.0),
        make("c", [1, 2, 3], [4, 5, 6], [1, 0, 1], [-0.4, 0.0, -0.6], score=0.5),
    ]


def test_prefix_sharing_lays_the_prompt_out_once() -> None:
    cfg = ConversionConfig(estimator="dr_grpo", pack_max_length=16, prefix_sharing=True)
    batch = convert_groups([_one_prompt_group()], cfg)
    (p,) = batch.packs
    assert isinstance(p, SharedPack)
    # prefix: inputs 1 2 (targets -100); branches a: 3 7, b: 3, c: 3 4 5
    assert p.input_ids.tolist() == [1, 2, 3, 7, 3, 3, 4, 5]
    assert p.targets.tolist() == [X, X, 7, 8, 9, 4, X, 6]
    assert p.advantages.tolist() == [0, 0, 0.5, 0.5, -0.5, 0, 0, 0]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 2, 2, 3, 4]
    assert p.branch_ids.tolist() == [0, 0, 1, 1, 2, 3, 3, 3]
    assert p.cu_seq_lens.tolist() == [0, 4, 5, 8]
    placed = [(x.pack, x.start, x.length, x.prefix_length, x.branch_start) for x in batch.samples]
    assert placed == [(0, 0, 4, 2, 2), (0, 0, 3, 2, 4), (0, 0, 5, 2, 5)]
    check_pack_widths(p)
    # data_info as for plain rows, but for the rows trained: 1 pack of 8 tokens in 16
    plain_cfg = ConversionConfig(estimator="dr_grpo", pack_max_length=16)
    plain = convert_groups([_one_prompt_group()], plain_cfg).data_info
    assert batch.data_info["data/packs"] == 1.0 and batch.data_info["data/padding_waste"] == 0.5
    # the model computes 1 2 | 3 7 | 4 5: the branches' leading 3 once (branch_merge.py)
    assert p.input_ids[p.merged.rep].tolist() == [1, 2, 3, 7, 4, 5]
    assert batch.data_info["data/forward_positions"] == 6.0
    assert plain["data/training_tokens"] == 12.0  # 4 + 3 + 5 shifted positions
    layout = ("data/packs", "data/forward_positions", "data/padding_waste")
    assert {k: v for k, v in batch.data_info.items() if k not in layout} == {
        k: v for k, v in plain.items() if k not in layout
    }


@pytest.mark.parametrize(
    ("attn", "device", "shared", "kernel", "plain_kernel"),
    [
        ("sdpa", "cpu", True, "sdpa-tree", "sdpa-varlen"),
        ("sdpa", "cuda", True, "flex-block", "sdpa-varlen"),
        ("eager", "cpu", True, "dense", "native"),
        # no kernel for shared rows: plain rows even with prefix sharing on
        ("flash_attention_2", "cpu", False, "flash-varlen", "flash-varlen"),
    ],
)
def test_the_attention_kernel_is_chosen_at_conversion(
    attn: str, device: str, shared: bool, kernel: str, plain_kernel: str
) -> None:
    cfg = ConversionConfig(
        pack_max_length=16, prefix_sharing=True, attn_implementation=attn, device=device
    )
    (p,) = convert_groups([_one_prompt_group()], cfg).packs
    assert isinstance(p, SharedPack) == shared
    assert p.attention == kernel
    off = dataclasses.replace(cfg, prefix_sharing=False)
    (q,) = convert_groups([_one_prompt_group()], off).packs
    assert type(q) is Pack and q.attention == plain_kernel


def test_prefix_sharing_with_routed_experts_shares_only_equal_routing() -> None:
    """The prefix (inputs 1 2) is shared when its recorded experts agree too: b's prompt went
    to other experts, so b gets a tree of its own; each position keeps its own routing."""
    group = _one_prompt_group()
    for s in group:
        s.routed_experts = [[[t % 4, 4 + t % 4]] for t in s.input_ids]  # [T, 1, 2]
    group[1].routed_experts = [[[5, 6]]] * len(group[1].input_ids)
    cfg = ConversionConfig(pack_max_length=16, prefix_sharing=True)
    (p,) = convert_groups([group], cfg).packs
    assert isinstance(p, SharedPack)
    # tree of a, c: prefix 1 2, branches a: 3 7, c: 3 4 5; tree of b: 1 2 3 (no branch split)
    assert p.input_ids.tolist() == [1, 2, 3, 7, 3, 4, 5, 1, 2, 3]
    assert (
        p.routed_experts[:, 0].tolist()
        == [[t % 4, 4 + t % 4] for t in [1, 2, 3, 7, 3, 4, 5]] + [[5, 6]] * 3
    )


def test_extras_take_the_same_shift() -> None:
    def with_extras(rid: str, score: float) -> RolloutState:
        s = make(rid, [1, 2], [3, 4], [1, 1], [-0.3, -0.4], score=score)
        ids = s.input_ids.tolist()
        s.routed_experts = [[[t, t + 100]] for t in ids]  # [T, 1, 2]
        s.teacher_targets = TeacherTargets(
            kind="topk",
            token_ids=[[t, t + 1] for t in ids],
            logprobs=[[-0.5 * t, -1.0] for t in ids],
        )
        return s

    batch = convert_groups(
        [[with_extras("e0", 1.0), with_extras("e1", 0.0)]], ConversionConfig(pack_max_length=16)
    )
    p = batch.packs[0]
    # routing belongs to the model input: routed_experts[:-1], the targets' extras [1:]
    assert p.routed_experts.tolist() == [[[1, 101]], [[2, 102]], [[3, 103]]] * 2
    assert p.teacher_token_ids.tolist() == [[2, 3], [3, 4], [4, 5]] * 2
    assert p.teacher_logprobs.tolist() == [[-1.0, -1.0], [-1.5, -1.0], [-2.0, -1.0]] * 2
    assert p.teacher_kind == "topk"


def test_extras_on_some_samples_only_is_an_error() -> None:
    a = make("a", [1, 2], [3, 4], [1, 1], score=1.0)
    b = make("b", [1, 2], [3, 4], [1, 1], score=0.0)
    a.routed_experts = [[[0]], [[0]], [[0]], [[0]]]
    with pytest.raises(ValueError, match="sample b: routed_experts missing"):
        convert_groups([[a, b]], ConversionConfig(pack_max_length=16))


# ---------------------------------------------------------------- advantages


def test_session_clusters_share_one_advantage() -> None:
    # clusters: session A (a1, a2, score 1), b (score 0), c (score 0.5)
    # GRPO over 1, 0, 0.5: mean 0.5, sample std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    group = [
        make("a1", [1], [2, 3], [1, 1], score=1.0, session_id="A"),
        make("a2", [1], [4, 5], [1, 1], score=1.0, session_id="A"),
        make("b", [1], [2, 3], [1, 1], score=0.0),
        make("c", [1], [2, 3], [1, 1], score=0.5),
    ]
    batch = convert_groups([group], ConversionConfig(estimator="grpo", pack_max_length=16))
    a = 0.5 / (0.5 + EPS)
    assert [s.advantage for s in batch.samples] == pytest.approx([a, a, -a, 0.0], abs=1e-12)
    info = batch.data_info
    # three clusters, one reward each
    assert (info["data/rewards/mean"], info["data/rewards/min"]) == (0.5, 0.0)


def test_session_members_with_different_scores_use_their_mean() -> None:
    # session A members score 1 and 0 -> cluster reward 0.5; b scores 0 -> dr_grpo: +0.25, -0.25
    group = [
        make("a1", [1], [2, 3], [1, 1], score=1.0, session_id="A"),
        make("a2", [1], [2, 3], [1, 1], score=0.0, session_id="A"),
        make("b", [1], [2, 3], [1, 1], score=0.0),
    ]
    batch = convert_groups([group], ConversionConfig(estimator="dr_grpo", pack_max_length=16))
    assert [s.advantage for s in batch.samples] == [0.25, 0.25, -0.25]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_lone_cluster_gets_zero_not_nan(estimator: str) -> None:
    one_session = [
        make("seg1", [1], [2, 3], [1, 1], score=1.0, session_id="S"),
        make("seg2", [1], [4, 5], [1, 1], score=1.0, session_id="S"),
    ]
    alone = [make("solo", [1], [2, 3], [1, 1], score=0.7, gid="h")]
    batch = convert_groups(
        [one_session, alone], ConversionConfig(estimator=estimator, pack_max_length=16)
    )
    assert [s.advantage for s in batch.samples] == [0.0, 0.0, 0.0]
    assert not any(math.isnan(v) for v in batch.data_info.values())
    assert all(not p.advantages.isnan().any() for p in batch.packs)


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    # r - group mean: g -> +0.5, -0.5; h -> +1, -1; whitened over the four clusters:
    # mean 0, sample std sqrt((0.25 + 0.25 + 1 + 1) / 3)
    g = [make("g0", [1], [2], [1], score=1.0), make("g1", [1], [2], [1], score=0.0)]
    h = [
        make("h0", [1], [2], [1], score=2.0, gid="h"),
        make("h1", [1], [2], [1], score=0.0, gid="h"),
    ]
    batch = convert_groups([g, h], ConversionConfig(estimator="reinforce_pp", pack_max_length=8))
    s = math.sqrt(2.5 / 3) + EPS
    want = [0.5 / s, -0.5 / s, 1 / s, -1 / s]
    assert [x.advantage for x in batch.samples] == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- task_adv_weight


def test_missing_reward_with_positive_weight_raises() -> None:
    group = [make("r1", [1], [2], [1], score=None, task_name="math")]
    with pytest.raises(ValueError, match=r"sample r1 \(task 'math'.*without reward"):
        convert_groups([group], ConversionConfig(pack_max_length=8))


def test_weight_zero_trains_with_zero_advantage_without_reward() -> None:
    distill = [
        make("d0", [1], [2, 3], [1, 1], score=None, task_name="distill", gid="d"),
        make("d1", [1], [2, 4], [1, 1], score=None, task_name="distill", gid="d"),
    ]
    math_group = [
        make("m0", [1], [2], [1], score=1.0, task_name="math"),
        make("m1", [1], [2], [1], score=0.0, task_name="math"),
    ]
    cfg = ConversionConfig(
        estimator="dr_grpo", pack_max_length=16, task_adv_weight={"distill": 0.0}
    )
    batch = convert_groups([distill, math_group], cfg)
    assert [s.rollout_id for s in batch.samples] == ["d0", "d1", "m0", "m1"]
    assert [s.advantage for s in batch.samples] == [0.0, 0.0, 0.5, -0.5]
    d0 = sample_view(batch, 0)
    assert d0["targets"] == [2, 3] and d0["advantages"] == [0.0, 0.0]  # trains, no advantage
    assert batch.data_info["data/rewards/mean"] == 0.5  # only clusters with a reward


def test_weight_half_halves_the_advantage() -> None:
    def group() -> list[RolloutState]:
        return [
            make("x0", [1], [2], [1], score=1.0, task_name="t"),
            make("x1", [1], [2], [1], score=0.0, task_name="t"),
        ]

    full = convert_groups([group()], ConversionConfig(pack_max_length=8))
    half = convert_groups(
        [group()], ConversionConfig(pack_max_length=8, task_adv_weight={"t": 0.5})
    )
    assert [s.advantage for s in half.samples] == [s.advantage / 2 for s in full.samples]
    # halving is exact in floating point: bit-equal
    assert half.packs[0].advantages.tolist() == (full.packs[0].advantages / 2).tolist()


# ---------------------------------------------------------------- skipped groups


def test_failed_member_skips_its_group_and_is_counted() -> None:
    bad = [
        make("f0", [1], [2], [1], score=1.0, gid="bad"),
        make("f1", [1], [2], [1], score=None, gid="bad", status=Status.FAILED, error="boom"),
    ]
    good = [make("k0", [1], [2], [1], score=1.0), make("k1", [1], [2], [1], score=0.0)]
    batch = convert_groups([bad, good], ConversionConfig(pack_max_length=8))
    assert [s.rollout_id for s in batch.samples] == ["k0", "k1"]
    (skip,) = batch.skipped_groups
    assert (skip.group_id, skip.reason) == ("bad", "failed")
    assert "f1" in skip.detail and "boom" in skip.detail
    info = batch.data_info
    assert info["data/groups"] == 2.0
    assert info["data/skipped_groups"] == 1.0
    assert info["data/skipped/failed"] == 1.0
    assert info["data/training_samples"] == 2.0


def _corrupt_label(s: RolloutState) -> None:
    s.labels[-1] = 99  # neither -100 nor the input id


def _corrupt_length(s: RolloutState) -> None:
    s.labels = s.labels[:-1]


def _corrupt_steps(s: RolloutState) -> None:
    s.response_model_steps = [3, 1]


def _corrupt_task(s: RolloutState) -> None:
    s.task_name = "other"


@pytest.mark.parametrize(
    ("corrupt", "field"),
    [
        (_corrupt_label, "labels"),
        (_corrupt_length, "labels"),
        (_corrupt_steps, "response_model_steps"),
        (_corrupt_task, "task_name"),
    ],
)
def test_invariant_violation_skips_group_as_invalid(corrupt, field: str) -> None:
    group = [make("v0", [1], [2, 3], [1, 1], score=1.0), make("v1", [1], [2, 3], [1, 1], score=0.0)]
    corrupt(group[1])
    batch = convert_groups([group], ConversionConfig(pack_max_length=8))
    (skip,) = batch.skipped_groups
    assert skip.reason == "invalid"
    assert skip.detail == str(errors(check_group(group))[0])
    assert skip.detail.startswith("v1: ") and field in skip.detail
    assert batch.packs == [] and batch.data_info["data/skipped/invalid"] == 1.0


def test_empty_step() -> None:
    batch = convert_groups([], ConversionConfig())
    assert batch.packs == [] and batch.samples == []
    assert batch.data_info["data/groups"] == 0.0
    assert batch.data_info["data/padding_waste"] == 0.0


# ---------------------------------------------------------------- staleness


def test_staleness_baked_before_conversion_reaches_the_shift() -> None:
    # production bakes (contract section 6): train step 3, max_token_staleness 0, sync 1:
    # trainable while staleness < 1; steps [1, 2, 2] -> staleness [1, 0, 0]: token 20 cleared
    lps = [-0.1, -0.2, -0.3]
    a = make("a", [10], [20, 21, 22], [1, 1, 1], lps, score=1.0)
    b = make("b", [10], [20, 21, 22], [1, 1, 1], lps, score=0.0)
    a.response_model_steps = [1, 2, 2]
    b.response_model_steps = [2, 2, 2]
    limits = StalenessLimits(max_token_staleness=0)
    assert [bake_staleness(s, 3, limits).cleared for s in (a, b)] == [1, 0]
    assert a.labels.tolist() == [X, X, 21, 22]  # baked into the sample, in place
    cfg = ConversionConfig(estimator="dr_grpo", pack_max_length=16)
    batch = convert_groups([[a, b]], cfg, train_step=3)
    assert sample_view(batch, 0)["targets"] == [X, 21, 22]
    assert sample_view(batch, 0)["advantages"] == [0.0, 0.5, 0.5]
    assert sample_view(batch, 0)["rollout_logprobs"] == f32([0.0, -0.2, -0.3])
    assert sample_view(batch, 1)["targets"] == [20, 21, 22]
    info = batch.data_info
    # supervised response tokens left: a -> 0, 0; b -> 0, 0, 0
    assert (info["data/staleness/mean"], info["data/staleness/max"]) == (0.0, 0.0)
    assert info["data/response_len/min"] == 2.0 and info["data/supervised_tokens"] == 5.0
    assert "staleness/stale_tokens" not in info  # production reports what it cleared


def test_staleness_figures_without_limits() -> None:
    a = make("a", [10], [20, 21, 22], [1, 0, 1], None, score=1.0)
    a.response_model_steps = [0, 1, 2]  # train step 4 -> staleness 3, 2, 1; supervised: 3 and 1
    batch = convert_groups([[a]], ConversionConfig(pack_max_length=8), train_step=4)
    info = batch.data_info
    assert (info["data/staleness/mean"], info["data/staleness/max"]) == (2.0, 3.0)


def test_expired_sample_is_production_s_to_skip() -> None:
    # max_staleness 1, sync 2: a sample expires when its oldest token reaches 4; production
    # marks it EXPIRED, and conversion skips its group by that status
    old = make("old", [10], [20, 21], [1, 1], None, score=1.0, gid="o")
    old.response_model_steps = [0, 3]  # train step 5 -> staleness 4, 1
    young = make("young", [10], [20, 21], [1, 1], None, score=0.0, gid="o")
    young.response_model_steps = [3, 3]
    fresh = [make("f", [10], [20, 21], [1, 1], None, score=1.0, gid="f")]
    fresh[0].response_model_steps = [4, 4]
    limits = StalenessLimits(max_staleness=1, sync_interval=2)
    for s in (old, young, *fresh):
        r = bake_staleness(s, 5, limits)
        if r.expired:
            s.status, s.error = Status.EXPIRED, f"{r.reason} (oldest token staleness 4)"
    batch = convert_groups([[old, young], fresh], ConversionConfig(pack_max_length=8), 5)
    (skip,) = batch.skipped_groups
    assert (skip.group_id, skip.reason) == ("o", "expired")
    assert skip.detail.startswith("old: EXPIRED (max_staleness")
    assert [s.rollout_id for s in batch.samples] == ["f"]
    assert batch.data_info["data/skipped/expired"] == 1.0


def test_conversion_never_writes_its_groups() -> None:
    """Pure: the groups after conversion equal a deep copy taken before, whatever the
    staleness of their tokens (train step 9: every token of steps [0, 1] is old)."""
    group = [make(f"p{k}", [1, 2], [3, 4], [1, 1], [-0.5, -0.25], score=k) for k in range(2)]
    for s in group:
        s.response_model_steps = [0, 1]
    bad = make("v", [1], [2, 3], [1, 1], score=1.0, gid="bad")
    bad.labels[-1] = 99  # invalid: skipped, not repaired
    before = copy.deepcopy([group, [bad]])
    batch = convert_groups([group, [bad]], ConversionConfig(pack_max_length=16), train_step=9)
    assert [group, [bad]] == before
    assert [g.reason for g in batch.skipped_groups] == ["invalid"]
    assert batch.data_info["data/staleness/max"] == 8.0  # read, not baked
    assert sample_view(batch, 0)["targets"] == [X, 3, 4]


# ---------------------------------------------------------------- data_info and config


def test_data_info_by_hand() -> None:
    g = [
        make("a", [1, 2, 3], [4, 5, 6, 7], [1, 0, 0, 1], None, score=1.0, extra={"tool_turns": 2}),
        make("b", [1, 2, 3], [4, 5], [1, 1], None, score=0.0),
    ]
    batch = convert_groups([g], ConversionConfig(estimator="dr_grpo", pack_max_length=10))
    # shifted lengths 6 and 4 -> one row of 10
    assert batch.data_info == {
        "data/groups": 1.0,
        "data/skipped_groups": 0.0,
        "data/training_samples": 2.0,
        "data/training_tokens": 10.0,
        "data/supervised_tokens": 4.0,
        "data/packs": 1.0,
        "data/forward_positions": 10.0,
        "data/padding_waste": 0.0,
        "data/rewards/mean": 0.5,
        "data/rewards/min": 0.0,
        "data/rewards/max": 1.0,
        "data/advantages/mean": 0.0,  # two tokens at +0.5, two at -0.5
        "data/advantages/min": -0.5,
        "data/advantages/max": 0.5,
        "data/prompt_len/mean": 3.0,
        "data/prompt_len/min": 3.0,
        "data/prompt_len/max": 3.0,
        "data/response_len/mean": 2.0,  # supervised tokens only: tool tokens 5, 6 count nowhere
        "data/response_len/min": 2.0,
        "data/response_len/max": 2.0,
        "data/tool_turns/mean": 1.0,
        "data/staleness/mean": 0.0,
        "data/staleness/max": 0.0,
    }


def test_from_recipe() -> None:
    recipe = RecipeConfig(
        algorithm=AlgorithmConfig(
            estimator="rloo", task_adv_weight={"distill": 0}, max_staleness=2, sync_interval=3
        ),
        trainer=TrainerConfig(pack_max_length=4096),
    )
    assert ConversionConfig.from_recipe(recipe) == ConversionConfig(
        estimator="rloo",
        pack_max_length=4096,
        prefix_sharing=True,
        task_adv_weight={"distill": 0.0},
    )  # the staleness limits are production's (StalenessLimits), not conversion's


@pytest.mark.parametrize(
    ("attn", "sharing"), [("sdpa", True), ("eager", True), ("flash_attention_2", True),
                          ("sdpa", False)],
)  # fmt: skip
def test_from_recipe_carries_sharing_and_the_attention(attn: str, sharing: bool) -> None:
    """The layout picks the kernels from these (flash attention on the CPU: plain rows)."""
    recipe = RecipeConfig(
        model=ModelConfig(attn_implementation=attn, device="cpu"),
        trainer=TrainerConfig(prefix_sharing=sharing),
    )
    cfg = ConversionConfig.from_recipe(recipe)
    assert (cfg.prefix_sharing, cfg.attn_implementation, cfg.device) == (sharing, attn, "cpu")


# ---------------------------------------------------------------- screening == check_group


def _corruptions(s: RolloutState, group: list[RolloutState]) -> dict:
    """Ways to break one sample or its group, each an invariant of section 4."""
    t, p = len(s.input_ids), len(s.prompt_ids)

    def setter(name: str, value: object):
        return lambda: setattr(s, name, value)

    def at(name: str, i: int, value: object):
        return lambda: getattr(s, name).__setitem__(i, value)

    return {
        "none": lambda: None,
        "label_foreign": at("labels", t - 1, s.input_ids[t - 1] + 1),
        "prompt_supervised": at("labels", 0, s.input_ids[0]) if p else lambda: None,
        "lp_positive": at("logprobs", t - 1, 0.5),
        "lp_tiny_unsupervised": at("logprobs", 0, 1e-50),
        "lp_nan": at("logprobs", t - 1, math.nan),
        "lp_neg_inf": at("logprobs", t - 1, -math.inf),
        "lp_short": setter("logprobs", s.logprobs[:-1]),
        "labels_short": setter("labels", s.labels[:-1]),
        "too_short": setter("input_ids", s.input_ids[:1]),
        "response_changed": at("response_ids", t - p - 1, s.response_ids[-1] + 7),
        "prompt_changed": at("prompt_ids", 0, s.prompt_ids[0] + 7) if p else lambda: None,
        "response_missing": setter("response_ids", None),
        "steps_decrease": setter("response_model_steps", list(range(t - p, 0, -1))),
        "steps_short": setter("response_model_steps", [0] * (t - p - 1)),
        "score_nan": setter("reward", {"score": math.nan}),
        "group_id": setter("group_id", "elsewhere"),
        "duplicate_id": setter("rollout_id", group[0].rollout_id),
        "experts_short": setter("routed_experts", [[[0]]] * (t - 1)),
    }


CORRUPTIONS = sorted(_corruptions(make("x", [1], [2], [1], [-1.0]), [make("y", [1], [2], [1])]))


@st.composite
def sample_lists(draw: st.DrawFn) -> list[RolloutState]:
    n = draw(st.integers(1, 3))
    group = []
    for k in range(n):
        p = draw(st.integers(0, 3))
        r = draw(st.integers(2 if p == 0 else 1, 4))
        sup = draw(st.lists(st.integers(0, 1), min_size=r, max_size=r))
        prompt = list(range(1, p + 1))
        response = list(range(100, 100 + r))
        lps = [-0.5] * r
        steps = sorted(draw(st.lists(st.integers(0, 5), min_size=r, max_size=r)))
        s = make(f"s{k}", prompt, response, sup, lps, score=float(k), response_model_steps=steps)
        group.append(s)
    return group


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    group=sample_lists(),
    which=st.integers(0, 2),
    corruption=st.sampled_from(CORRUPTIONS),
)
def test_screening_agrees_with_check_group(
    group: list[RolloutState], which: int, corruption: str
) -> None:
    """The screen, checking the whole step at once, skips a group as invalid exactly when
    check_group on that group alone finds an error, and names the same one."""
    victim = group[which % len(group)]
    _corruptions(victim, group)[corruption]()
    want = errors(check_group(group))
    batch = convert_groups([group], ConversionConfig(pack_max_length=64))
    if want:
        assert [(g.reason, g.detail) for g in batch.skipped_groups] == [("invalid", str(want[0]))]
    else:
        assert batch.skipped_groups == [] and len(batch.samples) == len(group)
        assert isinstance(batch.packs[0], Pack)


@pytest.mark.parametrize("block", [1, fields_module.BLOCK_TOKENS])
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corruptions_in_place_are_seen_block_by_block(
    corruption: str, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every corruption, made in place in a sample's arrays, is seen: the screen agrees
    with check_group. Blocks of 1 position put every sample in a block of its own."""
    monkeypatch.setattr(fields_module, "BLOCK_TOKENS", block)
    group = [
        make(f"s{k}", [1, 2], [100, 101, 102], [1, 0, 1], [-0.5] * 3, score=float(k))
        for k in range(2)
    ]
    for s in group:
        s.response_model_steps = [0, 1, 1]
    _corruptions(group[1], group)[corruption]()
    want = errors(check_group(group))
    batch = convert_groups([group], ConversionConfig(pack_max_length=64))
    assert [(g.reason, g.detail) for g in batch.skipped_groups] == (
        [("invalid", str(want[0]))] if want else []
    )


def test_canonicalized_samples_convert_like_samples_read_from_json() -> None:
    """Samples canonicalized in the program and the same samples read back from JSON
    convert alike, also after an in-place edit of one sample's arrays."""

    def canonical(rid: str, response: list[int], score: float) -> RolloutState:
        s = RolloutState(
            rollout_id=rid,
            group_id="g",
            prompt_ids=[10, 11],
            response_ids=response,
            reward={"score": score},
            status=Status.COMPLETED,
        )
        build_prompt_response_fields(s, [-0.25] * len(response))
        return s

    group = [canonical("a", [20, 21, 22], 1.0), canonical("b", [30, 31], 0.0)]
    a = group[0]
    assert a.labels.tolist() == [X, X, 20, 21, 22]
    a.labels[3], a.logprobs[3] = X, 0.0  # token 21 becomes environment output, in place
    plain = [RolloutState.from_json(s.to_json()) for s in group]
    assert plain == group
    cfg = ConversionConfig(pack_max_length=8)
    batch, want = convert_groups([group], cfg), convert_groups([plain], cfg)
    assert sample_view(batch, 0)["targets"] == [X, 20, X, 22]
    assert sample_view(batch, 0)["rollout_logprobs"] == [0.0, -0.25, 0.0, -0.25]
    for i in range(2):
        assert sample_view(batch, i) == sample_view(want, i)
    assert batch.data_info == want.data_info
