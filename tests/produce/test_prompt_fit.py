"""data.too_long: prompts that cannot fit the model with max_new_tokens after them, counted
with the run's tokenizer and the loop's chat template, skipped per file or refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from task_fakes import recipe_with, task

from rltool import metric_names as mn
from rltool.agent_loops.gsm8k import GSM8KLoop
from rltool.agent_loops.localhost import LocalhostLoop
from rltool.config.schema import RecipeConfig
from rltool.demo.tokenizer import train_demo_tokenizer
from rltool.produce.preflight import PreflightError
from rltool.produce.prompt_fit import Limit, fit_task_data, prompt_limits

SHORT = "What is 2 + 3?"
# the demo template: "<|im_start|>user\n" (3 tokens) + the question + "<|im_end|>\n" (2)
# + "<|im_start|>assistant\n" (3); the question's digits, spaces and signs are 13 tokens
SHORT_TOKENS = 21
LONG = "1 + " * 100  # 300 tokens: 308 with the template


@pytest.fixture(scope="module")
def tok():
    return train_demo_tokenizer()


def write(path: Path, questions: list[str]) -> str:
    path.write_text("".join(json.dumps({"question": q, "answer": "5"}) + "\n" for q in questions))
    return str(path)


def recipe(train: list[str], evals: list[str], pack: int, new: int = 8) -> RecipeConfig:
    r = RecipeConfig()
    r.data.train_files, r.data.eval_files = train, evals
    r.trainer.pack_max_length = pack
    r.rollout.sampling.max_new_tokens = new
    r.rollout.eval_sampling.max_new_tokens = new
    return r


def test_prompt_tokens_are_counted_as_generation_renders_them(tok) -> None:
    messages = [{"role": "user", "content": SHORT}]
    assert len(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]) == 21
    rows = [{"question": SHORT}, {"question": LONG}]
    assert GSM8KLoop.prompt_lengths(rows, {}, tok) == [SHORT_TOKENS, 308]
    # a system prompt is part of what generation sees: "<|im_start|>system\nBe brief.<|im_end|>\n"
    with_system = GSM8KLoop.prompt_lengths(rows[:1], {"system_prompt": "Be brief."}, tok)
    assert with_system[0] > SHORT_TOKENS
    assert LocalhostLoop.prompt_lengths(rows, {}, tok) is None  # its agent renders prompts


def test_limits_worked_by_hand() -> None:
    r = recipe([], [], pack=512, new=20)
    # a sample of P + R tokens trains as P + R - 1 after the shift: P <= 512 + 1 - 20
    pack_rule = "trainer.pack_max_length 512 + 1 - rollout.sampling.max_new_tokens 20"
    assert prompt_limits(r, None) == (Limit(493, pack_rule), None)
    eval_rule = "the model's context 4096 - rollout.eval_sampling.max_new_tokens 20"
    assert prompt_limits(r, 4096) == (Limit(493, pack_rule), Limit(4076, eval_rule))
    small = "the model's context 300 - rollout.sampling.max_new_tokens 20"
    assert prompt_limits(r, 300)[0] == Limit(280, small)
    r.rollout.engine, r.rollout.vllm.max_model_len = "vllm", 256
    assert prompt_limits(r, 4096)[0].tokens == 236


def test_one_prompt_in_41_is_skipped_and_counted_per_file(tok, tmp_path: Path) -> None:
    questions = [f"What is {i} + 1?" for i in range(41)]
    questions[17] = LONG  # line 18
    train = write(tmp_path / "train.jsonl", questions)
    evals = write(tmp_path / "test.jsonl", [SHORT, LONG, LONG, SHORT])
    data, report = fit_task_data(recipe([train], [evals], pack=64), tok, 300)
    kept, kept_eval = data["gsm8k"]
    assert [r["question"] for r in kept] == questions[:17] + questions[18:]
    assert [r["question"] for r in kept_eval] == [SHORT, SHORT]
    assert report.metrics() == {mn.DATA_TOO_LONG_SKIPPED: 1.0, mn.DATA_TOO_LONG_SKIPPED_EVAL: 2.0}
    message = report.message()
    assert f"{train} (training): 1 prompt(s) longer than 57 tokens" in message
    assert f"{train}:18 (308 tokens)" in message
    # eval prompts are bounded by the context alone (they never train): 308 + 8 > 300
    assert f"{evals} (eval): 2 prompt(s) longer than 292 tokens" in message
    assert f"{evals}:2 (308 tokens), {evals}:3 (308 tokens)" in message
    _, report = fit_task_data(recipe([train], [evals], pack=64), tok, 512)
    assert report.metrics() == {mn.DATA_TOO_LONG_SKIPPED: 1.0, mn.DATA_TOO_LONG_SKIPPED_EVAL: 0.0}


def test_the_limit_is_exact_at_the_boundary(tok, tmp_path: Path) -> None:
    train = write(tmp_path / "t.jsonl", [SHORT, "1?"])  # 21 and 10 tokens
    # P + 8 new tokens = 29 tokens, 28 after the shift: fits a row of 28, not of 27
    data, report = fit_task_data(recipe([train], [], pack=SHORT_TOKENS + 7), tok, None)
    assert len(data["gsm8k"][0]) == 2 and report.skipped() == 0
    data, report = fit_task_data(recipe([train], [], pack=SHORT_TOKENS + 6), tok, None)
    assert len(data["gsm8k"][0]) == 1 and report.skipped() == 1
    # the model's context: P + 8 <= 29
    data, report = fit_task_data(recipe([train], [], pack=512), tok, SHORT_TOKENS + 8)
    assert report.skipped() == 0
    data, report = fit_task_data(recipe([train], [], pack=512), tok, SHORT_TOKENS + 7)
    assert report.skipped() == 1


def test_error_names_file_row_length_and_limit(tok, tmp_path: Path) -> None:
    train = write(tmp_path / "train.jsonl", [SHORT, LONG])
    r = recipe([train], [], pack=64)
    r.data.too_long = "error"
    with pytest.raises(PreflightError) as info:
        fit_task_data(r, tok, 512)
    message = str(info.value)
    assert message.startswith("preflight: prompts too long for the model (data.too_long=error)")
    assert f"{train}:2 (308 tokens)" in message
    assert "longer than 57 tokens (trainer.pack_max_length 64 + 1 - " in message


def test_each_task_of_a_list_is_checked_with_its_own_loop_options(tok, tmp_path: Path) -> None:
    a, b = task("a"), task("b", system_prompt="Answer with the number only, nothing else.")
    a.train_files = [write(tmp_path / "a.jsonl", [SHORT, SHORT])]
    b.train_files = [write(tmp_path / "b.jsonl", [SHORT, "1?", LONG])]
    b.eval_files = [write(tmp_path / "b_eval.jsonl", [LONG])]
    r = recipe_with(a, b)
    r.trainer.pack_max_length, r.rollout.sampling.max_new_tokens = 57, 8  # prompts <= 50
    assert GSM8KLoop.prompt_lengths(
        [{"question": SHORT}, {"question": "1?"}], b.agent_loop.options, tok
    ) == [58, 47]  # the system prompt's 37 tokens
    data, report = fit_task_data(r, tok, 4096)
    assert [len(data[t][0]) for t in "ab"] == [2, 1]
    assert len(data["b"][1]) == 1  # 308 + 8 fits the context of 4096
    assert [(Path(f.path).name, len(f.rows)) for f in report.files] == [("b.jsonl", 2)]
    r.data.too_long = "error"
    with pytest.raises(PreflightError, match=r"b\.jsonl:1 \(58 tokens\), .*b\.jsonl:3 \(345"):
        fit_task_data(r, tok, 4096)


def test_a_task_left_without_prompts_says_why(tok, tmp_path: Path) -> None:
    train = write(tmp_path / "train.jsonl", [LONG])
    with pytest.raises(
        PreflightError,
        match=r"(?s)hold no records that fit the model:\n.*train\.jsonl:1 \(308 tokens\)",
    ):
        fit_task_data(recipe([train], [], pack=64), tok, 512)
