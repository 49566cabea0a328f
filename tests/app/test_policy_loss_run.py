"""`rltool train` with a policy loss other than the default, end to end."""

from __future__ import annotations

import json
import math

import pytest
from cli_runner import run_cli
from short_runs import short_gsm8k_args


@pytest.mark.slow
def test_gspo_trains_two_steps(tiny_checkpoint, tmp_path) -> None:
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 2, "algorithm.policy_loss=gspo")
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train] == [1, 2]
    for line in train:  # a random model's rewards may all be 0: no gradient to require
        assert all(math.isfinite(v) for k, v in line.items() if k.startswith("actor/"))
        assert line["actor/ratio_mean"] == pytest.approx(1.0)  # on-policy: the ratio is 1
    config = (tmp_path / "t" / "config.yaml").read_text()
    assert "policy_loss: gspo" in config
