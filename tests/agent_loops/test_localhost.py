"""LocalhostLoop and the calculator agent: sessions recorded token-exactly, failures contained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from loop_fakes import LOGPROB, ContextEngine, decode, spans
from transformers import AutoTokenizer, Qwen2ForCausalLM

from rltool.agent_loops.base import AGENT_LOOPS, LoopContext
from rltool.agent_loops.evaluation import EvaluationFailed
from rltool.agent_loops.localhost import LocalhostLoop, load_callable
from rltool.agent_loops.session_loops import session_ids, session_tokenizer
from rltool.agents.calculator import calculate, check_feedback, judge
from rltool.app.demo_model import demo_model_config
from rltool.builtin import demo_cache_dir
from rltool.config.schema import SamplingConfig
from rltool.demo.tokenizer import CHAT_TEMPLATE, train_demo_tokenizer
from rltool.engines.hf import HFEngine
from rltool.rollout.contract import check_group, check_sample, errors
from rltool.rollout.state import IGNORE_INDEX, Status
from rltool.sessions import TOOL_CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
RLTOOL = [sys.executable, "-c", "from rltool.cli.app import main; main()"]
CALC = {"agent": "rltool.agents.calculator:run", "judger": "rltool.agents.calculator:judge"}
TOM = {
    "question": "Tom has 7 apples and buys 5 more. How many apples does Tom have?",
    "answer": "7 + 5 = 12\n#### 12",
}
ANNA = {
    "question": "Anna buys 3 packs of cups. Each pack holds 4 cups. How many cups does Anna buy?",
    "answer": "3 * 4 = 12\n#### 12",
}
BOOM = {"question": "boom", "answer": "#### 1"}  # flaky_agent raises on it
FEEDBACK = "calculator: 7 + 5 = 12; give the final answer as #### N"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 + 5"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer()  # plain ChatML: the loop substitutes the tool template


def answer_then_fix(context: str) -> str:
    """Turn 1: a wrong sum; turn 2 (after the calculator's feedback): the right answer."""
    return "#### 12" if "calculator:" in context else "7 + 5 = 13"


def call_then_answer(context: str) -> str:
    return "#### 12" if "<tool_response>" in context else CALL


def make_loop(tokenizer, reply, **options) -> tuple[LocalhostLoop, ContextEngine]:
    engine = ContextEngine(tokenizer, reply, model_step=2)
    options = {**CALC, **options}
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=32), task_name="localhost")
    loop = LocalhostLoop(ctx, **options)
    return loop, engine


# --- agents used by import path ("loop_fakes" style: this directory is on sys.path) ---------


def flaky_agent(client, task):
    """The calculator agent, except that it raises on the BOOM task after one model call."""
    from rltool.agents.calculator import run

    if task["question"] == "boom":
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("boom")
    return run(client, task)


def silent_agent(client, task):
    return "#### 12"  # never calls the model


def bad_judge(task, text):
    raise KeyError("no such field")


# --- the calculator agent -------------------------------------------------------------------


def test_calculate_is_exact_arithmetic_and_refuses_anything_else():
    assert calculate("7 + 5") == "12"
    assert calculate("(2 + 3) * 4 - 6 / 3") == "18"
    assert calculate("7 / 2") == "3.5"
    assert calculate("1 / 3") == "0.333333"
    assert calculate("2 ^ 10") == "1024"
    assert calculate("-3 * 4") == "-12"
    for bad in ["__import__('os').system('true')", "x + 1", "2 ** 1000", "1 / 0", "", "[1]"]:
        with pytest.raises(ValueError):
            calculate(bad)


def test_check_feedback_checks_the_first_operation_of_the_answer():
    assert check_feedback("7 + 5 = 13\n#### 13") == FEEDBACK
    assert check_feedback("3 x 4 = 11") == (
        "calculator: 3 * 4 = 12; give the final answer as #### N"
    )
    assert check_feedback("twelve") == (
        "calculator: no expression found in your answer; write it as a + b = c, "
        "then give the final answer as #### N"
    )


def test_judge_scores_the_final_number():
    assert judge(TOM, "7 + 5 = 12\n#### 12") == 1.0
    assert judge(TOM, "#### 13") == 0.0
    assert judge(TOM, "no idea") == 0.0


