"""Shared-prefix rows: the same logprobs and the same update as plain rows, with fewer tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import random_qwen2

from rltool.config.schema import AlgorithmConfig, OptimizerConfig
from rltool.training.batch import Pack, SharedPack
from rltool.training.layout.plain import check_pack_widths
from rltool.training.layout.shared_prefix import share_prefixes, shareable
from rltool.training.logprobs import attention_allowed, forward_logprobs
from rltool.training.losses import LOSS_AGGREGATIONS
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.updater import PolicyUpdater

VOCAB = 101


def tiny_qwen2() -> torch.nn.Module:
    return random_qwen2(VOCAB).eval()


def grpo_samples() -> list[dict]:
    """Two prompts (5 and 4 tokens) x 3 responses of 2-5 tokens, shifted: prompt[:-1] has no
    target; a sample with an unsupervised token inside its response too."""
    g = torch.Generator().manual_seed(3)
    out = []
    for prompt_len in (5, 4):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        for k in range(3):
            response = torch.randint(1, VOCAB, (2 + k + prompt_len % 2,), generator=g)
            seq = torch.cat([prompt, response])
            targets = torch.cat([torch.full((prompt_len - 1,), -100), response])
            if k == 2:
                targets[-2] = -100  # e.g. a tool output inside the response
            active = targets != -100
            adv = float(k) - 1.0
            out.append(
                {
                    "ids": seq[:-1],
                    "targets": targets,
                    "adv": adv * active.float(),
                    "lp": torch.where(active, -torch.rand(len(targets), generator=g), 0.0),
                }
            )
    return out


def pack_of(samples: list[dict], index: list[int]) -> Pack:
    lens = [len(s["ids"]) for s in samples]
    return Pack(
        input_ids=torch.cat([s["ids"] for s in samples]),
        targets=torch.cat([s["targets"] for s in samples]),
        advantages=torch.cat([s["adv"] for s in samples]).float(),
        rollout_logprobs=torch.cat([s["lp"] for s in samples]).float(),
        has_rollout_logprobs=torch.ones(sum(lens), dtype=torch.bool),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        max_seq_len=max(lens),
        sample_index=index,
    )


def plain_packs() -> list[Pack]:
    s = grpo_samples()  # group members spread over packs, as best-fit packing does
    return [pack_of([s[0], s[3], s[4]], [0, 3, 4]), pack_of([s[1], s[2], s[5]], [1, 2, 5])]


def supervised_logprobs(model, packs: list[Pack]) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for p in packs:
            logp, _ = forward_logprobs(model, p, 1.0, False)
            cu = p.cu_seq_lens.tolist()
            for k, i in enumerate(p.sample_index):
                targets = p.targets[cu[k] : cu[k + 1]]
                out[i] = logp[cu[k] : cu[k + 1]][targets != -100]
    return out


def test_attention_allowed_by_hand() -> None:
    # one tree: prefix of 2, branch 1 of 2, branch 2 of 1; then a lone tree of 2
    tree = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    branch = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],  # branch 2 sees the prefix, not branch 1
            [0, 0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(attention_allowed(tree, branch), expected)


def test_rows_hold_each_prompt_once_and_every_sample() -> None:
    packs = plain_packs()
    shared = share_prefixes(packs).packs
    assert all(isinstance(p, SharedPack) for p in shared)
    for k, p in enumerate(shared):
        check_pack_widths(p, k)
    assert sorted(i for p in shared for i in p.sample_index) == list(range(6))
    # 6 samples carry 3 x 4 + 3 x 3 prompt positions; shared: 4 + 3
    assert sum(len(p) for p in packs) - sum(len(p) for p in shared) == 2 * 4 + 2 * 3
    assert sum(int((p.targets != -100).sum()) for p in shared) == sum(
        int((p.targets != -100).sum()) for p in packs
    )
    assert max(len(p) for p in shared) <= max(len(p) for p in packs)


def test_shared_rows_give_the_logprobs_of_plain_rows() -> None:
    model = tiny_qwen2()
    packs = plain_packs()
    plain = supervised_logprobs(model, packs)
    shared = supervised_logprobs(model, share_prefixes(packs).packs)
    assert plain.keys() == shared.keys()
    for i in plain:
        torch.testing.assert_close(shared[i], plain[i], atol=1e-5, rtol=0)


def test_a_sibling_token_would_change_the_result() -> None:
    """The test above can fail: letting branch 2 see branch 1 changes its logprobs."""
    model = tiny_qwen2()
    row = share_prefixes(plain_packs()).packs[0]
    leaky = copy.copy(row)
    leaky.branch_ids = torch.where(row.branch_ids > 0, 1, 0)  # all branches merged into one
    leaky.merged = None  # the kernel reads the branch ids (a merged row: its own pieces)
    a = supervised_logprobs(model, [row])
    b = supervised_logprobs(model, [leaky])
    assert max(float((a[i] - b[i]).abs().max()) for i in a) > 1e-3


def test_rows_are_bounded_by_max_len() -> None:
    shared = share_prefixes(plain_packs(), max_len=12).packs
    assert max(len(p) for p in shared) <= 12
    assert sorted(i for p in shared for i in p.sample_index) == list(range(6))


def _update(share: bool, loss_agg: str) -> torch.nn.Module:
    model = tiny_qwen2()
    algo = AlgorithmConfig(loss_agg=loss_agg)
    cfg = OptimizerConfig(lr=1e-3)
    opt = build_optimizer(model, cfg)
    updater = PolicyUpdater(model, opt, build_scheduler(opt, cfg, 10), algo, norm_len=8)
    updater.step(share_prefixes(plain_packs()).packs if share else plain_packs())
    return model


@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS.names())
def test_updater_with_shared_prefixes_takes_the_same_step(loss_agg: str) -> None:
    a, b = _update(True, loss_agg), _update(False, loss_agg)
    start = tiny_qwen2()
    moved = max(
        float((p - q).detach().abs().max())
        for p, q in zip(a.parameters(), start.parameters(), strict=True)
    )
    diff = max(
        float((p - q).detach().abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )
    assert moved > 1e-4  # the step did something
    assert diff < 1e-5 * max(moved / 1e-3, 1.0)


def test_packs_with_teacher_targets_do_not_share() -> None:
    packs = plain_packs()
    assert all(shareable(p) for p in packs)
    packs[1].teacher_kind = "sampled"
    assert not shareable(packs[1])
    packs[0].routed_experts = torch.zeros(len(packs[0]), 2, 2, dtype=torch.long)
    assert shareable(packs[0])  # routing shares (test_convert: only equal routing)


def test_placement_worked_by_hand() -> None:
    """Prompt 1 2 3 with responses 7 8 (sample 0) and 9 (sample 1), shifted; the prefix is the
    two leading positions without a target (input 1 2), branches start at input 3."""
    a = {
        "ids": torch.tensor([1, 2, 3, 7]),
        "targets": torch.tensor([-100, -100, 7, 8]),
        "adv": torch.tensor([0.0, 0.0, 1.0, 1.0]),
        "lp": torch.tensor([0.0, 0.0, -0.5, -0.6]),
    }
    b = {
        "ids": torch.tensor([1, 2, 3]),
        "targets": torch.tensor([-100, -100, 9]),
        "adv": torch.tensor([0.0, 0.0, -1.0]),
        "lp": torch.tensor([0.0, 0.0, -0.7]),
    }
    out = share_prefixes([pack_of([a, b], [0, 1])])
    (row,) = out.packs
    assert row.input_ids.tolist() == [1, 2, 3, 7, 3]
    assert row.targets.tolist() == [-100, -100, 7, 8, 9]
    assert row.advantages.tolist() == [0.0, 0.0, 1.0, 1.0, -1.0]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 2]
    assert row.tree_ids.tolist() == [0, 0, 0, 0, 0]
    assert row.branch_ids.tolist() == [0, 0, 1, 1, 2]
    assert row.cu_seq_lens.tolist() == [0, 4, 5]
    assert (row.max_seq_len, row.sample_index) == (4, [0, 1])
    assert out.pack_S.tolist() == [0, 0]
    assert out.start_S.tolist() == [0, 0]  # both read the prefix at 0
    assert out.prefix_S.tolist() == [2, 2]
    assert out.branch_S.tolist() == [2, 4]


def test_placement_gathers_every_sample_back() -> None:
    """[start, start + prefix) ++ [branch, branch + L - prefix) of a shared row is the sample's
    own plain row, field by field, with positions 0 .. L - 1."""
    samples = grpo_samples()
    out = share_prefixes(plain_packs())
    for i, s in enumerate(samples):
        row, length = out.packs[out.pack_S[i]], len(s["ids"])
        start, q, branch = int(out.start_S[i]), int(out.prefix_S[i]), int(out.branch_S[i])
        at = torch.cat([torch.arange(start, start + q), torch.arange(branch, branch + length - q)])
        assert torch.equal(row.input_ids[at], s["ids"])
        assert torch.equal(row.targets[at], s["targets"])
        assert torch.equal(row.rollout_logprobs[at], s["lp"].float())
        assert row.position_ids[at].tolist() == list(range(length))
        assert q == (4 if i < 3 else 3)  # prompt minus its last token
