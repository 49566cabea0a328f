"""`rltool replay`: steps trained again on a run's dumps give the run's weights and train
metrics back; overrides change the training, not the data; a dump that is missing,
damaged or from another model is an error naming the file and the step.

One short run of the tiny random Qwen2 (4 steps, checkpoints at 2 and 4) is shared by
the module; tests that damage something work on a copy of it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from safetensors.torch import load_file
from short_runs import short_gsm8k_args, short_train_args

from rltool.app.replay import replay
from rltool.app.rollout_dumps import DumpError, dump_path, meta_path

# what the replay cannot reproduce: wall-clock times
TIME_PREFIX = "time/"


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("replay")
    args = short_gsm8k_args(tiny_checkpoint, root, 4, "trainer.save_every=2", new_tokens=6)
    result = run_cli([*args, "--dump-rollouts"])
    assert result.exit_code == 0, result.output
    return root / "t"


@pytest.fixture
def copy(run, tmp_path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "t"))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if x["kind"] == "train"}


def assert_same_train_metrics(replayed: dict, original: dict) -> None:
    keys = [k for k in replayed if "/" in k and not k.startswith(TIME_PREFIX)]
    assert "actor/pg_loss" in keys and "data/training_tokens" in keys
    for key in keys:
        if replayed[key] is None:  # a figure that is not finite is written as null
            assert original[key] is None, key
        else:
            assert replayed[key] == pytest.approx(original[key], rel=1e-6, abs=1e-9), key


def test_replay_from_a_checkpoint_gives_the_runs_weights_and_metrics(run, tmp_path):
    result = run_cli(["replay", str(run), "--from-step", "3", "--to-step", "4"])
    assert result.exit_code == 0, result.output
    out = run / "replay-3-4"
    assert "replayed steps 3..4" in result.output
    replayed = weights(out / "checkpoints" / "step_000004")
    assert max_diff(replayed, weights(run / "checkpoints" / "step_000004")) <= 1e-6
    assert max_diff(replayed, weights(run / "checkpoints" / "step_000002")) > 0  # it trained
    lines, original = train_lines(out), train_lines(run)
    assert sorted(lines) == [3, 4]
    for step, line in lines.items():
        assert_same_train_metrics(line, original[step])
    assert json.loads((out / "replay.json").read_text())["from_step"] == 3
    # the run's own files are untouched; a second replay goes to a new directory
    assert sorted(train_lines(run)) == [1, 2, 3, 4]
    again = replay(run, 3, 3)
    assert again.out_dir == run / "replay-3-3"
    assert replay(run, 3, 3).out_dir == run / "replay-3-3-2"
    for replayed_dir in run.glob("replay-*"):
        shutil.rmtree(replayed_dir)


def test_replay_from_step_one_starts_from_the_model(run, tmp_path):
    outcome = replay(run, 1, 2, out_dir=tmp_path / "r")
    replayed = weights(outcome.checkpoint)
    assert max_diff(replayed, weights(run / "checkpoints" / "step_000002")) <= 1e-6
    for line, step in zip(outcome.history, (1, 2), strict=True):
        assert_same_train_metrics(line, train_lines(run)[step])


def test_an_override_changes_the_training_not_the_data(run, tmp_path):
    base = replay(run, 3, 4, out_dir=tmp_path / "base")
    fast = replay(run, 3, 4, ["optimizer.lr=1e-2"], out_dir=tmp_path / "fast")
    for a, b in zip(base.history, fast.history, strict=True):
        assert a["data/training_tokens"] == b["data/training_tokens"]  # the same rollouts
        # the schedule continues from step 2 with the new base rate (warmup of 10 steps)
        assert b["actor/lr"] == pytest.approx(a["actor/lr"] * 1e-2 / 1e-4, rel=1e-9)
    assert max_diff(weights(base.checkpoint), weights(fast.checkpoint)) > 1e-6
    assert "lr: 0.01" in (tmp_path / "fast" / "config.yaml").read_text()


def test_a_missing_dump_names_the_file_and_step(copy):
    dump_path(copy, 4).unlink()
    result = run_cli(["replay", str(copy), "--from-step", "3", "--to-step", "4"])
    assert result.exit_code == 2
    assert str(dump_path(copy, 4)) in result.output
    assert "no rollout dump for step 4" in result.output
    assert not (copy / "replay-3-4").exists()


def test_bytes_changed_in_a_dump_are_damage(copy):
    path = dump_path(copy, 3)
    path.write_bytes(path.read_bytes().replace(b'"score":', b'"score": ', 1))
    with pytest.raises(DumpError, match=r"step_000003\.jsonl: step 3's dump is damaged"):
        replay(copy, 3, 4)


def test_a_cut_line_names_the_file_line_and_step(copy):
    path = dump_path(copy, 4)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])
    _restamp(copy, 4)  # the sha256 agrees: what is left to find is the broken line
    n = len(lines)
    with pytest.raises(DumpError, match=rf"step 4's dump is damaged: .*step_000004\.jsonl:{n}:"):
        replay(copy, 3, 4)


def test_a_dump_from_another_model_is_refused(copy):
    meta = json.loads(meta_path(copy, 3).read_text())
    meta["model_path"] = "Qwen/Qwen3-0.6B"
    meta_path(copy, 3).write_text(json.dumps(meta))
    with pytest.raises(DumpError, match=r"step 3's dump is from another model .*Qwen3-0\.6B"):
        replay(copy, 3, 4)


def test_token_ids_beyond_the_vocabulary_are_another_models(copy):
    path = dump_path(copy, 4)
    first, rest = path.read_text().split("\n", 1)
    sample = json.loads(first)
    sample["input_ids"][-1] = 10**6
    sample["response_ids"][-1] = 10**6
    sample["labels"][-1] = 10**6
    path.write_text(json.dumps(sample) + "\n" + rest)
    _restamp(copy, 4)
    with pytest.raises(DumpError, match=r"step 4, sample .*outside the model's vocabulary"):
        replay(copy, 3, 4)


def test_no_checkpoint_before_the_first_step_lists_the_possible_ones(run):
    # checkpoints at steps 2 and 4: a replay can start at step 1, 3 or 5
    with pytest.raises(ValueError, match=r"step_000001: .*--from-step can be 1 or .*\(3, 5\)"):
        replay(run, 2, 4)


def _restamp(run_dir: Path, step: int) -> None:
    """The meta's sha256 of a dump edited on purpose, as if it had been written so."""
    meta = json.loads(meta_path(run_dir, step).read_text())
    meta["sha256"] = hashlib.sha256(dump_path(run_dir, step).read_bytes()).hexdigest()
    meta_path(run_dir, step).write_text(json.dumps(meta))