# --- options and the chat template ----------------------------------------------------------


def test_registered_and_options_are_checked(tokenizer):
    assert AGENT_LOOPS.get("localhost") is LocalhostLoop
    assert load_callable("rltool.agents.calculator:run", "agent").__name__ == "run"
    with pytest.raises(ValueError, match=r"options.agent: 'calculator.run' must be"):
        load_callable("calculator.run", "agent")
    with pytest.raises(ValueError, match=r"options\.judger: cannot import 'no_such_mod'"):
        load_callable("no_such_mod:judge", "judger")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_callable("rltool.agents.calculator:nope", "agent")


def test_session_tokenizer_substitutes_the_tool_template_only_when_needed(tokenizer):
    tool_tok = session_tokenizer(tokenizer)
    assert tool_tok is not tokenizer and tool_tok.chat_template == TOOL_CHAT_TEMPLATE
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the trainer's tokenizer is untouched
    assert session_tokenizer(tool_tok) is tool_tok
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tool_tok.apply_chat_template(user, tokenize=False) == tokenizer.apply_chat_template(
        user, tokenize=False
    )  # without tools, both render the same
    plain = train_demo_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="renders no tools and is not ChatML"):
        session_tokenizer(plain)


def test_session_ids_are_safe_and_distinct_even_for_repeated_group_ids():
    # a step crossing an epoch may draw one prompt twice under the same group id
    assert session_ids(["s2-p0", "s2-p1", "s2-p0", "a/b", "a_b"], 2) == [
        "s2-p0.0", "s2-p0.1", "s2-p1.0", "s2-p1.1", "s2-p0-r1.0", "s2-p0-r1.1",
        "a_b.0", "a_b.1", "a_b-r1.0", "a_b-r1.1",
    ]  # fmt: skip


# --- the loop with a scripted engine ---------------------------------------------------------


