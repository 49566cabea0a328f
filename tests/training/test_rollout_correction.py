"""Rollout correction with hand-worked values: weights, rejection, OPSM, metrics, and in the
updater a rejected token that leaves the loss but not the counts.

The verl oracle comparison is tests/verl_env/test_verl_rollout_correction.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import random_qwen2

from rltool.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltool.config.correction import CorrectionSpec, Criterion
from rltool.config.schema import OptimizerConfig
from rltool.training import rollout_correction as rc
from rltool.training.batch import Pack
from rltool.training.optim import build_scheduler
from rltool.training.updater import PolicyUpdater

E = math.exp
# one sample of three supervised tokens: log ratios old - rollout = 0.5, -0.5, 0
OLD = torch.tensor([-1.0, -1.0, -2.0])
ROLLOUT = torch.tensor([-1.5, -0.5, -2.0])
ALL = torch.ones(3, dtype=torch.bool)
ONE = torch.tensor([0, 3])


def row(spec: CorrectionSpec, old=OLD, rollout=ROLLOUT, mask=ALL, has=ALL, cu=ONE):
    return rc.correct_row(old, rollout, mask, has, cu, spec)


def test_token_tis_truncates_and_icepop_zeroes_outside_the_bounds() -> None:
    tis = row(CorrectionSpec(weights="token", upper=1.5))
    assert tis.weight.tolist() == pytest.approx([1.5, E(-0.5), 1.0])
    m = rc.mismatch_metrics([tis], CorrectionSpec(weights="token", upper=1.5))
    assert m[rc.CAPPED_FRAC] == pytest.approx(1 / 3)
    assert m[rc.CAPPED_SEQ_FRAC] == 1.0
    assert m[rc.WEIGHT_MAX] == pytest.approx(1.5) and m[rc.WEIGHT_MIN] == pytest.approx(E(-0.5))
    w = torch.tensor([1.5, E(-0.5), 1.0], dtype=torch.float64)
    assert m[rc.WEIGHT_ESS] == pytest.approx(float(w.sum() ** 2 / (3 * (w**2).sum())))
    icepop = row(CorrectionSpec(weights="token", upper=1.5, lower=0.7))
    assert icepop.weight.tolist() == pytest.approx([0.0, 0.0, 1.0])  # e^.5 > 1.5, e^-.5 < .7
    spec = CorrectionSpec(weights="token", upper=1.5, lower=0.7)
    assert rc.mismatch_metrics([icepop], spec)[rc.ZEROED_FRAC] == pytest.approx(2 / 3)


def test_sequence_weights_are_the_product_over_the_sample_and_normalise_per_sample() -> None:
    # two samples: [0.5, -0.5] (product 1) and [0] -> then a third token of ratio e^0.3
    old = torch.tensor([-1.0, -1.0, -2.0, -1.0])
    rollout = torch.tensor([-1.5, -0.5, -2.0, -1.3])
    mask, cu = torch.ones(4, dtype=torch.bool), torch.tensor([0, 2, 4])
    spec = CorrectionSpec(weights="sequence", upper=2.0, batch_normalize=True)
    r = row(spec, old, rollout, mask, mask, cu)
    assert r.weight.tolist() == pytest.approx([1.0, 1.0, E(0.3), E(0.3)])
    # batch normalisation averages the two samples' weights, not the four tokens'
    assert rc.batch_norm_factor([r], "sequence") == pytest.approx((1 + E(0.3)) / 2)
    assert rc.batch_norm_factor([r], "token") == pytest.approx((2 + 2 * E(0.3)) / 4)


def test_rejection_criteria_chain_and_report_each_fraction() -> None:
    # k3(0.5) = 0.1487, k3(-0.5) = 0.1065, k3(0) = 0; k2 = 0.125, 0.125, 0
    spec = CorrectionSpec(
        reject=(Criterion("token_k3", None, 0.12), Criterion("token_k2", None, 0.2))
    )
    r = row(spec)
    assert r.rejected["token_k3"].tolist() == [True, False, False]
    assert r.rejected["token_k2"].tolist() == [False, False, False]
    assert r.keep.tolist() == [False, True, True]
    m = rc.mismatch_metrics([r], spec)
    assert m[rc.rejected_frac_key("token_k3")] == pytest.approx(1 / 3)
    assert m[rc.rejected_seq_frac_key("token_k3")] == 1.0
    assert m[rc.rejected_frac_key("token_k2")] == 0.0
    assert m[rc.REJECTED_FRAC] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("criterion", "kept"),
    [
        # per-sample k1 = -lr: sample A = [-0.5, 0.5], sample B = [-0.3]
        (Criterion("seq_sum_k1", E(-0.1), E(0.1)), [True, True, False]),  # sums 0, -0.3
        (Criterion("seq_mean_k1", E(-0.4), E(0.4)), [True, True, True]),  # means 0, -0.3
        (Criterion("seq_mean_k1", E(-0.2), E(0.2)), [True, True, False]),
        (Criterion("seq_max_k1", E(-0.4), E(0.4)), [False, False, True]),  # A has +-0.5
        (Criterion("seq_max_k2", None, 0.1), [False, False, True]),  # A's max k2 0.125
        (Criterion("seq_sum_k2", None, 0.2), [False, False, True]),  # A: 0.25, B: 0.045
        (Criterion("seq_mean_k3", None, 0.1), [False, False, True]),  # A: 0.1276, B: 0.0408
    ],
)
def test_sample_level_criteria_keep_or_drop_whole_samples(criterion, kept) -> None:
    old = torch.tensor([-1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.5, -0.5, -1.3])
    r = row(CorrectionSpec(reject=(criterion,)), old, rollout, cu=torch.tensor([0, 2, 3]))
    assert r.keep.tolist() == kept


def test_samples_without_logprobs_or_supervision_get_weight_one_and_are_counted() -> None:
    # sample 0: no engine logprobs; sample 1: nothing supervised; sample 2: a real mismatch
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    rollout = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.0, -3.0])
    mask = torch.tensor([True, True, False, False, True, True])
    has = torch.tensor([False, False, True, True, True, True])
    spec = CorrectionSpec(weights="token", upper=5.0, reject=(Criterion("token_k1", 0.5, 2.0),))
    r = row(spec, old, rollout, mask, has, torch.tensor([0, 2, 4, 6]))
    assert r.weight.tolist() == pytest.approx([1, 1, 1, 1, 5, 5])  # e^2 capped at 5
    assert r.keep.tolist() == [True, True, True, True, False, False]
    m = rc.mismatch_metrics([r], spec)
    assert m[rc.SAMPLES_WITHOUT_LOGPROBS] == 1.0
    assert m[rc.TOKENS] == 2.0
    assert m[rc.REJECTED_SEQ_FRAC] == 1.0  # of the one sample with an eligible token


def test_mismatch_figures_by_hand() -> None:
    # sample A: old [-1, -1], rollout [-1.5, -0.5]; sample B: old [-2], rollout [-2.4]
    old = torch.tensor([-1.0, -1.0, -2.0])
    rollout = torch.tensor([-1.5, -0.5, -2.4])
    r = row(CorrectionSpec(), old, rollout, cu=torch.tensor([0, 2, 3]))
    m = rc.mismatch_metrics([r], CorrectionSpec())
    lr = [0.5, -0.5, 0.4]
    assert m[rc.TRAINING_PPL] == pytest.approx((E(1.0) + E(2.0)) / 2)
    assert m[rc.ROLLOUT_PPL] == pytest.approx((E(1.0) + E(2.4)) / 2)
    assert m[rc.LOG_PPL_RATIO] == pytest.approx(((-1.0 + 1.0) + (-2.4 + 2.0)) / 2)
    assert m[rc.KL_K1] == pytest.approx(-sum(lr) / 3)
    assert m[rc.KL_K3] == pytest.approx(sum(E(x) - 1 - x for x in lr) / 3)
    assert m[rc.CHI2_TOKEN] == pytest.approx(sum(E(2 * x) for x in lr) / 3 - 1)
    assert m[rc.CHI2_SEQ] == pytest.approx((E(0.0) + E(0.8)) / 2 - 1)
    assert m[rc.EXP_ABS_DIFF] == pytest.approx((E(0.5) + E(0.5) + E(0.4)) / 3)
    assert m[rc.ABS_DIFF_P50] == pytest.approx(0.5)
    assert m[rc.ABS_DIFF_P99] == pytest.approx(0.5)
    assert m[rc.ABS_DIFF_MAX] == pytest.approx(0.5)
    assert not any(k.startswith("mismatch/is_") for k in m)  # no weights, no weight figures


def test_opsm_drops_negative_advantage_samples_that_drifted() -> None:
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    logp = torch.tensor([-1.2, -1.2, -1.2, -1.2, -1.01, -1.01])  # KL 0.2, 0.2, 0.01
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    eligible = torch.ones(6, dtype=torch.bool)
    keep = rc.opsm_keep(old, logp, adv, eligible, torch.tensor([0, 2, 4, 6]), delta=0.1)
    assert keep.tolist() == [False, False, True, True, True, True]


VOCAB = 101


def pack(samples: list[dict]) -> Pack:
    lens = [len(s["ids"]) for s in samples]
    return Pack(
        input_ids=torch.cat([s["ids"] for s in samples]),
        targets=torch.cat([s["targets"] for s in samples]),
        advantages=torch.cat([s["adv"] for s in samples]).float(),
        rollout_logprobs=torch.cat([s["lp"] for s in samples]),
        has_rollout_logprobs=torch.cat(
            [torch.full((n,), s["has"]) for n, s in zip(lens, samples, strict=True)]
        ),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        cu_seq_lens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        max_seq_len=max(lens),
        sample_index=list(range(len(samples))),
    )


def samples(reject_adv: float) -> list[dict]:
    """Three samples; only the last has engine logprobs, far from any model's (rollout -12)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, adv in enumerate([1.0, -0.5, reject_adv]):
        n = 7 + i
        seq = torch.randint(1, VOCAB, (n + 1,), generator=g)
        targets = torch.cat([torch.full((3,), -100), seq[4:]])
        active = targets != -100
        lp = torch.where(active, torch.full((n,), -12.0), torch.zeros(n))
        out.append({"ids": seq[:-1], "targets": targets, "adv": adv * active, "lp": lp,
                    "has": i == 2})  # fmt: skip
    return out


