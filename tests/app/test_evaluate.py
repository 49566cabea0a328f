"""``evaluate_checkpoint``: pass@k, mean@n and maj@n worked by hand through a stand-in
engine, trajectories of sessions, checkpoint loading, and the errors (no checkpoint, no
eval data, k > n)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from fake_engines import FixedReplyEngine
from safetensors.torch import load_file
from short_runs import GSM8K_TINY, short_gsm8k_args

from rltool.app.checkpoint import NoCheckpointError
from rltool.app.evaluate import (
    NO_ANSWERS,
    NoEvalDataError,
    PromptResult,
    check_ks,
    eval_sampling,
    evaluate_checkpoint,
    load_weights,
    prompt_result,
    task_figures,
)
from rltool.app.run import build_run
from rltool.config.loader import load_recipe
from rltool.engines.base import RolloutEngine
from rltool.engines.registry import ENGINES
from rltool.produce.backend import GroupOutcome, GroupRequest
from rltool.rollout.state import RolloutState, Status

REPLIES = ["#### 3", "#### 0", "#### 0", "#### 0"]


@ENGINES.register("test-cycling")
def _cycling(rollout, model_cfg, model, tokenizer) -> RolloutEngine:
    return FixedReplyEngine(tokenizer, REPLIES)  # sample i of every prompt: REPLIES[i % 4]


def _data(tmp_path: Path, answers: list[int]) -> Path:
    path = tmp_path / "eval.jsonl"
    rows = [{"question": f"What is {a}?", "answer": f"#### {a}"} for a in answers]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(ckpt: Path, data: Path, *extra: str):
    return load_recipe(
        GSM8K_TINY,
        [
            f"model.path={ckpt}",
            f"data.train_files=[{data}]",
            f"data.eval_files=[{data}]",
            "rollout.engine=test-cycling",
            *extra,
        ],
    )


def test_pass_at_k_through_the_gsm8k_loop_is_the_hand_worked_value(tiny_checkpoint, tmp_path):
    # answers 3, 5, 0; each prompt's 4 samples say 3, 0, 0, 0: correct c = 1, 0, 3
    recipe = _recipe(tiny_checkpoint, _data(tmp_path, [3, 5, 0]))
    report = evaluate_checkpoint(recipe, source="r.yaml", n=4, ks=[2, 4])
    assert report.ks == [1, 2, 4]
    assert report.weights == str(tiny_checkpoint) and report.step is None
    assert report.sampling["temperature"] == recipe.rollout.sampling.temperature  # n > 1
    (figs,) = report.tasks
    # pass@1 = (1/4 + 0 + 3/4) / 3; pass@2 = (1/2 + 0 + 1) / 3; pass@4 = (1 + 0 + 1) / 3
    assert figs.pass_at == pytest.approx({1: 1 / 3, 2: 1 / 2, 4: 2 / 3})
    assert (figs.prompts, figs.samples, figs.failed) == (3, 12, 0)
    assert figs.truncated_frac == 0.0
    assert figs.mean_response_len > 0
    assert report.overall.pass_at == figs.pass_at
    # mean@4: the mean score, with a 0/1 reward pass@1 again; maj@4: every prompt votes
    # "0" (three of four), right for the third prompt only
    assert figs.figures["mean@4"].value == pytest.approx(1 / 3)
    assert figs.figures["maj@4"].value == pytest.approx(1 / 3)
    assert figs.maj_missing is None
    # pass@1 per prompt [1/4, 0, 3/4]: a resample of all 0 (or all 3/4) has chance 1/27
    one = figs.figures["pass@1"]
    assert one.per_prompt == pytest.approx([0.25, 0.0, 0.75])
    assert (one.low, one.high) == pytest.approx((0.0, 0.75))
    out = report.to_dict()
    assert out["tasks"][0]["pass_at"]["pass@4"] == pytest.approx(2 / 3)
    assert out["tasks"][0]["figures"]["maj@4"] == pytest.approx(
        {"value": 1 / 3, "low": 0.0, "high": 1.0}
    )
    json.dumps(out)  # one JSON object


def test_n_1_uses_the_eval_sampling(tiny_checkpoint, tmp_path):
    recipe = _recipe(tiny_checkpoint, _data(tmp_path, [3, 5]))
    assert eval_sampling(recipe, 1) is recipe.rollout.eval_sampling
    assert eval_sampling(recipe, 2) is recipe.rollout.sampling
    report = evaluate_checkpoint(recipe, source="r.yaml", n=1)
    # the first sample of each prompt says 3: right for the first prompt only
    assert report.tasks[0].pass_at == {1: 0.5}
    assert report.sampling["temperature"] == 0.0


def test_a_run_dir_loads_its_newest_checkpoint(tiny_checkpoint, tmp_path):
    args = short_gsm8k_args(tiny_checkpoint, tmp_path, 1, "-q")
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "t"
    ckpt = run_dir / "checkpoints" / "step_000001"
    recipe = load_recipe(run_dir / "config.yaml")
    run = build_run(recipe, with_trainer=False)
    try:
        saved = load_file(str(ckpt / "model.safetensors"))
        with torch.no_grad():  # every weight moved: only the load can bring them back
            for p in run.model.parameters():
                p.add_(1.0)
        weights, step, skipped = load_weights(run, run_dir, None)
        assert (weights, step, skipped) == (str(ckpt), 1, [])
        for key, value in saved.items():
            assert run.model.state_dict()[key].equal(value), key
    finally:
        run.close()


def test_errors_name_what_to_fix(tiny_checkpoint, tmp_path):
    recipe = _recipe(tiny_checkpoint, _data(tmp_path, [3]))
    with pytest.raises(ValueError, match=r"--k 8: pass@k needs 1 <= k <= n = 4"):
        check_ks(4, [8])
    with pytest.raises(ValueError, match=r"--n must be >= 1"):
        check_ks(0, [])
    with pytest.raises(NoCheckpointError, match=r"checkpoints is missing"):
        evaluate_checkpoint(recipe, source="x", run_dir=tmp_path, n=1)
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)
    with pytest.raises(NoCheckpointError, match=r"step_000003: no manifest.json.*--checkpoint"):
        evaluate_checkpoint(recipe, source="x", run_dir=tmp_path, n=1)
    with pytest.raises(NoCheckpointError, match=r"--checkpoint .*nope: no such directory"):
        evaluate_checkpoint(recipe, source="x", checkpoint=tmp_path / "nope", n=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_eval = _recipe(tiny_checkpoint, _data(tmp_path, [3]), f"data.eval_files=[{empty}]")
    with pytest.raises(NoEvalDataError, match=r"task 'gsm8k': no eval data"):
        evaluate_checkpoint(no_eval, source="x", n=1)


def _state(i: int, status: Status, *, correct=None, score=1.0, session=None, error=None):
    s = RolloutState(
        rollout_id=f"g/{i}",
        group_id="g",
        session_id=session,
        prompt_ids=[1],
        response_ids=[5] * (i + 1),
        finish_reason="length" if i == 0 else "stop",
        reward={"score": score, **({} if correct is None else {"correct": correct})},
    )
    return s.fail(error) if status == Status.FAILED else s.model_copy(update={"status": status})


def test_prompt_result_groups_sessions_and_counts_failures():
    group = [
        _state(0, Status.COMPLETED, score=1.0, session="a"),  # session a: two segments,
        _state(1, Status.COMPLETED, score=1.0, session="a"),  # no "correct": score 1 solves
        _state(2, Status.COMPLETED, correct=False, score=1.0),  # "correct" wins over score
        _state(3, Status.FAILED, error="reward: timeout after 5s"),
        _state(4, Status.COMPLETED, score=0.5),
    ]
    request = GroupRequest("default", {}, "g", 4)
    r = prompt_result(GroupOutcome(request, group))
    assert (r.samples, r.correct, r.truncated) == (4, 1, 1)
    assert r.lengths == [1 + 2, 3, 4, 5]
    assert r.failures == ["reward: timeout after 5s"]
    lost = prompt_result(GroupOutcome(request, None, error="worker: died (on worker-1)"))
    assert (lost.samples, lost.correct, lost.lengths) == (4, 0, [])
    assert lost.failures == ["worker: died"] * 4


def test_task_figures_average_over_prompts_and_trajectories():
    results = [
        PromptResult(2, 1, [4, 6], 1, []),
        PromptResult(2, 0, [10], 0, ["reward: x", "reward: x"]),
    ]
    figs = task_figures("t", results, [1, 2])
    # pass@1 = (1/2 + 0) / 2; pass@2 = (1 + 0) / 2
    assert figs.pass_at == pytest.approx({1: 0.25, 2: 0.5})
    assert figs.mean_response_len == pytest.approx(20 / 3)
    assert figs.truncated_frac == pytest.approx(1 / 3)
    assert (figs.failed, figs.failures) == (2, {"reward: x": 2})


def test_several_tasks_have_a_row_each_and_a_prompt_weighted_overall(tiny_checkpoint):
    recipe = load_recipe(
        GSM8K_TINY.with_name("gsm8k_tiny_multitask.yaml"),
        [f"model.path={tiny_checkpoint}", "rollout.engine=test-cycling", "data.eval_limit=2"],
    )
    report = evaluate_checkpoint(recipe, source="m.yaml", n=4)
    assert [t.task for t in report.tasks] == ["add", "sub", "mul"]
    assert [t.prompts for t in report.tasks] == [2, 2, 2]
    assert (report.overall.prompts, report.overall.samples) == (6, 24)
    for k in (1, 4):  # equal prompts per task: the overall is the mean of the tasks
        mean = sum(t.pass_at[k] for t in report.tasks) / 3
        assert report.overall.pass_at[k] == pytest.approx(mean)


def test_a_session_loop_is_evaluated_by_session(tiny_checkpoint):
    """The localhost loop (calculator agent): one trajectory per session, n per prompt."""
    recipe = load_recipe(
        GSM8K_TINY.with_name("localhost_calculator.yaml"),
        [
            f"model.path={tiny_checkpoint}",
            "data.eval_limit=1",
            "rollout.sampling.max_new_tokens=4",
        ],
    )
    report = evaluate_checkpoint(recipe, source="l.yaml", n=2)
    (figs,) = report.tasks
    assert (figs.task, figs.prompts, figs.samples) == ("calculator", 1, 2)
    assert figs.pass_at[1] <= figs.pass_at[2]
    assert figs.mean_response_len > 0


def test_prompt_result_keeps_each_answer_for_the_vote():
    def answered(i: int, extracted, correct: bool) -> RolloutState:
        reward = {"score": float(correct), "correct": correct, "extracted": extracted}
        return _state(i, Status.COMPLETED).model_copy(update={"reward": reward})

    group = [
        answered(0, "3.0", True),
        answered(1, "3", True),  # the same answer as "3.0"
        answered(2, None, False),  # no answer: no vote
        _state(3, Status.FAILED, error="reward: timeout"),  # failed: no vote, score 0
    ]
    r = prompt_result(GroupOutcome(GroupRequest("default", {}, "g", 4), group))
    assert r.votes == [("3", True), ("3", True), (None, False)]
    assert r.scores == [1.0, 1.0, 0.0, 0.0]
    unanswered = prompt_result(GroupOutcome(GroupRequest("default", {}, "g", 1), group[3:]))
    assert unanswered.votes is None  # nothing says the loop extracts answers


def test_mean_and_maj_over_prompts_hand_worked():
    results = [
        # scores 1, 0.5, 0 (partial credit); the vote: "7" twice, right
        PromptResult(
            3, 1, [1, 1, 1], 0, [], [1.0, 0.5, 0.0], [("7", True), ("7", True), ("2", False)]
        ),
        # two samples failed: scores 0; the one vote "4" is wrong
        PromptResult(3, 0, [1], 0, ["x", "x"], [0.0, 0.0, 0.0], [("4", False)]),
        # the group never came back: no score, no vote (the task still votes)
        PromptResult(3, 0, [], 0, ["worker: died"] * 3),
    ]
    figs = task_figures("t", results, [1], n=3)
    assert list(figs.figures) == ["pass@1", "mean@3", "maj@3"]
    assert figs.figures["mean@3"].per_prompt == pytest.approx([0.5, 0.0, 0.0])
    assert figs.figures["maj@3"].per_prompt == [1.0, 0.0, 0.0]
    assert figs.figures["maj@3"].value == pytest.approx(1 / 3)
    # an overall over a task that votes and one that does not shows no maj@n
    assert "maj@3" not in task_figures("overall", results, [1], n=3, vote=False).figures
    for fig in figs.figures.values():
        assert fig.low <= fig.value <= fig.high


def test_maj_is_left_out_with_a_reason_where_no_answer_is_extracted():
    results = [PromptResult(2, 1, [4, 6], 0, [], [1.0, 0.0], None)]
    figs = task_figures("t", results, [1, 2])
    assert list(figs.figures) == ["pass@1", "pass@2", "mean@2"]
    assert figs.maj_missing == NO_ANSWERS
    assert "reward" in NO_ANSWERS and "extracted" in NO_ANSWERS
