"""rltool's rollout correction against verl 0.9.1's own
``compute_rollout_correction_and_rejection_mask``: weights, modified mask, metrics.

Runs only where verl is installed (``bash scripts/verl_env.sh``; elsewhere skipped):

    PYTHONPATH=$PWD .venv-verl/bin/python -m pytest tests/verl_env/test_verl_rollout_correction.py

The batch is random: 8 samples in two packed rows, one with no supervised token and one
whose engine returned no logprobs. verl cannot express the latter (it has no per-sample
"no logprobs" flag), so verl sees it as a row with an all-zero response mask; rltool gives
it weight 1, never rejects it, and counts it. verl averages its per-sample figures over every
row, an empty one included (as perplexity 1, chi-squared 0); rltool over the samples that
have an eligible token. Metrics are therefore compared on the batch without those two
samples, weights and masks on the whole batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "verl.trainer.ppo.rollout_corr_helper", reason="verl is not installed (scripts/verl_env.sh)"
)

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from rltool.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rltool.config.correction import PRESETS, CorrectionSpec, Criterion, resolve_correction
from rltool.training import rollout_correction as rc

LENGTHS = [7, 12, 5, 9, 10, 6, 8, 11]
ROWS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # samples of each packed row
EMPTY, NO_LOGPROBS = 2, 5
TOL = {"rel": 1e-5, "abs": 1e-5}


def spec_of(preset: str) -> CorrectionSpec:
    return resolve_correction(
        AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(preset=preset))
    )


CHAINS = {
    "token_k1+seq_mean_k3+seq_max_k2": CorrectionSpec(
        reject=(
            Criterion("token_k1", 0.6, 1.5),
            Criterion("seq_mean_k3", None, 0.05),
            Criterion("seq_max_k2", None, 0.3),
        )
    ),
    "token weights normalised, seq_sum_k2+token_k3+seq_mean_k1": CorrectionSpec(
        weights="token",
        upper=1.5,
        batch_normalize=True,
        reject=(
            Criterion("seq_sum_k2", None, 0.4),
            Criterion("token_k3", None, 0.1),
            Criterion("seq_mean_k1", 0.8, 1.25),
        ),
    ),
    "sequence weights normalised, seq_sum_k3+seq_max_k3+token_k2": CorrectionSpec(
        weights="sequence",
        upper=3.0,
        batch_normalize=True,
        reject=(
            Criterion("seq_sum_k3", None, 0.6),
            Criterion("seq_max_k3", None, 0.2),
            Criterion("token_k2", None, 0.08),
        ),
    ),
    "icepop+seq_mean_k2+seq_sum_k1": CorrectionSpec(
        weights="token",
        upper=1.6,
        lower=0.7,
        reject=(Criterion("seq_mean_k2", None, 0.05), Criterion("seq_sum_k1", 0.3, 4.0)),
    ),
}
SPECS = {**{p: spec_of(p) for p in PRESETS}, **CHAINS}


def random_batch(seed: int, scale: float) -> dict:
    """Per sample: a few unsupervised leading positions (a hole in one), trainer logprobs
    everywhere, engine logprobs = trainer's minus noise of ``scale`` where supervised."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for b, n in enumerate(LENGTHS):
        mask = torch.ones(n, dtype=torch.bool)
        mask[: 1 + b % 3] = False
        if b == 3:
            mask[n - 3] = False  # an environment token inside the response
        if b == EMPTY:
            mask[:] = False
        old = -2.0 * torch.rand(n, generator=g) - 0.05
        noise = scale * torch.randn(n, generator=g)
        rollout = torch.where(mask, old - noise, torch.zeros(n))
        has = torch.full((n,), b != NO_LOGPROBS)
        if b == NO_LOGPROBS:
            rollout = torch.zeros(n)
        samples.append({"mask": mask, "old": old, "rollout": rollout, "has": has})
    return {"samples": samples}


def rltool_side(batch: dict, spec: CorrectionSpec):
    """Per-row corrections (as the updater builds them), the factor and the metrics."""
    rows = []
    for members in ROWS:
        parts = [batch["samples"][b] for b in members]
        cat = {k: torch.cat([p[k] for p in parts]) for k in ("mask", "old", "rollout", "has")}
        cu = torch.tensor([0, *torch.cumsum(torch.tensor([LENGTHS[b] for b in members]), 0)])
        rows.append(rc.correct_row(cat["old"], cat["rollout"], cat["mask"], cat["has"], cu, spec))
    factor = rc.batch_norm_factor(rows, spec.weights) if spec.batch_normalize else 1.0
    return rows, factor, rc.mismatch_metrics(rows, spec, factor)


def verl_side(batch: dict, spec: CorrectionSpec, keep: list[int]):
    samples = [batch["samples"][b] for b in keep]
    t = max(LENGTHS)

    def padded(key: str) -> torch.Tensor:
        out = torch.zeros(len(samples), t)
        for i, s in enumerate(samples):
            v = s[key] if key != "mask" else (s["mask"] & s["has"])
            out[i, : len(v)] = v.float()
        return out

    threshold = spec.upper if spec.lower is None else f"{spec.lower}_{spec.upper}"
    rs = ",".join(c.name for c in spec.reject) or None
    rs_threshold = ",".join(
        f"{c.lower}_{c.upper}" if c.two_sided else f"{c.upper}" for c in spec.reject
    )
    weights, modified, metrics = compute_rollout_correction_and_rejection_mask(
        padded("old"),
        padded("rollout"),
        padded("mask"),
        rollout_is=spec.weights,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=spec.batch_normalize,
        rollout_rs=rs,
        rollout_rs_threshold=rs_threshold or None,
    )
    w = weights.batch["rollout_is_weights"] if weights is not None else None
    return w, modified, {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}