def step(algo: AlgorithmConfig, packs: list[Pack]) -> tuple[torch.nn.Module, dict[str, float]]:
    model = random_qwen2(VOCAB)
    cfg = OptimizerConfig(lr=1e-2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    updater = PolicyUpdater(model, opt, build_scheduler(opt, cfg, 10), algo)
    return model, updater.step(packs)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_a_rejected_sample_leaves_the_loss_but_stays_in_the_counts(loss_agg: str) -> None:
    """Rejecting sample 3 gives exactly the update of a batch where its advantage is 0:
    no loss from its tokens, the same denominators (aggregation counts it)."""
    reject = RolloutCorrectionConfig(reject=[_rejection("token_k3", upper=1.0)], weights="none")
    rejected, m = step(
        AlgorithmConfig(loss_agg=loss_agg, rollout_correction=reject), [pack(samples(2.0))]
    )
    zeroed, _ = step(AlgorithmConfig(loss_agg=loss_agg, tis_cap=None), [pack(samples(0.0))])
    for p, q in zip(rejected.parameters(), zeroed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert m[rc.REJECTED_FRAC] == 1.0 and m[rc.SAMPLES_WITHOUT_LOGPROBS] == 2.0


def test_tis_cap_is_the_spelling_of_token_tis() -> None:
    packs = [pack(samples(2.0))]
    a, ma = step(AlgorithmConfig(tis_cap=2.0), packs)
    preset = RolloutCorrectionConfig(preset="token_tis")
    b, mb = step(AlgorithmConfig(tis_cap=None, rollout_correction=preset), packs)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ma == mb


def _rejection(criterion: str, lower: float | None = None, upper: float | None = None):
    from rltool.config.algorithm import RejectionConfig

    return RejectionConfig(criterion=criterion, lower=lower, upper=upper)


def test_on_policy_batch_normalisation_takes_the_whole_step_first() -> None:
    algo = AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(weights="token", batch_normalize=True)
    )
    _, m = step(algo, [pack(samples(2.0)[:2]), pack(samples(2.0)[2:])])
    assert m[rc.WEIGHT_MEAN] == pytest.approx(2.0)  # every ratio ~e^10, truncated at 2
    assert m[rc.BATCH_NORM_FACTOR] == pytest.approx(2.0)
    # normalised weights 1 on sample 3's tokens, 1 on the others' (no engine logprobs)
    assert m["actor/tis_weight_mean"] == pytest.approx(1.0)
