"""``algorithm.policy_loss`` and its settings are checked when the recipe loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli

from rltool.config.algorithm import POLICY_LOSS_NAMES
from rltool.config.loader import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k_tiny.yaml"


def test_an_unknown_policy_loss_names_the_key_and_the_known_names() -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, ["algorithm.policy_loss=nope"])
    known = ", ".join(POLICY_LOSS_NAMES)
    assert str(err.value) == (
        f"recipe {RECIPE}: algorithm.policy_loss = 'nope': must be one of: {known}"
    )


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("algorithm.sapo.tau_neg=0", "algorithm.sapo.tau_neg = 0: must be > 0"),
        ("algorithm.clip_cov.ratio=1.5", "algorithm.clip_cov.ratio = 1.5: must be in (0, 1]"),
        ("algorithm.kl_cov.coef=-1", "algorithm.kl_cov.coef = -1: must be >= 0"),
        ("algorithm.dppo.ratio_cap=0", "algorithm.dppo.ratio_cap = 0: must be > 0"),
    ],
)
def test_loss_settings_are_range_checked(override: str, line: str) -> None:
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPE, [override])
    assert str(err.value) == f"recipe {RECIPE}: {line}"


def test_each_loss_loads_with_its_settings() -> None:
    for name in POLICY_LOSS_NAMES:
        assert load_recipe(RECIPE, [f"algorithm.policy_loss={name}"]).algorithm.policy_loss == name
    cfg = load_recipe(RECIPE, ["algorithm.sapo.tau_pos=2", "algorithm.kl_cov.ratio=0.01"])
    assert (cfg.algorithm.sapo.tau_pos, cfg.algorithm.kl_cov.ratio) == (2.0, 0.01)


def test_train_and_print_config_exit_2_before_the_model_loads(tmp_path: Path) -> None:
    args = ["train", str(RECIPE), "algorithm.policy_loss=nope", f"logging.run_dir={tmp_path}"]
    for extra in ([], ["--print-config"]):
        result = run_cli([*args, *extra])
        assert result.exit_code == 2, result.output
        assert "algorithm.policy_loss = 'nope': must be one of: ppo, gspo" in result.output
    assert list(tmp_path.iterdir()) == []  # no run directory was made
