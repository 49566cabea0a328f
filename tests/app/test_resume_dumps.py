"""A resumed run whose directory has rollout dumps goes on dumping, ``--dump-rollouts`` given
again or not (replay and the async fault drill need every step's dump); a run that never
dumped does not start."""

from __future__ import annotations

from cli_runner import run_cli
from short_runs import short_gsm8k_args

from rltool.app.rollout_dumps import dumped_steps


def test_a_resumed_run_goes_on_dumping_without_the_flag(tiny_checkpoint, tmp_path):
    dumping, plain = tmp_path / "dumping", tmp_path / "plain"
    assert (
        run_cli([*short_gsm8k_args(tiny_checkpoint, dumping, 1), "--dump-rollouts"]).exit_code == 0
    )
    assert run_cli(short_gsm8k_args(tiny_checkpoint, plain, 1)).exit_code == 0
    for root in (dumping, plain):
        resumed = run_cli(["train", "--resume", str(root / "t"), "trainer.steps=2"])
        assert resumed.exit_code == 0, resumed.output
    assert dumped_steps(dumping / "t") == [1, 2]
    assert dumped_steps(plain / "t") == []