@pytest.mark.slow
def test_demo_run_replayed_from_step_4_gives_its_step_6_weights(tmp_path):
    """The issue's check, on the demo recipe and model: 6 steps with checkpoints at 3 and
    6, then steps 4..6 replayed from the step-3 checkpoint."""
    recipe = Path(__file__).parents[2] / "recipes" / "gsm8k_tiny.yaml"
    train = run_cli(
        [
            "train",
            str(recipe),
            "trainer.steps=6",
            "trainer.save_every=3",
            "trainer.time_budget_s=null",
            "trainer.eval_every=0",
            "data.eval_limit=20",
            f"logging.run_dir={tmp_path}",
            "--dump-rollouts",
            "--quiet",
        ]
    )
    assert train.exit_code == 0, train.output
    run = tmp_path / "gsm8k_tiny"
    result = run_cli(["replay", str(run), "--from-step", "4", "--to-step", "6", "--quiet"])
    assert result.exit_code == 0, result.output
    out = run / "replay-4-6"
    replayed, original = (
        weights(out / "checkpoints" / "step_000006"),
        weights(run / "checkpoints" / "step_000006"),
    )
    diff = max_diff(replayed, original)
    print(f"max |replayed - original| over the step-6 weights: {diff:.3g}")
    assert diff <= 1e-6
    assert max_diff(replayed, weights(run / "checkpoints" / "step_000003")) > 1e-6
    lines = train_lines(out)
    assert sorted(lines) == [4, 5, 6]
    for step, line in lines.items():
        assert_same_train_metrics(line, train_lines(run)[step])


@pytest.mark.slow
def test_async_run_replays_to_its_weights(tiny_checkpoint, tmp_path):
    """Async production (in-process generator thread): the dumps hold the groups after
    stale tokens were marked as not trained, and the replay trains with the trainer's
    share of the threads, so the step-4 weights come back."""
    recipe = Path(__file__).parents[2] / "recipes" / "gsm8k_tiny_async.yaml"
    args = short_train_args(
        recipe, tiny_checkpoint, tmp_path, 4, "rollout.backend=inprocess", "trainer.save_every=2"
    )
    result = run_cli([*args, "--dump-rollouts"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "t"
    outcome = replay(run, 3, 4)
    diff = max_diff(weights(outcome.checkpoint), weights(run / "checkpoints" / "step_000004"))
    print(f"async: max |replayed - original| over the step-4 weights: {diff:.3g}")
    assert diff <= 1e-6
    for line, step in zip(outcome.history, (3, 4), strict=True):
        assert_same_train_metrics(line, train_lines(run)[step])