def test_feedback_turn_is_masked_between_two_supervised_answers(tokenizer):
    loop, engine = make_loop(tokenizer, answer_then_fix)
    threads_before = threading.active_count()
    groups = loop.generate_groups([TOM, ANNA], 2, ["s1-p0", "s1-p1"])
    assert threading.active_count() == threads_before  # server, agents, connections all gone
    assert [len(g) for g in groups] == [2, 2]  # one segment per session
    assert sum(engine.batch_sizes) == 8  # 4 sessions x 2 turns
    for g, gid in zip(groups, ["s1-p0", "s1-p1"], strict=True):
        assert errors(check_group(g)) == []
        for i, s in enumerate(g):
            assert s.status == Status.COMPLETED, s.error
            assert (s.group_id, s.task_name, s.agent_loop) == (gid, "localhost", "localhost")
            assert s.session_id == f"{gid}.{i}" and s.rollout_id == f"{gid}.{i}/seg0"
            assert s.reward == {"score": 1.0}
            assert s.extra == {"tool_turns": 0, "num_turns": 2, "agent_output": "#### 12"}
            assert check_sample(s) == []
            (a1, b1), (a2, b2) = spans(s)[0]
            assert a1 == len(s.prompt_ids)
            assert decode(tokenizer, s.input_ids[a1:b1]) == "7 + 5 = 13<|im_end|>"
            assert decode(tokenizer, s.input_ids[b1:a2]) == (
                f"\n<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert decode(tokenizer, s.input_ids[a2:b2]) == "#### 12<|im_end|>"
            assert b2 == len(s.input_ids)
            assert set(s.labels[b1:a2]) == {IGNORE_INDEX}
            lp = np.asarray(s.logprobs)
            assert set(lp[a1:b1]) == set(lp[a2:b2]) == {LOGPROB}
            assert set(lp[b1:a2]) == {0.0}
            assert s.response_model_steps.tolist() == [2] * len(s.response_ids)
    tom_prompt = decode(tokenizer, groups[0][0].prompt_ids)
    assert tom_prompt.startswith("<|im_start|>system\n# Tools") and '"calculator"' in tom_prompt
    metrics = loop.pop_metrics()
    assert metrics["agent/sessions"] == 4 and metrics["agent/turns_per_session"] == 2
    assert metrics["agent/generate_calls"] == len(engine.batch_sizes)
    assert metrics["agent/turns_per_generate_call"] == 8 / len(engine.batch_sizes)
    assert metrics["agent/errors"] == metrics["reward/errors"] == 0
    assert loop.pop_metrics()["agent/sessions"] == 0  # reset by the pop


def test_tool_call_is_run_locally_and_its_result_masked(tokenizer):
    loop, _ = make_loop(tokenizer, call_then_answer)
    (group,) = loop.generate_groups([TOM], 1, ["g"])
    (s,) = group
    assert s.status == Status.COMPLETED and s.reward == {"score": 1.0}
    assert s.extra["tool_turns"] == 1 and s.extra["num_turns"] == 2
    (a1, b1), (a2, b2) = spans(s)[0]
    assert decode(tokenizer, s.input_ids[a1:b1]) == CALL + "<|im_end|>"
    assert decode(tokenizer, s.input_ids[b1:a2]) == (
        "\n<|im_start|>user\n<tool_response>\n7 + 5 = 12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert decode(tokenizer, s.input_ids[a2:b2]) == "#### 12<|im_end|>"
    assert check_sample(s) == []


def test_a_raising_agent_fails_only_its_own_sessions(tokenizer):
    loop, _ = make_loop(tokenizer, answer_then_fix, agent="test_localhost:flaky_agent")
    ok, bad = loop.generate_groups([TOM, BOOM], 2, ["ok", "bad"])
    assert [s.status for s in ok] == [Status.COMPLETED] * 2
    assert [s.status for s in bad] == [Status.FAILED] * 2
    for s in bad:
        assert s.error.startswith("agent: RuntimeError: boom (at test_localhost.py:")
        assert s.reward is None and s.input_ids is not None  # the recorded turn is kept
        assert errors(check_sample(s)) == []
    metrics = loop.pop_metrics()
    assert metrics["agent/errors"] == 2 and metrics["reward/errors"] == 0


def test_an_agent_that_never_calls_the_model_and_a_raising_judger_fail(tokenizer):
    loop, _ = make_loop(tokenizer, answer_then_fix, agent="test_localhost:silent_agent")
    ((s,),) = loop.generate_groups([TOM], 1, ["g"])
    assert s.status == Status.FAILED and s.input_ids is None
    assert s.error == "agent: made no model call; nothing to train on"
    loop, _ = make_loop(tokenizer, answer_then_fix, judger="test_localhost:bad_judge")
    ((s,),) = loop.generate_groups([TOM], 1, ["g"])
    assert s.status == Status.FAILED and s.reward is None
    assert s.error.startswith("reward: judger raised KeyError: 'no such field'")
    assert loop.pop_metrics()["reward/errors"] == 1


def test_evaluate_reports_accuracy_and_keeps_training_counts(tokenizer):
    wrong = {**ANNA, "answer": "#### 13"}
    loop, _ = make_loop(tokenizer, answer_then_fix)
    loop.generate_groups([TOM], 1, ["g"])
    metrics = loop.evaluate([TOM, wrong], SamplingConfig(temperature=0.0, max_new_tokens=8))
    # rows [1, 0]: a resample of both rows is all 1 (or all 0) with chance 1/4: interval [0, 1]
    assert metrics == {
        "eval/accuracy": 0.5,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/failed": 0.0,
        "eval/n": 2.0,
    }
    assert loop.pop_metrics()["agent/sessions"] == 1  # the training session only
    with pytest.raises(ValueError, match="at least one task"):
        loop.evaluate([], SamplingConfig())


def test_evaluate_counts_failures_by_reason_and_fails_when_every_session_fails(tokenizer):
    loop, _ = make_loop(tokenizer, answer_then_fix, agent="test_localhost:flaky_agent")
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    metrics = loop.evaluate([TOM, BOOM], greedy)
    assert metrics == {
        "eval/accuracy": 0.5,
        "eval/accuracy_ci_low": 0.0,
        "eval/accuracy_ci_high": 1.0,
        "eval/failed": 1.0,
        "eval/failures/agent: RuntimeError": 1.0,
        "eval/n": 2.0,
    }
    with pytest.raises(EvaluationFailed) as info:
        loop.evaluate([BOOM, BOOM, BOOM], greedy)
    assert str(info.value) == (
        "evaluation of task 'localhost': all 3 samples failed: agent: RuntimeError (3)"
    )


# --- the loop with a real (random) Qwen2 ------------------------------------------------------


def test_real_tiny_model_sessions_pass_the_contract(tokenizer):
    torch.manual_seed(0)
    config = demo_model_config(tokenizer, hidden_size=64, num_layers=2, num_heads=2,
                               intermediate_size=128)  # fmt: skip
    engine = HFEngine(Qwen2ForCausalLM(config), tokenizer, batch_size=64)
    ctx = LoopContext(engine, tokenizer, SamplingConfig(max_new_tokens=8), task_name="localhost")
    loop = LocalhostLoop(ctx, **CALC)
    (group,) = loop.generate_groups([TOM], 2, ["a"])
    states = list(group)
    assert all(s.status == Status.COMPLETED for s in states), [s.error for s in states]
    assert errors(check_group(group)) == []
    assert {s.session_id for s in states} == {"a.0", "a.1"}
    assert all(s.reward["score"] in (0.0, 1.0) for s in states)
    # every session's two turns: in one segment with env tokens between, or split in two
    for sid in {s.session_id for s in states}:
        segs = [s for s in states if s.session_id == sid]
        runs = [spans(s)[0] for s in segs]
        assert sum(len(r) for r in runs) >= 2
        for s, (supervised, gaps) in zip(segs, map(spans, segs), strict=True):
            for a, b in gaps:
                env_text = decode(tokenizer, s.input_ids[a:b])
                assert set(s.labels[a:b]) == {IGNORE_INDEX}
                assert "calculator:" in env_text or "<tool_response>" in env_text
            assert supervised[0][0] >= len(s.prompt_ids)


# --- the CLI end to end ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_dump_validate_inspect_localhost_recipe(tmp_path):
    # The demo model comes from (or is built once into) RLTOOL_CACHE. One OpenMP thread:
    # on a shared CPU, torch's spinning worker threads slow a run down many times over.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.run(
        [*RLTOOL, "train", "recipes/localhost_calculator.yaml", "trainer.steps=2",
         "data.prompts_per_step=2", "data.group_size=2", "data.eval_limit=2",
         "rollout.sampling.max_new_tokens=12", "rollout.eval_sampling.max_new_tokens=12",
         "trainer.eval_every=0", f"logging.run_dir={tmp_path}", "--dump-rollouts", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    dumps = sorted(tmp_path.glob("localhost_calculator/rollouts/step_*.jsonl"))
    assert len(dumps) == 2
    validate = subprocess.run(
        [*RLTOOL, "validate-rollouts", *map(str, dumps)], cwd=REPO, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert validate.returncode == 0, validate.stdout[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(demo_cache_dir(), local_files_only=True)
    gaps_seen = 0
    for dump in dumps:  # shifted targets: answer, masked feedback or tool result, answer
        inspect = subprocess.run(
            [*RLTOOL, "inspect-batch", str(dump), "--format", "json"], cwd=REPO, env=env,
            capture_output=True, text=True,
        )  # fmt: skip
        assert inspect.returncode == 0, inspect.stderr[-3000:]
        for sample in json.loads(inspect.stdout)["samples"]:
            ids, sup = np.asarray(sample["input_ids"]), np.asarray(sample["targets"]) != -100
            edges = np.flatnonzero(np.diff(np.r_[0, sup.astype(int), 0]))  # start, end, ...
            for end, start in zip(edges[1:-1:2], edges[2::2], strict=True):
                masked = tokenizer.decode(ids[end + 1 : start + 1].tolist())
                assert "calculator:" in masked or "<tool_response>" in masked, masked
                gaps_seen += 1
    assert gaps_seen > 0


def test_the_session_servers_body_limit_is_an_option(tokenizer):
    loop, _ = make_loop(tokenizer, "#### 12", max_body_bytes=4096)
    with loop._server(SamplingConfig(max_new_tokens=4)) as server:
        assert server.max_body_bytes == 4096
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"agent_loop\.options\.max_body_bytes must be"):
            make_loop(tokenizer, "#### 12", max_body_bytes=bad)
