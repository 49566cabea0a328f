"""Each rltool policy loss against verl 0.9.1's own (``core_algos.get_policy_loss_fn``).

Runs only where verl is installed (scripts/verl_env.sh); elsewhere the module is skipped.

A random [B, T] batch (verl's layout: one response a row, ``response_mask`` with a hole
for a tool token, one row with no trained token at all) is laid out as rltool trains it:
each sample a segment of one packed row (a few untrained prompt positions first, its
response after), padding at the end, ``cu_seq_lens`` at the boundaries. Both compute the
aggregated loss from the same logprobs, advantages and IS weights; the value and the
gradient with respect to the current logprobs agree to 1e-5, for every loss and every
aggregation mode that both support, in one micro-batch (verl counts tokens and samples
itself) and in two (verl's ``global_batch_info`` carrying the global counts, rltool's
``aggregate`` the same counts).

Where verl fixes the aggregation: ``sapo`` always aggregates ``seq-mean-token-mean``;
``geo_mean`` takes ``torch.mean`` over the batch's rows, which counts a row without a
trained token (rltool's aggregation counts only samples with one, in every mode): it is
compared with rltool's ``seq-mean-token-mean`` given the row count, in one micro-batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from rltool.config.algorithm import POLICY_LOSS_NAMES, AlgorithmConfig
from rltool.training.losses import LOSS_AGGREGATIONS, aggregate, count_tokens_and_seqs
from rltool.training.policy_losses import LossInputs, build_policy_loss

VERL_NAME = {name: name for name in POLICY_LOSS_NAMES} | {"ppo": "vanilla"}
B, T, NORM_LEN = 8, 9, 16
EMPTY_ROW = 2  # the sample with no trained token
FORCED_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _pairs(split: bool) -> list[tuple[str, str]]:
    return [
        (name, mode)
        for name in POLICY_LOSS_NAMES
        for mode in LOSS_AGGREGATIONS.names()
        if FORCED_MODE.get(name, mode) == mode and not (split and name == "geo_mean")
    ]


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)  # [B] response tokens a row
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    mask[0, 1] = False  # a tool token inside a response
    mask[EMPTY_ROW] = False
    old = -torch.rand(B, T, generator=g) * 2.0 - 0.05  # [B, T]
    # token ratios ~ e^(+-1) and a shift per sample, so that sample-level clips act too
    logp = old + 0.5 * torch.randn(B, T, generator=g) + 0.3 * torch.randn(B, 1, generator=g)
    logp = logp.clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask  # one advantage a sample
    weights = torch.rand(B, T, generator=g) + 0.5  # a rollout correction's IS weights
    prompt = torch.randint(1, 4, (B,), generator=g)  # untrained positions before each
    return {
        "lengths": lengths, "mask": mask, "old": old, "logp": logp, "adv": adv.contiguous(),
        "w": weights, "prompt": prompt,
    }  # fmt: skip


def _verl_config(name: str, mode: str, global_info: dict) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
        clip_ratio_c=3.0, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        use_dynamic_bsz=False, tau_pos=1.0, tau_neg=1.05,
        policy_loss=PolicyLossConfig(
            loss_mode=VERL_NAME[name], clip_cov_ratio=0.2, clip_cov_lb=0.02, clip_cov_ub=5.0,
            kl_cov_ratio=0.2, ppo_kl_coef=0.5,
        ),
        global_batch_info={"loss_scale_factor": NORM_LEN, **global_info},
    )  # fmt: skip


def _algo(name: str, mode: str) -> AlgorithmConfig:
    algo = AlgorithmConfig(
        policy_loss=name, loss_agg=mode, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    algo.dppo.ratio_cap = 3.0  # verl's DPPO truncates at clip_ratio_c
    algo.clip_cov.ratio, algo.clip_cov.low, algo.clip_cov.high = 0.2, 0.02, 5.0
    algo.kl_cov.ratio, algo.kl_cov.coef = 0.2, 0.5
    return algo


def _packed_row(batch: dict, rows: list[int], logp: torch.Tensor) -> LossInputs:
    """The rows of the [B, T] batch as one packed row; ``logp`` [B, T] keeps its graph."""
    pieces: dict[str, list[torch.Tensor]] = {k: [] for k in ("logp", "old", "adv", "mask", "w")}
    cu = [0]
    for b in rows:
        n, p = int(batch["lengths"][b]), int(batch["prompt"][b])
        prompt = {
            "logp": torch.full((p,), -0.7), "old": torch.full((p,), -0.9),
            "adv": torch.zeros(p), "mask": torch.zeros(p, dtype=torch.bool),
            "w": torch.ones(p),
        }  # fmt: skip
        row = {"logp": logp[b], "old": batch["old"][b], "adv": batch["adv"][b]}
        row |= {"mask": batch["mask"][b], "w": batch["w"][b]}
        for key in pieces:
            pieces[key] += [prompt[key], row[key][:n]]
        cu.append(cu[-1] + p + n)
    pad = 3  # positions after the last sample
    pieces["logp"].append(torch.full((pad,), -0.5))
    pieces["old"].append(torch.full((pad,), -0.5))
    pieces["adv"].append(torch.zeros(pad))
    pieces["mask"].append(torch.zeros(pad, dtype=torch.bool))
    pieces["w"].append(torch.ones(pad))
    cat = {k: torch.cat(v) for k, v in pieces.items()}
    return LossInputs(
        cat["logp"], cat["old"], cat["adv"], cat["mask"], torch.tensor(cu, dtype=torch.int32),
        cat["w"],
    )  # fmt: skip


def _both(name: str, mode: str, micro_batches: list[list[int]], seed: int):
    """(verl's loss, its gradient [B, T], rltool's loss, its gradient [B, T])."""
    batch = _batch(seed)
    mask = batch["mask"]
    tokens = int(mask.sum())
    seqs = int((mask.sum(1) > 0).sum())
    split = len(micro_batches) > 1
    verl_logp = batch["logp"].clone().requires_grad_()
    ours_logp = batch["logp"].clone().requires_grad_()
    verl_loss = ours_loss = torch.zeros(())
    for k, rows in enumerate(micro_batches):
        info = {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": seqs}
        config = _verl_config(name, mode, info if split else {})
        idx = torch.tensor(rows)
        torch.manual_seed(100 + k)  # clip_cov draws its tokens from torch's generator
        loss, _ = get_policy_loss_fn(VERL_NAME[name])(
            batch["old"][idx], verl_logp[idx], batch["adv"][idx], mask[idx].float(),
            mode, config=config, rollout_is_weights=batch["w"][idx],
        )  # fmt: skip
        verl_loss = verl_loss + loss
        x = _packed_row(batch, rows, ours_logp)
        if split:
            n_tokens, n_seqs = tokens, seqs
        else:
            n_tokens, n_seqs = count_tokens_and_seqs(x.mask, x.cu_seq_lens)
        if name == "geo_mean":
            n_seqs = len(rows)  # verl's torch.mean counts every row
        torch.manual_seed(100 + k)
        out = build_policy_loss(_algo(name, mode))(x)
        ours_loss = ours_loss + aggregate(
            out.pg, x.mask, x.cu_seq_lens, mode, n_tokens, n_seqs, NORM_LEN
        )
    verl_loss.backward()
    ours_loss.backward()
    return verl_loss.detach(), verl_logp.grad, ours_loss.detach(), ours_logp.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "mode"), _pairs(split=False))
def test_one_micro_batch_matches_verl(name: str, mode: str, seed: int) -> None:
    verl_loss, verl_grad, loss, grad = _both(name, mode, [list(range(B))], seed)
    assert float(verl_grad.abs().max()) > 0  # the batch trains something
    torch.testing.assert_close(loss, verl_loss, **TOL)
    torch.testing.assert_close(grad, verl_grad, **TOL)


@pytest.mark.parametrize(("name", "mode"), _pairs(split=True))
def test_two_micro_batches_with_global_counts_match_verl(name: str, mode: str) -> None:
    verl_loss, verl_grad, loss, grad = _both(name, mode, [[0, 1, 2, 3], [4, 5, 6, 7]], seed=5)
    torch.testing.assert_close(loss, verl_loss, **TOL)
    torch.testing.assert_close(grad, verl_grad, **TOL)


def test_every_loss_is_compared() -> None:
    assert {name for name, _ in _pairs(split=False)} == set(POLICY_LOSS_NAMES)
