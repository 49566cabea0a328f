"""``algorithm.rollout_correction``: presets, tis_cap, the shorthand, and errors that name the
key and the known values when a recipe loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from rltool.config.algorithm import AlgorithmConfig, RejectionConfig, RolloutCorrectionConfig
from rltool.config.correction import PRESETS, CorrectionSpec, Criterion, resolve_correction
from rltool.config.loader import load_recipe

RECIPE = Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml"


def spec(tis_cap: float | None = 2.0, **kw) -> CorrectionSpec:
    cfg = RolloutCorrectionConfig(**kw)
    return resolve_correction(AlgorithmConfig(tis_cap=tis_cap, rollout_correction=cfg))


def test_tis_cap_alone_is_token_tis_and_null_is_off() -> None:
    assert spec(3.0) == CorrectionSpec(weights="token", upper=3.0)
    assert spec(None) == CorrectionSpec()
    assert not spec(None).active


def test_presets_replace_tis_cap_and_keys_override_the_preset() -> None:
    assert spec(preset="seq_mis") == CorrectionSpec(
        weights="sequence", upper=2.0, reject=(Criterion("seq_sum_k1", 0.5, 2.0),)
    )
    assert spec(preset="geo_rs") == CorrectionSpec(reject=(Criterion("seq_mean_k1", 0.999, 1.001),))
    assert spec(preset="icepop") == CorrectionSpec(weights="token", upper=5.0, lower=0.5)
    assert spec(preset="seq_mis", weight_upper=4.0, weights="token").weights == "token"
    assert spec(preset="seq_mis", weight_upper=4.0).upper == 4.0
    assert spec(preset="seq_mis", weights="none").weights is None
    own = [RejectionConfig("token_k3", None, 0.1)]
    assert spec(preset="seq_mis", reject=own).reject == (Criterion("token_k3", None, 0.1),)
    # rejection alone (no preset) replaces tis_cap too: no weights
    assert spec(2.0, reject=own) == CorrectionSpec(reject=(Criterion("token_k3", None, 0.1),))
    assert set(PRESETS) == {"token_tis", "seq_tis", "seq_mis", "geo_rs", "k3_rs", "icepop"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.rollout_correction=nope",
            "algorithm.rollout_correction.preset = 'nope': must be one of: '', token_tis, "
            "seq_tis, seq_mis, geo_rs, k3_rs, icepop",
        ),
        (
            "algorithm.rollout_correction.weights=tokens",
            "algorithm.rollout_correction.weights = 'tokens': must be one of: '', none, token, "
            "sequence",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: seq_mean_k1, upper: 1.01}]",
            "reject[0]: seq_mean_k1 bounds the ratio old/rollout on both sides: set lower",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: token_k1, lower: 2, upper: 1.5}]",
            "reject[0]: lower 2.0 is above upper 1.5",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: seq_max_k3, lower: 0.1, upper: 1}]",
            "reject[0]: seq_max_k3 is a divergence (>= 0) with an upper bound only; remove lower",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: token_k2}]",
            "reject[0]: token_k2 needs upper",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: seq_men_k1, lower: 1, upper: 2}]",
            "reject[0].criterion = 'seq_men_k1': must be one of: token_k1, token_k2, token_k3, "
            "seq_sum_k1",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: token_k3, upper: 1}, "
            "{criterion: token_k3, upper: 2}]",
            "reject[1].criterion: token_k3 is listed twice",
        ),
        (
            "algorithm.rollout_correction={preset: icepop, weight_lower: 6}",
            "weight_lower 6.0 is above the weight upper bound 5.0",
        ),
        (
            "algorithm.rollout_correction={preset: geo_rs, batch_normalize: true}",
            "batch_normalize: no weights to normalise",
        ),
        (
            "algorithm.rollout_correction.reject=[{criterion: token_k3, upper: -1}]",
            "algorithm.rollout_correction.reject[0].upper = -1: must be > 0 or null",
        ),
    ],
)
def test_bad_settings_name_the_key_at_load(override: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, [override])
    assert message in str(err.value)


def test_the_shorthand_and_a_chained_mapping_load() -> None:
    cfg = load_recipe(RECIPE, ["algorithm.rollout_correction=k3_rs"])
    assert cfg.algorithm.rollout_correction.preset == "k3_rs"
    chain = (
        "algorithm.rollout_correction={weights: sequence, weight_upper: 3, reject: "
        "[{criterion: seq_mean_k1, lower: 0.99, upper: 1.01}, {criterion: token_k3, upper: 0.1}]}"
    )
    got = resolve_correction(load_recipe(RECIPE, [chain]).algorithm)
    assert got == CorrectionSpec(
        weights="sequence",
        upper=3.0,
        reject=(Criterion("seq_mean_k1", 0.99, 1.01), Criterion("token_k3", None, 0.1)),
    )
