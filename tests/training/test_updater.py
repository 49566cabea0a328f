"""One policy update on a tiny Qwen2: direction, no-op, layout invariance, metrics.

The updater trains on the packs it is given, plain or shared-prefix rows; the
tests that step it run on both layouts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from tiny_models import random_qwen2

from rltool.config.schema import AlgorithmConfig, OptimizerConfig
from rltool.rollout.state import RolloutState
from rltool.training.batch import Pack, SharedPack
from rltool.training.convert import ConversionConfig, convert_groups
from rltool.training.layout.shared_prefix import share_prefixes
from rltool.training.logprobs import forward_logprobs
from rltool.training.losses import LOSS_AGGREGATIONS
from rltool.training.optim import build_optimizer, build_scheduler
from rltool.training.updater import PolicyUpdater, split_mini_batches

VOCAB = 101
LAYOUTS = ("plain", "shared")
METRIC_KEYS = {
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/clip_frac",
    "actor/ratio_mean",
    "actor/tis_weight_mean",
    "actor/rollout_kl",
    "actor/grad_norm",
    "actor/lr",
    "actor/approx_kl_old",
    "actor/skipped_steps",
    "actor/optimizer_steps",
}


def tiny_qwen2() -> torch.nn.Module:
    return random_qwen2(VOCAB)


def make_samples(advantages: list[float], seed: int = 1) -> list[dict]:
    """Shifted samples: model input, targets (prompt of 3 unsupervised), advantage, rollout lp."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, adv in enumerate(advantages):
        n = 6 + 2 * i
        seq = torch.randint(1, VOCAB, (n + 1,), generator=g)
        targets = torch.cat([torch.full((2,), -100), seq[3:]])
        active = targets != -100
        rollout = torch.where(active, -torch.rand(n, generator=g) - 1.0, torch.zeros(n))
        out.append({"ids": seq[:-1], "targets": targets, "adv": adv * active, "lp": rollout})
    return out


def pack_of(samples: list[dict], index: list[int], has_lp: list[bool] | None = None) -> Pack:
    lens = [len(s["ids"]) for s in samples]
    has = [True] * len(samples) if has_lp is None else has_lp
    return Pack(
        input_ids=torch.cat([s["ids"] for s in samples]),
        targets=torch.cat([s["targets"] for s in samples]),
        advantages=torch.cat([s["adv"] for s in samples]).float(),
        rollout_logprobs=torch.cat([s["lp"] for s in samples]),
        has_rollout_logprobs=torch.repeat_interleave(torch.tensor(has), torch.tensor(lens)),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        max_seq_len=max(lens),
        sample_index=index,
    )


def laid_out(packs: list[Pack], layout: str) -> list[Pack]:
    """The packs as given (plain rows) or regrouped into shared-prefix rows."""
    return packs if layout == "plain" else list(share_prefixes(packs).packs)


def updater_for(model, algo: AlgorithmConfig, lr: float = 1e-3, sgd: bool = False, **kw):
    cfg = OptimizerConfig(lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr) if sgd else build_optimizer(model, cfg)
    return PolicyUpdater(model, opt, build_scheduler(opt, cfg, 10), algo, **kw)


