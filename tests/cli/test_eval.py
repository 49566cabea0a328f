"""`rltool eval` through the CLI: a short run's newest checkpoint, pass@1 and pass@k in the
table and in JSON, and the errors with their exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_runner import run_cli
from short_runs import GSM8K_TINY, short_gsm8k_args


@pytest.fixture(scope="module")
def run_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """A one-step run of the demo recipe on the tiny checkpoint (eval_limit 4 prompts)."""
    root = tmp_path_factory.mktemp("eval-run")
    result = run_cli(short_gsm8k_args(tiny_checkpoint, root, 1, "-q"))
    assert result.exit_code == 0, result.output
    return root / "t"


def test_eval_of_a_run_prints_pass_at_1_and_pass_at_n(run_dir):
    result = run_cli(["eval", str(run_dir), "--n", "4"])
    assert result.exit_code == 0, result.output
    assert "step_000001 (step 1)" in result.output
    assert "4 sample(s) per prompt, temperature 1.0" in result.output
    for column in ("pass@1", "pass@4", "mean len", "truncated", "failed"):
        assert column in result.output
    assert "gsm8k" in result.output


def test_json_is_one_object_with_every_figure(run_dir):
    result = run_cli(["eval", str(run_dir), "--n", "4", "--k", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["n"], out["ks"], out["step"]) == (4, [1, 2], 1)
    (task,) = out["tasks"]
    assert (task["task"], task["prompts"], task["samples"]) == ("gsm8k", 4, 16)
    assert set(task["pass_at"]) == {"pass@1", "pass@2"}
    assert 0.0 <= task["pass_at"]["pass@1"] <= task["pass_at"]["pass@2"] <= 1.0
    assert 0 < task["mean_response_len"] <= 4  # the run's max_new_tokens
    assert out["overall"]["pass_at"] == task["pass_at"]


def test_k_over_n_is_exit_2(run_dir):
    result = run_cli(["eval", str(run_dir), "--n", "2", "--k", "4"])
    assert result.exit_code == 2
    assert "--k 4: pass@k needs 1 <= k <= n = 2" in result.output


def test_a_run_without_a_checkpoint_is_exit_3(run_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    result = run_cli(["eval", str(bare)])
    assert result.exit_code == 3
    assert "checkpoints is missing" in result.output
    assert "--checkpoint" in result.output


def test_a_directory_that_is_no_run_is_exit_2(tmp_path):
    result = run_cli(["eval", str(tmp_path)])
    assert result.exit_code == 2
    assert "a directory without config.yaml" in result.output


def test_a_recipe_without_eval_data_is_exit_2(tiny_checkpoint, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = ["eval", str(GSM8K_TINY), f"model.path={tiny_checkpoint}", f"data.eval_files=[{empty}]"]
    result = run_cli(args)
    assert result.exit_code == 2
    assert "no eval data" in result.output


def test_checkpoint_option_names_the_weights(run_dir, tiny_checkpoint, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_000001"
    args = ["eval", str(GSM8K_TINY), f"model.path={tiny_checkpoint}", "data.eval_limit=2"]
    result = run_cli([*args, "--checkpoint", str(ckpt), "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["weights"], out["step"], out["ks"]) == (str(ckpt), 1, [1])
    assert out["sampling"]["temperature"] == 0.0  # n = 1: the greedy eval sampling
    (tmp_path / "step_000009").mkdir()  # a save that did not finish
    result = run_cli([*args, "--checkpoint", str(tmp_path / "step_000009")])
    assert result.exit_code == 3
    assert "step_000009: no manifest.json" in result.output


@pytest.fixture(scope="module")
def run_b(tiny_checkpoint, tmp_path_factory) -> Path:
    """A second one-step run of the same recipe, another seed and learning rate."""
    root = tmp_path_factory.mktemp("eval-run-b")
    args = short_gsm8k_args(tiny_checkpoint, root, 1, "-q", "trainer.seed=1", "optimizer.lr=1e-2")
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    return root / "t"


def test_two_runs_print_every_figure_with_intervals_and_the_paired_difference(run_dir, run_b):
    result = run_cli(["eval", str(run_dir), str(run_b), "--n", "8"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "A weights: " in out and "B weights: " in out
    assert "8 sample(s) per prompt" in out and "seed 0" in out  # B samples with A's seed
    for figure in ("pass@1", "pass@8", "mean@8", "maj@8"):
        assert figure in out
    assert "B - A" in out and "beyond noise?" in out
    assert "[" in out and "]" in out  # the intervals


def test_the_comparison_in_json_pairs_the_same_prompts(run_dir, run_b):
    ckpt_b = run_b / "checkpoints" / "step_000001"  # a checkpoint directory is a source too
    result = run_cli(["eval", str(run_dir), str(ckpt_b), "--n", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["b"]["weights"] == str(ckpt_b) and out["b"]["seed"] == out["a"]["seed"] == 0
    assert out["a"]["rows"] == out["b"]["rows"]
    (task_a,), (task_b,) = out["a"]["tasks"], out["b"]["tasks"]
    diffs = out["differences"]["gsm8k"]
    assert set(diffs) == {"pass@1", "pass@2", "mean@2", "maj@2"}
    for name, d in diffs.items():
        a, b = task_a["figures"][name], task_b["figures"][name]
        assert a["low"] <= a["value"] <= a["high"]
        assert d["mean"] == pytest.approx(b["value"] - a["value"])  # the mean of B - A
        assert d["low"] <= d["mean"] <= d["high"] and d["prompts"] == 4
        assert d["distinguishable"] == (not d["low"] <= 0.0 <= d["high"])


def test_a_comparison_on_other_prompts_or_of_three_sources_is_exit_2(run_dir, run_b, tmp_path):
    result = run_cli(["eval", str(run_dir), str(run_b), "data.eval_limit=2"])
    assert result.exit_code == 0, result.output  # an override applies to both
    fewer = tmp_path / "fewer"  # run b, its recipe evaluating 3 prompts, not 4
    shutil.copytree(run_b, fewer)
    config = (fewer / "config.yaml").read_text()
    assert config.count("eval_limit: 4") == 1
    (fewer / "config.yaml").write_text(config.replace("eval_limit: 4", "eval_limit: 3"))
    unpaired = run_cli(["eval", str(run_dir), str(fewer)])
    assert unpaired.exit_code == 2
    assert "A and B evaluate different prompts (task 'gsm8k')" in unpaired.output
    other = run_cli(["eval", str(run_dir), str(run_b), "--checkpoint", str(run_b)])
    assert other.exit_code == 2 and "--checkpoint names the weights of one" in other.output
    three = run_cli(["eval", str(run_dir), str(run_b), str(run_b)])
    assert three.exit_code == 2 and "give one source to evaluate, or two" in three.output