def metric_pairs(spec: CorrectionSpec) -> dict[str, str]:
    """rltool metric -> verl metric, for every figure both compute."""
    pairs = {
        rc.TRAINING_PPL: "training_ppl",
        rc.ROLLOUT_PPL: "rollout_ppl",
        rc.LOG_PPL_RATIO: "log_ppl_diff",
        rc.KL_K1: "kl",
        rc.KL_K3: "k3_kl",
        rc.CHI2_TOKEN: "chi2_token",
        rc.CHI2_SEQ: "chi2_seq",
    }
    if spec.weights is not None:
        pairs |= {rc.WEIGHT_MEAN: "rollout_is_mean", rc.WEIGHT_ESS: "rollout_is_eff_sample_size"}
        if spec.weights == "token":  # verl's sequence-level max/min are the raw ratios
            pairs |= {rc.WEIGHT_MAX: "rollout_is_max", rc.WEIGHT_MIN: "rollout_is_min"}
            pairs[rc.CAPPED_FRAC] = "rollout_is_ratio_fraction_high"
        else:
            pairs[rc.CAPPED_SEQ_FRAC] = "rollout_is_ratio_fraction_high"
        if spec.lower is not None:
            pairs[rc.ZEROED_FRAC] = "rollout_is_oob_ratio"
        if spec.batch_normalize:
            pairs[rc.BATCH_NORM_FACTOR] = "rollout_is_batch_norm_factor"
    if spec.reject:
        pairs |= {
            rc.REJECTED_FRAC: "rollout_rs_masked_fraction",
            rc.REJECTED_SEQ_FRAC: "rollout_rs_seq_masked_fraction",
        }
        for c in spec.reject:
            pairs[rc.rejected_frac_key(c.name)] = f"rollout_rs_{c.name}_masked_fraction"
            pairs[rc.rejected_seq_frac_key(c.name)] = f"rollout_rs_{c.name}_seq_masked_fraction"
    return pairs


@pytest.mark.parametrize("scale", [0.3, 0.002])
@pytest.mark.parametrize("name", list(SPECS))
def test_weights_mask_and_metrics_match_verl(name: str, scale: float) -> None:
    spec = SPECS[name]
    batch = random_batch(seed=7, scale=scale)
    rows, factor, ours = rltool_side(batch, spec)

    # weights and modified mask: the whole batch, verl seeing the two special samples as
    # all-zero mask rows
    w_verl, mask_verl, _ = verl_side(batch, spec, keep=list(range(len(LENGTHS))))
    for r, members in zip(rows, ROWS, strict=True):
        start = 0
        for b in members:
            n, s = LENGTHS[b], batch["samples"][b]
            span = slice(start, start + n)
            eligible = s["mask"] & s["has"]
            weight = r.weight[span] / factor if spec.weights else torch.ones(n)
            keep = r.keep[span]
            if spec.weights is not None:
                torch.testing.assert_close(weight[eligible], w_verl[b, :n][eligible], **_tol())
            assert keep[eligible].tolist() == mask_verl[b, :n][eligible].bool().tolist()
            if b in (EMPTY, NO_LOGPROBS):  # weight 1, never rejected
                assert torch.equal(r.weight[span], torch.ones(n))
                assert bool(keep.all())
            start += n
    assert ours[rc.SAMPLES_WITHOUT_LOGPROBS] == 1.0

    # metrics: the samples with an eligible token
    _, _, theirs = verl_side(batch, spec, keep=[b for b in range(8) if b not in (2, 5)])
    pairs = metric_pairs(spec)
    compared = {k: ours[k] for k in pairs}
    expected = {k: theirs[v] for k, v in pairs.items()}
    assert compared == pytest.approx(expected, **TOL)


def _tol() -> dict[str, float]:
    return {"rtol": TOL["rel"], "atol": TOL["abs"]}


def test_presets_mean_what_verls_factories_set() -> None:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig as Verl

    factories = {
        "token_tis": Verl.decoupled_token_is(),
        "seq_tis": Verl.decoupled_seq_is(),
        "seq_mis": Verl.decoupled_seq_is_rs(),
        "geo_rs": Verl.decoupled_geo_rs(),
        "k3_rs": Verl.decoupled_k3_rs(),
        "icepop": Verl.decoupled_token_icepop(),
    }
    assert set(factories) == set(PRESETS)
    for name, verl_cfg in factories.items():
        spec = spec_of(name)
        threshold = spec.upper if spec.lower is None else f"{spec.lower}_{spec.upper}"
        assert spec.weights == verl_cfg.rollout_is, name
        if spec.weights is not None:
            assert str(threshold) == str(verl_cfg.rollout_is_threshold), name
        assert (",".join(c.name for c in spec.reject) or None) == verl_cfg.rollout_rs, name
        rs = ",".join(f"{c.lower}_{c.upper}" if c.two_sided else f"{c.upper}" for c in spec.reject)
        assert (rs or None) == (
            None if verl_cfg.rollout_rs_threshold is None else str(verl_cfg.rollout_rs_threshold)
        ), name
        assert not verl_cfg.rollout_is_batch_normalize and not verl_cfg.bypass_mode