def sample_logprob(model, sample: dict) -> float:
    with torch.no_grad():
        return float(forward_logprobs(model, pack_of([sample], [0]), 1.0, False)[0].sum())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_positive_advantage_raises_that_samples_logprob(layout: str) -> None:
    model = tiny_qwen2()
    samples = make_samples([1.0, -1.0])
    before = [sample_logprob(model, s) for s in samples]
    updater = updater_for(model, AlgorithmConfig(), grad_clip=1.0)
    metrics = updater.step(laid_out([pack_of(samples, [0, 1])], layout))
    after = [sample_logprob(model, s) for s in samples]
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy
    assert metrics["actor/clip_frac"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_advantage_without_kl_or_entropy_moves_nothing(layout: str) -> None:
    model = tiny_qwen2()
    before = copy.deepcopy(model.state_dict())
    updater = updater_for(model, AlgorithmConfig(ppo_epochs=2), lr=1e-2, grad_clip=1.0)
    packs = laid_out([pack_of(make_samples([0.0, 0.0, 0.0]), [0, 1, 2])], layout)
    metrics = updater.step(packs)
    assert metrics["actor/pg_loss"] == 0.0
    assert metrics["actor/grad_norm"] == 0.0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    with torch.no_grad():
        pairs = zip(a.parameters(), b.parameters(), strict=True)
        return max(float((p - q).abs().max()) for p, q in pairs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS.names())
def test_one_row_or_two_rows_give_the_same_update(loss_agg: str, layout: str) -> None:
    """Micro-batch accumulation is exact: the packing layout does not change the step."""
    samples = make_samples([1.5, -0.5, 0.7])
    algo = AlgorithmConfig(loss_agg=loss_agg, tis_cap=2.0)
    models = []
    for rows in ([[0, 1, 2]], [[0, 2], [1]]):
        model = tiny_qwen2()
        packs = laid_out([pack_of([samples[i] for i in row], row) for row in rows], layout)
        updater_for(model, algo, lr=0.5, sgd=True, grad_clip=None, norm_len=12).step(packs)
        models.append(model)
    initial = tiny_qwen2()
    moved = _max_abs_diff(models[0], initial)
    diff = _max_abs_diff(models[0], models[1])
    assert moved > 1e-3
    assert diff < 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_algorithm_metrics_present_finite_and_schedule_counts_train_steps(
    layout: str,
) -> None:
    model = tiny_qwen2()
    ref = copy.deepcopy(model).requires_grad_(False)
    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, ppo_epochs=2, mini_batches=2)
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    packs = [pack_of(samples[:2], [0, 1]), pack_of(samples[2:3], [2]), pack_of(samples[3:], [3])]
    packs = laid_out(packs, layout)
    updater = updater_for(model, algo, lr=1e-2, grad_clip=1.0, ref_model=ref, temperature=0.8)
    metrics = updater.step(packs)
    assert {k for k in metrics if not k.startswith("mismatch/")} == METRIC_KEYS
    assert {"mismatch/kl_k1", "mismatch/is_weight_mean", "mismatch/abs_diff_p99"} <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/optimizer_steps"] == 4.0  # 2 epochs x 2 mini-batches
    assert metrics["actor/kl"] > 0  # the policy left the reference after the first step
    assert metrics["actor/approx_kl_old"] > 0
    assert metrics["actor/entropy"] > 0
    assert 0 < metrics["actor/tis_weight_mean"] <= 2.0
    assert metrics["actor/rollout_kl"] > 0  # the fake engine logprobs differ from the model's
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert updater.scheduler.last_epoch == 1  # one scheduler step per train step


def test_model_mode_is_restored() -> None:
    model = tiny_qwen2().train()
    updater_for(model, AlgorithmConfig(), grad_clip=1.0).step([pack_of(make_samples([1.0]), [0])])
    assert model.training


def test_engine_logprobs_are_what_the_pack_says_not_a_guess_from_zeros() -> None:
    """Sample 1's rollout logprobs are all 0.0. Flagged without engine logprobs it leaves
    rollout_kl to sample 0 alone; flagged with them (an engine certain of every token) it
    counts, and k3(old, 0) > 0 moves the figure."""
    samples = make_samples([1.0, 1.0])
    samples[1]["lp"] = torch.zeros_like(samples[1]["lp"])

    def rollout_kl(packs: list[Pack]) -> float:
        updater = updater_for(tiny_qwen2(), AlgorithmConfig(tis_cap=2.0), grad_clip=1.0)
        return updater.step(packs)["actor/rollout_kl"]

    alone = rollout_kl([pack_of(samples[:1], [0])])
    without = rollout_kl([pack_of(samples, [0, 1], has_lp=[True, False])])
    with_them = rollout_kl([pack_of(samples, [0, 1], has_lp=[True, True])])
    assert without == pytest.approx(alone, rel=1e-5)
    assert with_them > without + 0.1


