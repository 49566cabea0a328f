"""`rltool train` with a rollout-correction preset: the run trains and logs mismatch/* each
step; a threshold of the wrong form stops it before the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import GSM8K_TINY, short_gsm8k_args

from rltool.training import rollout_correction as rc


@pytest.mark.slow
def test_seq_mis_trains_and_logs_mismatch_every_step(tiny_checkpoint, tmp_path: Path) -> None:
    args = short_gsm8k_args(
        tiny_checkpoint, tmp_path, 2, "algorithm.rollout_correction=seq_mis", "-q"
    )
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert len(train) == 2
    for line in train:
        # the HF engine samples with the trainer's own weights: no mismatch, nothing rejected
        assert line[rc.KL_K3] == pytest.approx(0.0, abs=1e-6)
        assert line[rc.rejected_frac_key("seq_sum_k1")] == 0.0
        assert line[rc.WEIGHT_MEAN] == pytest.approx(1.0, abs=1e-5)
        assert line[rc.TOKENS] > 0


def test_a_threshold_of_the_wrong_form_exits_2_before_loading(tmp_path: Path) -> None:
    bad = "algorithm.rollout_correction.reject=[{criterion: seq_mean_k1, upper: 1.01}]"
    result = run_cli(["train", GSM8K_TINY, bad, "model.path=/nonexistent", "--print-config"])
    assert result.exit_code == 2
    assert "algorithm.rollout_correction.reject[0]: seq_mean_k1" in result.output
    assert "set lower and upper" in result.output