def test_split_mini_batches_balances_tokens() -> None:
    # largest first to the lightest group: 5->g0, 4->g1, 3->g1, 3->g0, 1->g1
    assert split_mini_batches([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]
    assert split_mini_batches([3], 2) == [[0]]


def test_config_errors_name_the_field() -> None:
    model = tiny_qwen2()
    with pytest.raises(ValueError, match="ref_model"):
        updater_for(model, AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="norm_len"):
        updater_for(model, AlgorithmConfig(loss_agg="seq-mean-token-sum-norm"))


# ---------------------------------------------------------------- converted batches


def grpo_groups() -> list[list[RolloutState]]:
    """Two prompts (5 and 4 tokens) x 3 responses of 3-6 tokens, one tool token masked in
    each third response; r10 comes without engine logprobs."""
    g = torch.Generator().manual_seed(7)
    groups = []
    for gi, plen in enumerate((5, 4)):
        prompt = torch.randint(1, VOCAB, (plen,), generator=g).tolist()
        group = []
        for k in range(3):
            response = torch.randint(1, VOCAB, (3 + k + gi,), generator=g).tolist()
            supervised = [not (k == 2 and j == 1) for j in range(len(response))]
            kept = zip(response, supervised, strict=True)
            labels = [-100] * plen + [t if m else -100 for t, m in kept]
            lps = None
            if (gi, k) != (1, 0):
                rand = [-float(torch.rand(1, generator=g)) - 0.2 if m else 0.0 for m in supervised]
                lps = [0.0] * plen + rand
            sample = RolloutState(
                rollout_id=f"r{gi}{k}", group_id=f"g{gi}", prompt_ids=prompt,
                response_ids=response, input_ids=prompt + response, labels=labels,
                logprobs=lps, reward={"score": float(k == gi)}, status="COMPLETED",
            )  # fmt: skip
            group.append(sample)
        groups.append(group)
    return groups


def converted_step(prefix_sharing: bool) -> tuple[list[Pack], dict[str, float], float]:
    """(packs, metrics, summed |weight change|) of one step on the converted grpo_groups."""
    model = tiny_qwen2()
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model).requires_grad_(False)
    cfg = ConversionConfig(pack_max_length=16, prefix_sharing=prefix_sharing)
    packs = convert_groups(grpo_groups(), cfg).packs
    algo = AlgorithmConfig(tis_cap=2.0, ppo_epochs=2, kl_coef=0.05, entropy_coef=0.01)
    updater = updater_for(model, algo, lr=1e-2, grad_clip=1.0, ref_model=ref)
    metrics = updater.step(packs)
    with torch.no_grad():
        pairs = zip(model.parameters(), start.parameters(), strict=True)
        moved = sum(float((p.double() - q.double()).abs().sum()) for p, q in pairs)
    return packs, metrics, moved


# What main (c0decb7) produced on this batch, when the updater regrouped conversion's plain rows
# itself: the shared-prefix layout of conversion must keep training numerically identical.
MAIN_SHARED_STEP = {
    "actor/approx_kl_old": 0.09459855079650879,
    "actor/clip_frac": 0.36,
    "actor/entropy": 4.595192260742188,
    "actor/grad_norm": 0.4190559983253479,
    "actor/kl": 0.09459855079650879,
    "actor/lr": 0.01,
    "actor/optimizer_steps": 2.0,
    "actor/pg_loss": 0.0814114585518837,
    "actor/ratio_mean": 0.9275283813476562,
    "actor/rollout_kl": 46.27236793154762,
    "actor/skipped_steps": 0.0,
    "actor/tis_weight_mean": 0.17858036041259764,
}
MAIN_SHARED_MOVED = 1320.8046854330312


def actor(metrics: dict[str, float]) -> dict[str, float]:
    """The updater's own figures; the rollout correction's mismatch/* ride along."""
    return {k: v for k, v in metrics.items() if k.startswith("actor/")}


def test_conversions_shared_rows_take_the_step_main_took() -> None:
    packs, metrics, moved = converted_step(prefix_sharing=True)
    assert [type(p) for p in packs] == [SharedPack] * 3
    assert [len(p) for p in packs] == [16, 13, 8]  # plain rows: 3 x 16
    assert actor(metrics) == pytest.approx(MAIN_SHARED_STEP, rel=1e-5, abs=1e-7)
    assert moved == pytest.approx(MAIN_SHARED_MOVED, rel=1e-5)


def test_conversions_plain_rows_take_the_same_step() -> None:
    """Prefix sharing off: plain rows, the same update up to float rounding."""
    packs, metrics, moved = converted_step(prefix_sharing=False)
    assert [type(p) for p in packs] == [Pack] * 3
    assert [len(p) for p in packs] == [16, 16, 16]
    assert actor(metrics) == pytest.approx(MAIN_SHARED_STEP, rel=1e-5, abs=1e-6)
    assert moved == pytest.approx(MAIN_SHARED_MOVED, rel=1e-5)


def test_rows_laid_out_for_a_kernel_the_model_cannot_run_are_refused() -> None:
    model = tiny_qwen2()  # on the CPU, where flex_attention has no backward
    packs = share_prefixes([pack_of(make_samples([1.0]), [0])], attention="flex-block").packs
    with pytest.raises(ValueError, match=r"'flex-block'.*trainer\.prefix_sharing"):
        updater_for(model, AlgorithmConfig(), grad_clip=1.0).step(packs)
